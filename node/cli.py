"""The ``intellect-node`` command line: a thin dispatcher.

Each subcommand parses its flags here and imports its heavy code (torch, transformers, libp2p,
aiohttp) only when it runs, so ``intellect-node --help`` is instant. Every command that takes
``--run`` loads the run spec through :func:`load_spec`, which refuses unsigned or tampered specs.
Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from node import __version__
from node.paths import default_data_dir, default_key_path

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


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


# --- identity -----------------------------------------------------------------------------------


@command
def _keygen(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="create a node key (ed25519) and print its peer ID")
    p.add_argument("--key", help=f"key file to create (default: {default_key_path()})")
    p.set_defaults(handler=_run_keygen)


def _run_keygen(args: argparse.Namespace) -> int:
    from protocol.errors import KeyFileError
    from protocol.identity import NodeKey

    path = Path(args.key) if args.key else default_key_path()
    key = NodeKey.generate()
    try:
        key.save(path)
    except KeyFileError as e:
        raise CliError(str(e)) from None
    print(key.peer_id)
    print(f"key written to {path} (mode 0600)", file=sys.stderr)
    return 0


@command
def _id(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("id", help="print the peer ID of a node key")
    p.add_argument("--key", help=f"key file (default: {default_key_path()})")
    p.set_defaults(handler=lambda a: print(load_key(a.key).peer_id) or 0)


# --- run spec -----------------------------------------------------------------------------------


@command
def _spec(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="create or inspect a signed run spec")
    ssub = p.add_subparsers(dest="spec_cmd", required=True, metavar="{init,show}")
    init = ssub.add_parser("init", help="write a run spec signed by the coordinator key")
    init.add_argument("--coordinator-key", required=True, help="the coordinator's key file")
    init.add_argument("--out", required=True, help="path of the TOML file to write")
    init.add_argument("--name", default="devnet", help="run name (default: devnet)")
    init.add_argument("--seed", type=int, default=None, help="run seed (default: random)")
    init.add_argument("--validator", action="append", default=[], metavar="PEER_ID", help="validator peer ID (repeatable)")
    init.add_argument("--async-level", type=int, default=None, help="max policy staleness in steps (default 2)")
    init.add_argument("--group-size", type=int, default=None, help="rollouts per task (default 8)")
    init.add_argument("--piece-size", type=int, default=None, help="Shardcast piece size in bytes (default 16 MiB)")
    init.add_argument("--keep-steps", type=int, default=None, help="checkpoint steps relays keep (default async level + 1)")
    init.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    init.add_argument("--ingest-url", action="append", default=[], metavar="URL", help="coordinator ingest URL (repeatable)")
    init.add_argument("--origin-url", action="append", default=[], metavar="URL", help="Shardcast origin URL (repeatable)")
    init.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    init.set_defaults(handler=_run_spec_init)
    show = ssub.add_parser("show", help="print a run spec and whether its signature holds")
    show.add_argument("path")
    show.set_defaults(handler=_run_spec_show)


def _run_spec_init(args: argparse.Namespace) -> int:
    import secrets

    from pydantic import ValidationError

    from protocol import runspec as rs

    key = load_key(args.coordinator_key)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise CliError(f"{out} exists; pass --force to overwrite it")
    rl = {k: v for k, v in {"async_level": args.async_level, "group_size": args.group_size}.items() if v is not None}
    async_level = rl.get("async_level", rs.RLSpec().async_level)
    shard = {"keep_steps": args.keep_steps if args.keep_steps is not None else async_level + 1}
    if args.piece_size is not None:
        shard["piece_size_bytes"] = args.piece_size
    try:
        spec = rs.RunSpec(
            run=rs.RunInfo(
                name=args.name,
                seed=secrets.randbits(62) if args.seed is None else args.seed,
                coordinator=key.peer_id,
                validators=args.validator,
            ),
            rl=rs.RLSpec(**rl),
            shardcast=rs.ShardcastSpec(**shard),
            network=rs.NetworkSpec(bootstrap=args.bootstrap, ingest_urls=args.ingest_url, origin_urls=args.origin_url),
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise CliError(f"invalid option for {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    signed = rs.sign_run_spec(spec, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(rs.dump_run_spec(signed))
    tmp.replace(out)
    print(f"run spec written to {out}; run ID {signed.run_id.hex()}")
    return 0


def _run_spec_show(args: argparse.Namespace) -> int:
    from protocol.runspec import dump_run_spec

    signed = load_spec(args.path)
    print(dump_run_spec(signed), end="")
    print(f"# signature: valid (coordinator {signed.spec.run.coordinator}); run ID {signed.run_id.hex()}")
    return 0


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
    except KeyboardInterrupt:
        return 130


_ = default_data_dir  # re-exported for subcommand modules
logging.getLogger(__name__)

if __name__ == "__main__":
    sys.exit(main())
