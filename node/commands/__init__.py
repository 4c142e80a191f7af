"""CLI subcommands, one module per command family (registered in node.cli.COMMAND_MODULES)."""
