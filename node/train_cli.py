"""``intellect-train``: the coordinator process (one process, or every rank under ``torchrun``).

Rank 0 runs the ingest, the Shardcast origin, gossip and the training loop; other ranks join the
collectives only. Exit status 0 on success, 1 when training stopped on an error (for example no
batch within ``--batch-timeout``), 2 on bad usage or input.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from node import __version__
from node.cli import add_gossip_arguments
from node.paths import default_data_dir

if TYPE_CHECKING:
    from node.coordinator.role import CoordinatorOptions
    from protocol.identity import NodeKey
    from protocol.runspec import SignedRunSpec
    from trainer.distributed import DistContext

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="intellect-train", description="Coordinator of an intellect-node run: ingest, async GRPO, publishing.")
    p.add_argument("--version", action="version", version=f"intellect-train {__version__}")
    p.add_argument("--run", required=True, help="the signed run spec (TOML)")
    p.add_argument("--key", required=True, help="the coordinator key (must be the run spec's coordinator)")
    p.add_argument("--data-dir", default=None, help=f"state directory (default: {default_data_dir()}/coordinator)")
    p.add_argument("--resume", action="store_true", help="continue from the latest saved training state")
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface for ingest + origin (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (default: any free port, printed at start)")
    p.add_argument("--public-url", default="", help="URL other nodes reach this server at (default http://HOST:PORT)")
    add_gossip_arguments(p, off_help="stay off gossip (workers must use the run spec's URLs)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many trainer steps")
    p.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="after the last step (--max-steps), keep serving the final policy, /status and gossip for up to S seconds "
                        "or until SIGTERM/Ctrl-C, so relays and nodes fetch the last step before the origin closes (default 0)")
    p.add_argument("--batch-timeout", type=float, default=600.0, help="seconds without a full batch before giving up (default 600)")
    p.add_argument("--wait-log-every", type=float, default=None, metavar="SECONDS",
                   help="log a wait for a batch at WARNING once it lasted this long, then this often (default 30)")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out task in evaluations (0: none)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default: start and end only)")
    p.add_argument("--data-root", default=None,
                   help="directory of the public task sets (math/, code/): required when data.tasks names one (gsm8k, gsm8k_train, …)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--probe-tasks", type=int, default=4,
                   help="training tasks sampled (a whole group each) at start to check the run can learn: a warning names what to "
                        "change when every group's rewards are equal (0: skip; default 4)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    p.add_argument("--log-json", action="store_true", help="log as JSON lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from node.cli import CliError, gossip_config, load_key, load_spec
    from node.fds import raise_open_files_limit
    from node.logs import setup_logging

    setup_logging(args.verbose, json_lines=args.log_json)
    raise_open_files_limit()  # connection caps come from it (node/fds.py)
    try:
        signed = load_spec(args.run)
        key = load_key(args.key)
        gossip = gossip_config(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.wait_log_every is not None and not args.wait_log_every > 0:
        print(f"error: --wait-log-every {args.wait_log_every}: must be a number of seconds > 0", file=sys.stderr)
        return 2
    if key.peer_id != signed.spec.run.coordinator:
        print(f"error: {args.key} holds {key.peer_id}, not the run's coordinator {signed.spec.run.coordinator}", file=sys.stderr)
        return 2
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir() / "coordinator"
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    from node.coordinator.role import CoordinatorOptions, follow_rank
    from trainer.distributed import init_distributed

    ctx = init_distributed()
    if not ctx.is_main:
        from protocol.errors import ProtocolError

        # SIGTERM (torchrun forwards it to every rank) and Ctrl-C's SIGINT stop rank 0, whose loop then
        # tells every rank to stop after the step in progress (trainer.loop); a rank > 0 that died at once
        # would leave rank 0 waiting in a collective. torchrun SIGKILLs ranks still alive 30 s later.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)

        try:
            follow_rank(signed, data_dir, ctx, resume=args.resume, data_root=Path(args.data_root) if args.data_root else None)
        except ProtocolError as e:
            print(f"error: rank {ctx.rank}: {e}", file=sys.stderr)
            return 2
        return 0
    options = CoordinatorOptions(
        data_dir=data_dir, host=args.host, port=args.http_port, public_url=args.public_url, gossip=gossip, max_steps=args.max_steps,
        resume=args.resume, batch_timeout_s=args.batch_timeout, eval_samples=args.eval_samples, eval_every=args.eval_every,
        data_root=Path(args.data_root) if args.data_root else None, device=args.device, probe_tasks=args.probe_tasks, linger_s=args.linger,
        **({} if args.wait_log_every is None else {"wait_log_interval_s": args.wait_log_every}),
    )
    from protocol.errors import ProtocolError

    try:
        return asyncio.run(_run(signed, key, options, ctx))
    except ProtocolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


async def _run(signed: SignedRunSpec, key: NodeKey, options: CoordinatorOptions, ctx: DistContext) -> int:
    from node.coordinator.role import Coordinator
    from trainer.errors import TrainerError

    coord = Coordinator(signed, key, options, ctx)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, coord.request_stop)
    try:
        await coord.start()
        addrs = " ".join(coord.gossip.addrs) if coord.gossip else "(gossip off)"
        print(f"coordinator {key.peer_id} serving {coord.url}; gossip {addrs}", flush=True)
        if options.host in ("0.0.0.0", "::") and not options.public_url:
            print("warning: serving on all interfaces without --public-url: the run address names "
                  f"{coord.url}, which other machines cannot reach; pass --public-url http://HOST:PORT", file=sys.stderr, flush=True)
        # contributors join with this one string (docs/operators.md §0): intellect-node join --role worker ADDRESS
        print(f"run address: {coord.run_address()}", flush=True)
        await coord.run()
        await coord.linger()
    except TrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        await coord.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
