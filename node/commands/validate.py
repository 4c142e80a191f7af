"""`validate`: run a validator of a run (its key must be named in the run spec)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from node.cli import CliError, add_gossip_arguments, add_run_argument, command, gossip_config, load_key, open_run_arg
from node.paths import default_data_dir
from validator.spot import DEFAULT_FULL_CHECKS, DEFAULT_MIN_SHARE


@command
def _validate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("validate", help="re-check submissions (TOPLOC, sampling, termination, tasks, rewards) and sign verdicts")
    add_run_argument(p, wait=True)
    p.add_argument("--key", required=True, help="the validator key (its peer ID must be in the run spec)")
    p.add_argument("--data-dir", default=None, help=f"node data directory (default: {default_data_dir()})")
    p.add_argument("--http-port", type=int, default=0, help="status port for /status and /metrics (default: any)")
    p.add_argument("--full-checks", type=int, default=DEFAULT_FULL_CHECKS,
                   help="check every submission of a worker in full until it has this many accepted full checks since its last doubt "
                        "(docs/validator.md §5)")
    p.add_argument("--min-share", type=float, default=DEFAULT_MIN_SHARE,
                   help="after that a share full-checks / verified of its submissions is checked in full, never below this; "
                        "1 checks everything in full")
    p.add_argument("--ingest-url", action="append", default=[], metavar="URL", help="coordinator ingest URL (default: the run spec's)")
    p.add_argument("--data-root", default=None,
                   help="directory of the public task sets (math/, code/); without it the task list is fetched as the run's "
                        "tasks artifact (pinned in the spec), or read from the spec's path")
    p.add_argument("--device", default="cpu", help="torch device for prefill (cpu, cuda)")
    add_gossip_arguments(p, off_help="stay off gossip (checkpoints from the run spec's origin URLs)")
    p.set_defaults(handler=run_validate)


def run_validate(args: argparse.Namespace) -> int:
    """``validate`` (and ``join --role validate``): open the run, check the key is a validator's, run until stopped."""
    from protocol.artifacts import TASKS_ARTIFACT

    key = load_key(args.key)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    joined = open_run_arg(args, data_dir, artifacts=() if args.data_root else (TASKS_ARTIFACT,))  # before the heavy imports
    signed = joined.signed
    from node.lifecycle import run_until_stopped
    from node.validator.role import ValidatorNode, ValidatorOptions
    from validator.spot import SpotCheckPolicy

    if not signed.spec.is_validator(key.peer_id):
        raise CliError(f"{args.key} holds {key.peer_id}, which the run spec does not name as a validator; "
                       f"ask the coordinator to add it (spec init --validator {key.peer_id})")
    if not 0.0 < args.min_share <= 1.0:
        raise CliError("--min-share must be in (0, 1]")
    if args.full_checks < 1:
        raise CliError("--full-checks must be at least 1")
    gossip = gossip_config(args)
    ingest = list(args.ingest_url) or ([] if signed.spec.network.ingest_urls else joined.http_urls)
    options = ValidatorOptions(data_dir=data_dir, data_root=Path(args.data_root) if args.data_root else None, artifacts=joined.artifacts,
                               gossip=gossip, http_port=args.http_port, spot=SpotCheckPolicy(args.full_checks, args.min_share),
                               ingest_urls=ingest, device=args.device)
    if not (options.ingest_urls or signed.spec.network.ingest_urls):
        raise CliError("no ingest URL: the run spec has none; pass --ingest-url")

    asyncio.run(run_until_stopped(ValidatorNode(signed, key, options), f"validator {key.peer_id}"))
    return 0
