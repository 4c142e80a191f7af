"""The ``intellect-node`` command line: a thin dispatcher.

Each subcommand parses its flags here and imports its heavy code (torch, transformers, libp2p,
aiohttp) only when it runs, so ``intellect-node --help`` is instant. Every command that takes
``--run`` loads the run spec through :func:`load_spec`, which refuses unsigned or tampered specs;
the commands a contributor runs (``join``, ``validate``, ``doctor``, ``status``) also take the
run's address instead (:func:`add_run_argument`, :func:`open_run_arg`; ``node/bootstrap.py``).
Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from node import __version__
from node.paths import default_key_path

if TYPE_CHECKING:
    from node.bootstrap import JoinedRun
    from node.p2p import GossipConfig
    from protocol.identity import NodeKey
    from protocol.runspec import SignedRunSpec

Handler = Callable[[argparse.Namespace], int]
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
"""A command module's function that adds its subparsers (see :func:`command`)."""
_COMMANDS: list[Register] = []

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


def command(register: Register) -> Register:
    _COMMANDS.append(register)
    return register


def load_spec(path: str) -> SignedRunSpec:
    """Load and verify ``--run``; a bad spec is a :class:`CliError` naming the problem."""
    from protocol.errors import RunSpecError
    from protocol.runspec import load_run_spec

    try:
        return load_run_spec(Path(path))
    except RunSpecError as e:
        raise CliError(str(e)) from None


JOIN_WAIT_S = 300.0
"""How long a long-running node (``join``, ``validate``) keeps asking an address whose locations do not answer yet, seconds."""


def add_run_argument(p: argparse.ArgumentParser, *, wait: bool = False) -> None:
    """Add the positional ``ADDRESS`` and ``--run`` (one of them is required; read by :func:`open_run_arg`),
    and with ``wait`` ``--join-wait`` (a node that runs until stopped waits for a coordinator still starting)."""
    p.add_argument("address", nargs="?", default=None, metavar="ADDRESS",
                   help="the run's address (intellect1:PEER_ID/RUN_ID@URL,…) as the coordinator prints it: the signed spec "
                        "and the task list are fetched and verified from it (docs/operators.md §0)")
    p.add_argument("--run", default=None, metavar="RUN", help="the signed run spec (TOML file), or the run's address, instead of ADDRESS")
    if wait:
        p.add_argument("--join-wait", type=float, default=JOIN_WAIT_S, metavar="S",
                       help=f"while no location of the address answers (a coordinator still starting), keep asking for up to S "
                            f"seconds (default {JOIN_WAIT_S:g}; 0: give up at once)")


def open_run_arg(args: argparse.Namespace, data_dir: Path, *, artifacts: Sequence[str] = ()) -> JoinedRun:
    """The run of ``ADDRESS`` or ``--run`` (:func:`node.bootstrap.open_run`), with the address's
    bootstrap peers added to ``args.bootstrap`` when the command has that flag. Opened once per
    command (kept as ``args.joined``): a command opens it before importing its heavy modules, so a
    refusal is printed at once.

    Raises:
        CliError: neither or both given, or the run could not be opened (one line: a malformed or
            foreign address, a spec that does not verify, an artifact that is not the pinned one).
    """
    from node.bootstrap import JoinError, open_run

    if getattr(args, "joined", None) is not None:
        return args.joined  # type: ignore[no-any-return]
    if bool(args.address) == bool(args.run):
        raise CliError("name the run once: its address (intellect1:…) or --run run.toml")
    try:
        joined = open_run(args.address or args.run, data_dir, artifacts=artifacts, wait_s=getattr(args, "join_wait", 0.0))
    except JoinError as e:
        raise CliError(str(e)) from None
    if isinstance(getattr(args, "bootstrap", None), list):
        args.bootstrap = list(dict.fromkeys([*args.bootstrap, *joined.bootstrap]))
    args.joined = joined
    return joined


def load_key(path: str | None, data_dir: str | None = None, *, create: bool = False) -> NodeKey:
    """Load the node key from ``--key`` (or the data dir's default); optionally create it."""
    from protocol.errors import KeyFileError
    from protocol.identity import NodeKey

    key_path = Path(path) if path else default_key_path(Path(data_dir) if data_dir else None)
    try:
        return NodeKey.load_or_create(key_path) if create else NodeKey.load(key_path)
    except KeyFileError as e:
        raise CliError(str(e)) from None


def env_arg_values(items: list[str]) -> dict[str, Any]:
    """``--env-arg KEY=VALUE`` flags (``devnet``, ``spec init``) as ``env.args``: dotted keys nest
    tables, values as TOML reads them (a bare word is a string).

    Raises:
        CliError: a flag without ``=``, an empty key part, or a key that is both a value and a table.
    """
    import tomllib

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise CliError(f"--env-arg {item!r}: expected KEY=VALUE, e.g. --env-arg basic_arithmetic.max_terms=2")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        table = out
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise CliError(f"--env-arg {item!r}: {part!r} is already a value, not a table")
        table[parts[-1]] = value
    return out


def add_gossip_arguments(p: argparse._ActionsContainer, *, off_help: str) -> None:
    """Add ``--p2p-port``, ``--listen-host``, ``--bootstrap``, ``--max-peers-per-ip`` and ``--no-gossip`` (read back by
    :func:`gossip_config`).

    Args:
        p: the parser or argument group of a command that joins gossip.
        off_help: what ``--no-gossip`` means for this command (where it gets checkpoints or peers instead).
    """
    p.add_argument("--p2p-port", type=int, default=0, help="libp2p TCP port (default: any free port)")
    p.add_argument("--listen-host", default="127.0.0.1", help="interface for libp2p (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="bootstrap peer /ip4/…/tcp/…/p2p/12D3KooW… (repeatable; added to the run spec's)")
    p.add_argument("--max-peers", type=int, default=64, metavar="N",
                   help="libp2p connections in all (default 64). A hub holds one per attached worker: raise it on relays, "
                        "validators and the coordinator to carry more workers (docs/capacity.md)")
    p.add_argument("--max-peers-per-ip", type=int, default=8, metavar="N",
                   help="libp2p connections accepted from one remote IP (default 8; loopback is not counted; 0: no limit). "
                        "Raise it on relays and validators that serve many workers behind one NAT address")
    p.add_argument("--no-gossip", action="store_true", help=off_help)


_GOSSIP_FLAGS = {"listen_host": "--listen-host", "p2p_port": "--p2p-port", "bootstrap": "--bootstrap",
                 "max_peers": "--max-peers", "max_peers_per_ip": "--max-peers-per-ip"}


def gossip_config(args: argparse.Namespace) -> GossipConfig | None:
    """The gossip settings the flags of :func:`add_gossip_arguments` ask for; ``None`` with ``--no-gossip``.

    Raises:
        CliError: a flag out of range (a port above 65535, more than 64 or over-long bootstrap
            addresses) or a bootstrap address that is not a multiaddr ending in ``/p2p/<peer ID>``,
            in one line naming the flag.
    """
    if args.no_gossip:
        return None
    from pydantic import ValidationError

    from node.p2p import GossipConfig

    try:
        config = GossipConfig(listen_host=args.listen_host, p2p_port=args.p2p_port, bootstrap=args.bootstrap,
                              max_peers=args.max_peers, max_peers_per_ip=args.max_peers_per_ip)
    except ValidationError as e:
        err = e.errors()[0]
        flag = _GOSSIP_FLAGS.get(str(err["loc"][0]) if err["loc"] else "", "gossip option")
        raise CliError(f"invalid {flag}: {err['msg']}") from None
    from node.p2p.host import parse_peer_addr

    for addr in config.bootstrap:  # a typo would only be a warning once running, leaving the node without its peer
        try:
            parse_peer_addr(addr)
        except ValueError as e:
            raise CliError(f"invalid --bootstrap: {e}") from None
    return config


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


def run() -> NoReturn:
    """The ``intellect-node`` command (and ``python -m node``): :func:`main`, then exit without the
    interpreter's final garbage collection over every loaded module's objects.

    That collection frees nothing an exiting process needs (the roles close their files, stores and
    sockets in their own stops; logging flushes at exit, before it) and was most of a role's exit:
    four relays stopped by SIGTERM together exited 0.8-1.3 s after it, past a supervisor's 1 s grace
    (shared/checks/gossip_status.sh killed them), against 0.07-0.13 s with it skipped (4 Dec 2026,
    load 2). Tests call :func:`main` in-process, which stays as it was.
    """
    rc = main()
    gc.freeze()  # what is alive now is never collected: the interpreter's shutdown does not walk it
    sys.exit(rc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``intellect-node``; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from node.logs import setup_logging

    setup_logging(args.verbose, json_lines=args.log_json)
    from node.fds import raise_open_files_limit

    raise_open_files_limit()  # connection caps come from it (node/fds.py)
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


