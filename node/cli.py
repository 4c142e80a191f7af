"""The ``intellect-node`` command line: a thin dispatcher.

Each subcommand parses its flags here and imports its heavy code (torch, transformers, libp2p,
aiohttp) only when it runs, so ``intellect-node --help`` is instant. Every command that takes
``--run`` loads the run spec through :func:`load_spec`, which refuses unsigned or tampered specs.
Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from node import __version__
from node.paths import default_key_path

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []

# One module per command family under node/commands/; each registers its subparsers with @command.
COMMAND_MODULES = (
    "node.commands.identity",
    "node.commands.spec",
    "node.commands.status",
    "node.commands.shardcast",
    "node.commands.join",
    "node.commands.validate",
    "node.commands.devnet",
    "node.commands.doctor",
)


class CliError(Exception):
    """A user-facing failure: printed as ``error: …`` and exit status 2."""


def command(register: Callable[[argparse._SubParsersAction], None]) -> Callable[[argparse._SubParsersAction], None]:
    _COMMANDS.append(register)
    return register


def load_spec(path: str):  # noqa: ANN201 - returns protocol.runspec.SignedRunSpec
    """Load and verify ``--run``; a bad spec is a :class:`CliError` naming the problem."""
    from protocol.errors import RunSpecError
    from protocol.runspec import load_run_spec

    try:
        return load_run_spec(Path(path))
    except RunSpecError as e:
        raise CliError(str(e)) from None


def load_key(path: str | None, data_dir: str | None = None, *, create: bool = False):  # noqa: ANN201
    """Load the node key from ``--key`` (or the data dir's default); optionally create it."""
    from protocol.errors import KeyFileError
    from protocol.identity import NodeKey

    key_path = Path(path) if path else default_key_path(Path(data_dir) if data_dir else None)
    try:
        return NodeKey.load_or_create(key_path) if create else NodeKey.load(key_path)
    except KeyFileError as e:
        raise CliError(str(e)) from None


# --- entry --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every registered subcommand)."""
    parser = argparse.ArgumentParser(
        prog="intellect-node",
        description="Peer-to-peer compute client for decentralized RL post-training (GRPO) of language models.",
    )
    parser.add_argument("--version", action="version", version=f"intellect-node {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument("--log-json", action="store_true", help="log as JSON lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    for register in _COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``intellect-node``; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from node.logs import setup_logging

    setup_logging(args.verbose, json_lines=args.log_json)
    try:
        return int(args.handler(args) or 0)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # untrusted input (a run spec's task set, a key, a file) reported in one line
        from protocol.errors import ProtocolError

        if not isinstance(e, ProtocolError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


