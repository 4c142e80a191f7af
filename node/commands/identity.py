"""`keygen` and `id`: node identity."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from node.cli import CliError, command, load_key
from node.paths import default_key_path


@command
def _keygen(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
def _id(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("id", help="print the peer ID of a node key")
    p.add_argument("--key", help=f"key file (default: {default_key_path()})")
    p.set_defaults(handler=lambda a: print(load_key(a.key).peer_id) or 0)
