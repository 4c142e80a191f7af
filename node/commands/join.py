"""`join`: run a node in one role of a run. Each role is a package ``node/<role>/`` (``role.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from node.cli import add_gossip_arguments, add_run_argument, command
from node.paths import default_data_dir, default_key_path


def _join_relay(args: argparse.Namespace) -> int:
    from node.relay.role import run_relay_from_args

    return run_relay_from_args(args)


def _join_worker(args: argparse.Namespace) -> int:
    from node.worker.role import run_worker_from_args

    return run_worker_from_args(args)


def _join_validate(args: argparse.Namespace) -> int:
    from node.commands.validate import run_validate

    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return run_validate(args)


ROLES: dict[str, Callable[[argparse.Namespace], int]] = {"relay": _join_relay, "worker": _join_worker, "validate": _join_validate}
"""Role name → runner; a new role adds an entry here and its flags below."""


@command
def _join(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("join", help="run a node of a run in one role (worker: generate rollouts; relay: mirror and serve checkpoints; "
                                    "validate: the same as the validate command)")
    p.add_argument("--role", required=True, choices=sorted(ROLES), help="what this node does")
    add_run_argument(p, wait=True)
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
    worker.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the model runs (default auto: cuda when torch sees a GPU, else cpu)")
    worker.add_argument("--gpu-memory-share", type=float, default=None, metavar="F",
                        help="share of the GPU's memory the engine may take (weights, KV cache, activations), 0 < F ≤ 0.95; "
                             "default: chosen from the model's shape and the GPU's free memory, and printed at start")
    worker.add_argument("--max-batch", type=int, default=None, metavar="N",
                        help="most sequences generated at once (default: chosen to fit the machine, and printed at start)")
    worker.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype of the model (default: float32 with transformers; vLLM: bfloat16 on cuda, float32 on cpu). "
                             "bfloat16 needs a run spec whose toploc.replay_rule tolerates it (logit-bound-v1, docs/toploc.md §6.2)")
    worker.add_argument("--fp32-logits", action="store_true",
                        help="with --dtype bfloat16 (transformers): logits from the float32 LM head (the final-norm row cast to float32)")
    worker.add_argument("--data-root", default=None,
                        help="directory of the public task sets (math/, code/); without it the task list is fetched as the run's "
                             "tasks artifact (pinned in the spec), or read from the spec's path")
    worker.add_argument("--ingest-url", action="append", default=[], metavar="URL", help="coordinator ingest URL (default: the run spec's)")
    worker.add_argument("--max-submissions", type=int, default=None, help="stop after this many submissions (default: run until stopped)")
    from node.worker import ADVERSARIES

    worker.add_argument("--adversary", choices=ADVERSARIES, default=None,
                        help="chaos testing only: cheat in this way so validators and bans can be seen working")
    worker.add_argument("--steer-rate", type=float, default=1.0, metavar="R",
                        help="with --adversary steer: take this share of the chances to steer (0 … 1, default 1)")
    from validator.spot import DEFAULT_FULL_CHECKS, DEFAULT_MIN_SHARE

    validate = p.add_argument_group("validate (the validate command's flags; --key must hold a validator key the spec names)")
    validate.add_argument("--full-checks", type=int, default=DEFAULT_FULL_CHECKS, help="as validate --full-checks")
    validate.add_argument("--min-share", type=float, default=DEFAULT_MIN_SHARE, help="as validate --min-share")
    gossip = p.add_argument_group("gossip (libp2p)")
    add_gossip_arguments(gossip, off_help="stay off gossip (follow --upstream only; nothing announced)")
    p.set_defaults(handler=_run_join)


def _run_join(args: argparse.Namespace) -> int:
    from pathlib import Path

    from node.cli import CliError, open_run_arg
    from protocol.artifacts import TASKS_ARTIFACT

    if args.role == "worker":
        if args.fp32_logits and (args.dtype != "bfloat16" or args.engine != "transformers"):
            raise CliError("--fp32-logits needs --dtype bfloat16 and the transformers engine")
        if not 0.0 <= args.steer_rate <= 1.0:
            raise CliError(f"--steer-rate {args.steer_rate}: must be in [0, 1]")
        if args.steer_rate != 1.0 and args.adversary != "steer":
            raise CliError("--steer-rate is for --adversary steer")
    # the run first (spec and task list fetched and verified): a refusal comes before the role's heavy imports and writes nothing
    scores = args.role in ("worker", "validate") and not args.data_root
    open_run_arg(args, Path(args.data_dir) if args.data_dir else default_data_dir(), artifacts=(TASKS_ARTIFACT,) if scores else ())
    return ROLES[args.role](args)
