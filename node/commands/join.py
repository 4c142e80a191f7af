"""`join`: run a node in one role of a run. Each role is a package ``node/<role>/`` (``role.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from node.cli import add_gossip_arguments, command
from node.paths import default_data_dir, default_key_path


def _join_relay(args: argparse.Namespace) -> int:
    from node.relay.role import run_relay_from_args

    return run_relay_from_args(args)


def _join_worker(args: argparse.Namespace) -> int:
    from node.worker.role import run_worker_from_args

    return run_worker_from_args(args)


ROLES: dict[str, Callable[[argparse.Namespace], int]] = {"relay": _join_relay, "worker": _join_worker}
"""Role name → runner; a new role adds an entry here and its flags below."""


@command
def _join(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("join", help="run a node of a run in one role (worker: generate rollouts; relay: mirror and serve checkpoints)")
    p.add_argument("--role", required=True, choices=sorted(ROLES), help="what this node does")
    p.add_argument("--run", required=True, help="the signed run spec (TOML)")
    p.add_argument("--data-dir", default=None, help=f"node data directory (default: {default_data_dir()})")
    p.add_argument("--key", default=None, help=f"node key file; created if absent (default: <data-dir>/{default_key_path().name})")
    p.add_argument("--http-port", type=int, default=0,
                   help="relay: Shardcast HTTP port; worker: /status and /metrics port (default: any free port, printed at start)")
    relay = p.add_argument_group("relay")
    relay.add_argument("--host", default="127.0.0.1", help="interface to serve on (default 127.0.0.1; 0.0.0.0 for everyone)")
    relay.add_argument("--public-url", default="",
                       help="URL other nodes reach this relay at, announced on gossip (default http://HOST:PORT; set it with --host 0.0.0.0)")
    relay.add_argument(
        "--upstream", action="append", default=[], metavar="URL",
        help="origin or relay to follow (repeatable); without any, this node is the origin and serves its store",
    )
    worker = p.add_argument_group("worker")
    worker.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                        help="inference engine (vllm: optional extra 'gpu')")
    worker.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    worker.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype of the model (default: float32 with transformers; vLLM: bfloat16 on cuda, float32 on cpu). "
                             "bfloat16 needs a run spec whose toploc.replay_rule tolerates it (logit-bound-v1, docs/toploc.md §6.2)")
    worker.add_argument("--fp32-logits", action="store_true",
                        help="with --dtype bfloat16 (transformers): logits from the float32 LM head (the final-norm row cast to float32)")
    worker.add_argument("--data-root", default=None,
                        help="directory of the public task sets (math/, code/): required when data.tasks names one (gsm8k, gsm8k_train, …)")
    worker.add_argument("--ingest-url", action="append", default=[], metavar="URL", help="coordinator ingest URL (default: the run spec's)")
    worker.add_argument("--max-submissions", type=int, default=None, help="stop after this many submissions (default: run until stopped)")
    from node.worker import ADVERSARIES

    worker.add_argument("--adversary", choices=ADVERSARIES, default=None,
                        help="chaos testing only: cheat in this way so validators and bans can be seen working")
    worker.add_argument("--steer-rate", type=float, default=1.0, metavar="R",
                        help="with --adversary steer: take this share of the chances to steer (0 … 1, default 1)")
    gossip = p.add_argument_group("gossip (libp2p)")
    add_gossip_arguments(gossip, off_help="stay off gossip (follow --upstream only; nothing announced)")
    p.set_defaults(handler=_run_join)


def _run_join(args: argparse.Namespace) -> int:
    from node.cli import CliError

    if args.role == "worker":
        if args.fp32_logits and (args.dtype != "bfloat16" or args.engine != "transformers"):
            raise CliError("--fp32-logits needs --dtype bfloat16 and the transformers engine")
        if not 0.0 <= args.steer_rate <= 1.0:
            raise CliError(f"--steer-rate {args.steer_rate}: must be in [0, 1]")
        if args.steer_rate != 1.0 and args.adversary != "steer":
            raise CliError("--steer-rate is for --adversary steer")
    return ROLES[args.role](args)
