"""`spec init` and `spec show`: the signed run spec."""

from __future__ import annotations

import argparse
from pathlib import Path

from node.cli import CliError, command, load_key, load_spec



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
