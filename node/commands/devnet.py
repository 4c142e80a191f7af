"""`devnet`: run a whole decentralized async GRPO run on this machine (the main job)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.cli import CliError, command, env_arg_values
from node.devnet.config import WORKER_DTYPES
from node.devnet.profile import PROFILES
from node.worker import ADVERSARIES

if TYPE_CHECKING:
    from node.devnet.orchestrator import Devnet, DevnetResult


def _default_data_root() -> Path | None:
    env = os.environ.get("INTELLECT_DATA_ROOT")
    if env:
        return Path(env)
    for cand in (Path.cwd() / "../shared/data", Path.cwd() / "shared/data"):
        if (cand / "math").is_dir():
            return cand.resolve()
    return None


@command
def _devnet(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("devnet", help="run every role as its own process on 127.0.0.1 and train (the main job)")
    p.add_argument("--workers", type=int, default=None, help="honest workers (default 2; 1 with --profile)")
    p.add_argument("--relays", type=int, default=None, help="Shardcast relays, in a tree under the origin (default 2; 1 with --profile)")
    p.add_argument("--validators", type=int, default=1, help="validators (default 1)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 60; 3 with --profile)")
    p.add_argument("--tasks", default=None, help="embedded (default; gsm8k with --profile), gsm8k (test split), gsm8k_train (train split), math500, math_train, humaneval, mbpp, or a path (INTELLECT-2 schema)")
    p.add_argument("--data-root", default=None, help="where the public task sets are (default: $INTELLECT_DATA_ROOT or ../shared/data)")
    p.add_argument("--env", default=None, metavar="NAME",
                   help="train on your own environment instead of --tasks: reasoning_gym:NAME[=WEIGHT][,NAME...] (needs the "
                        "reasoning-gym extra), verifiers:MODULE (the verifiers extra) or a .py file with score(task, completion) "
                        "(docs/tasks.md § Your own environment); its code runs in the bubblewrap sandbox")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an env.args value, dotted keys into tables: --env-arg basic_arithmetic.max_terms=2 --env-arg answer=text "
                        "(repeatable; values as TOML reads them, a bare word is a string)")
    p.add_argument("--adversary", choices=ADVERSARIES, default=None, help="add one dishonest worker of this kind")
    p.add_argument("--steer-rate", type=float, default=None, metavar="R",
                   help="with --adversary steer: the share of its chances the steering worker takes (0 … 1, default 1)")
    p.add_argument("--worker-dtype", choices=list(WORKER_DTYPES), default="fp32",
                   help="what every worker (and the adversary) computes in (default fp32). bf16 signs a spec fit for bf16 "
                        "workers (replay rule logit-bound-v3 with tolerances measured on the base, the per-worker audit, "
                        "policies published in bf16; node/devnet/config.py precision_toploc, docs/devnet.md § Precision)")
    p.add_argument("--sampling-rule", choices=["icdf-v1", "gumbel-v2"], default="icdf-v1",
                   help="the run's sampling rule (default icdf-v1); gumbel-v2 needs --worker-dtype bf16 and shrinks what one "
                        "token can do (docs/toploc.md §5.3)")
    p.add_argument("--kill-worker-at", type=int, default=None, metavar="STEP", help="SIGKILL worker-0 at this trainer step, then restart it")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for logs, data and the report: missing, empty, or a previous devnet's (replaced; devnet outputs "
                        "inside it are kept). Default: a new folder devnet-out/<UTC time>, with devnet-out/latest pointing at it")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default 900; 3600 with --profile)")
    p.add_argument("--seed", type=int, default=None, help="run seed (default random)")
    p.add_argument("--async-level", type=int, default=None, help="max policy staleness in steps (default 2)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="held-out evaluation every N trainer steps (default: steps/6 rounded up, so the curve has ≥ 6 points after the start)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="samples per held-out problem in each evaluation (default 16; 0, none, with --profile: random weights score 0)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="train your own model: a local Hugging Face directory of the Qwen2 family (model_type qwen2: Qwen2, Qwen2.5), "
                        "as save_pretrained or a hub download writes it (config.json, *.safetensors in float32 or bfloat16, "
                        "tokenizer.json; a chat template is used when the tokenizer has one); default: the embedded model")
    p.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the run spec's [rl] section, e.g. --rl is_correction=truncate --rl old_logprobs=recompute "
                        "(repeatable; checked like a spec file's)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="train a real-shape model: qwen2.5-0.5b (hidden 896, 24 layers, 14/2 heads, 151,936-token byte-level BPE trained "
                        "here on the task text, tied embeddings, random weights, bf16 published, fp32 masters; built once per machine "
                        "and cached; ≈ 16 GB of memory with 1 worker); one task × group 4 × 32 tokens per submission")
    p.add_argument("--profile-layers", type=int, default=None, metavar="N",
                   help="with --profile: N decoder layers instead of the profile's (same vocabulary, width and tokenizer; a cheap rehearsal)")
    p.add_argument("--links", action="store_true",
                   help="every node in its own network namespace behind a token-bucket-capped link (coordinator and relays "
                        "1 Gb/s, validators 500 Mb/s, workers 100 Mb/s; root only; all removed on exit)")
    p.add_argument("--link-mbit", action="append", default=[], metavar="ROLE=MBIT",
                   help="with --links: another rate for one role's links, Mb/s (roles: coordinator, relay, validator, worker; "
                        "repeatable), e.g. --link-mbit worker=1000 for contributors on gigabit links")
    p.add_argument("--no-deltas", action="store_true", help="publish and fetch every policy step in full (no step deltas), for comparison")
    p.add_argument("--no-dashboard", action="store_true", help="plain progress lines instead of the live view")
    p.set_defaults(handler=_run_devnet)


def _link_rates(items: list[str], *, links: bool) -> dict[str, int]:
    """``--link-mbit ROLE=MBIT`` values as ``role → Mb/s`` (``node/devnet/links.py``'s ``Links.mbit``).

    Raises:
        CliError: without ``--links``, an unknown role, a rate that is not a whole number in 1 … 100,000, or a role given twice.
    """
    from node.devnet.links import LINK_MBIT

    if items and not links:
        raise CliError("--link-mbit sets link rates of --links: add --links")
    rates: dict[str, int] = {}
    for item in items:
        role, sep, value = item.partition("=")
        if not sep or role not in LINK_MBIT:
            raise CliError(f"--link-mbit {item!r}: expected ROLE=MBIT with ROLE one of {', '.join(LINK_MBIT)}, e.g. worker=1000")
        if not value.isdigit() or not 1 <= int(value) <= 100_000:
            raise CliError(f"--link-mbit {item!r}: the rate is a whole number of Mb/s from 1 to 100000")
        if role in rates:
            raise CliError(f"--link-mbit: {role} given twice")
        rates[role] = int(value)
    return rates


def _rl_overrides(items: list[str], *, embedded: bool, async_level: int | None, profile: bool = False) -> dict[str, Any]:
    """``--rl KEY=VALUE`` flags as ``[rl]`` fields (values as TOML reads them; a bare word is a
    string), checked on the devnet's own ``[rl]`` section (``node.devnet.config.devnet_rl``).

    Raises:
        CliError: a flag without ``=``, an unknown field, or a value the field refuses (the
            message names the field and why).
    """
    import tomllib

    from pydantic import ValidationError

    from node.devnet.config import devnet_rl

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CliError(f"--rl {item!r}: expected KEY=VALUE, e.g. --rl is_correction=truncate")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()  # a bare word: a string
        out[key] = value
    try:
        devnet_rl(embedded=embedded, async_level=async_level, rl_overrides=out, profile=profile)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise CliError(f"--rl{' ' + where if where else ''}: {err.get('msg')}") from None
    return out


def _run_devnet(args: argparse.Namespace) -> int:
    from node.devnet.orchestrator import Devnet, DevnetOptions
    from node.devnet.outdir import OutDirError, check_out, new_default_out
    from node.devnet.report import write_report
    from protocol.errors import ProtocolError
    from protocol.models import ModelLoadError

    profile = args.profile is not None
    workers = args.workers if args.workers is not None else 1 if profile else 2
    relays = args.relays if args.relays is not None else 1 if profile else 2
    steps = args.steps if args.steps is not None else 3 if profile else 60
    tasks = args.tasks or ("gsm8k" if profile else "embedded")
    eval_samples = args.eval_samples if args.eval_samples is not None else 0 if profile else 16
    if workers < 1 or relays < 0 or args.validators < 1 or steps < 1:
        raise CliError("need --workers ≥ 1, --validators ≥ 1, --relays ≥ 0 and --steps ≥ 1")
    if (args.eval_every is not None and args.eval_every < 1) or eval_samples < (0 if profile else 1):
        raise CliError("need --eval-every ≥ 1 and --eval-samples ≥ 1")
    if args.profile_layers is not None and (not profile or args.profile_layers < 1):
        raise CliError("--profile-layers N needs --profile and N ≥ 1")
    if profile and args.model:
        raise CliError("--profile builds its own model; leave out --model")
    if args.steer_rate is not None and (args.adversary != "steer" or not 0.0 <= args.steer_rate <= 1.0):
        raise CliError("--steer-rate R needs --adversary steer and 0 ≤ R ≤ 1")
    link_mbit = _link_rates(args.link_mbit, links=args.links)
    model = Path(args.model).resolve() if args.model else None
    if model is not None and not model.exists():
        raise CliError(f"--model {args.model}: no such directory ({model}); pass the folder of a local Hugging Face Qwen2 model "
                       "(docs/devnet.md § Your own model says how to get one)")
    if model is not None and not model.is_dir():
        raise CliError(f"--model {args.model} is a file; pass the folder holding config.json, *.safetensors and tokenizer.json")
    if model is not None and not (model / "config.json").is_file():
        raise CliError(f"--model {args.model} has no config.json (a local Hugging Face Qwen2 directory: config.json, *.safetensors, tokenizer)")
    if args.env is not None and (args.tasks is not None or profile):
        raise CliError("--env brings its own tasks: leave out --tasks and --profile")
    if args.env_arg and args.env is None:
        raise CliError("--env-arg needs --env (the environment it configures)")
    env_name = args.env
    if env_name is not None and env_name.removeprefix("file:").endswith(".py"):
        path = Path(env_name.removeprefix("file:"))
        if not path.is_file():
            raise CliError(f"--env {env_name}: no such file")
        env_name = str(path.resolve())  # every node of the devnet reads the same file
    data_root = Path(args.data_root) if args.data_root else _default_data_root()
    if (profile or tasks != "embedded") and not Path(tasks).exists() and data_root is None:
        raise CliError(f"--tasks {tasks}{' and --profile' if profile else ''} need the public task sets: pass --data-root DIR (holding math/ and code/)")
    rl = _rl_overrides(args.rl, embedded=tasks == "embedded" and model is None and not profile, async_level=args.async_level,
                       profile=profile)
    env_arguments = env_arg_values(args.env_arg)
    if env_name is not None and not env_arguments and model is None:
        from node.devnet.config import embedded_env_args

        if (preset := embedded_env_args(env_name)) is not None:
            env_arguments = preset
            print(f"{env_name} on the embedded model: at its default difficulty the tiny model solves none, so the devnet uses "
                  f"env.args = {preset} (pass any --env-arg to set your own)", flush=True)
    from protocol.tasks import training_split_warning

    if (split_warning := training_split_warning(tasks)) is not None:
        print(f"warning: {split_warning}", flush=True)
    if args.links:
        from node.devnet.links import unavailable

        why = unavailable()
        if why:
            raise CliError(why)
    if args.out is None:
        out = new_default_out()
    else:
        out = Path(args.out)
        try:
            check_out(out)
        except OutDirError as e:
            raise CliError(str(e)) from None
    if args.sampling_rule == "gumbel-v2" and WORKER_DTYPES[args.worker_dtype] == "float32":
        raise CliError("--sampling-rule gumbel-v2 is replayed under a logit bound, which float32 workers do not use: add --worker-dtype bf16")
    timeout = args.timeout if args.timeout is not None else 3600.0 if profile else 900.0
    options = DevnetOptions(out=out, workers=workers, relays=relays, validators=args.validators, steps=steps,
                            tasks=tasks, data_root=data_root, adversary=args.adversary, kill_worker_at=args.kill_worker_at,
                            dashboard=not args.no_dashboard and sys.stdout.isatty(), timeout_s=timeout, seed=args.seed,
                            async_level=args.async_level, eval_every=args.eval_every, eval_samples=eval_samples, model=model,
                            rl=rl, profile=args.profile, profile_layers=args.profile_layers, links=args.links, link_mbit=link_mbit, deltas=not args.no_deltas,
                            env=env_name, env_args=env_arguments,
                            worker_dtype=WORKER_DTYPES[args.worker_dtype], steer_rate=1.0 if args.steer_rate is None else args.steer_rate,
                            sampling_rule=args.sampling_rule)
    live = None
    last_print = [0.0]

    def tick(dn: Devnet) -> None:
        import time

        if live is not None:
            from node.devnet.dashboard import render

            live.update(render(dn))
        elif time.monotonic() - last_print[0] > 10:
            last_print[0] = time.monotonic()
            st = dn.status
            print(f"[{time.monotonic() - dn.started:5.0f}s] step {st.get('trainer_step', '-')}/{dn.o.steps} "
                  f"state: {st.get('state', 'starting')}", flush=True)

    dn = Devnet(options, on_tick=tick)
    try:
        if options.dashboard:
            from rich.live import Live

            from node.devnet.dashboard import render

            with Live(render(dn), refresh_per_second=2, transient=False) as lv:
                live = lv
                result = dn.run()
        else:
            result = dn.run()
    except KeyboardInterrupt:
        print("interrupted; every process was stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, FileExistsError, FileNotFoundError, ModelLoadError) as e:  # LinksError is a RuntimeError
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ProtocolError as e:  # the environment: a missing extra, a file that does not load (one line)
        print(f"error: {e}", file=sys.stderr)
        return 2
    md, png = write_report(dn, result)
    for line in summary_lines(dn, result, md, png):
        print(line)
    return 0 if result.ok else 1


def summary_lines(dn: Devnet, result: DevnetResult, md: Path, png: Path) -> list[str]:
    """The end-of-run summary the devnet prints: outcome with run ID and seed, held-out gain, verdicts, chaos, files."""
    from node.devnet.report import heldout_summary, read_metrics

    st = result.coordinator
    rows = read_metrics(dn.out / "coordinator" / "metrics.jsonl")
    steps = sum(1 for r in rows if r.get("event") == "step")
    h = heldout_summary([r for r in rows if r.get("event") == "eval"])
    start = f"{h['start']:.3f}" if h["start"] is not None else "-"
    end = f"{h['end']:.3f}" if h["end"] is not None else "-"
    gain = ""
    if h["gain"] is not None:
        gain = f", gain {h['gain']:+.3f}" + (f" (95% interval {h['gain_ci'][0]:+.3f} to {h['gain_ci'][1]:+.3f})" if h["gain_ci"] else "")
    who = f"run {dn.run_id[:16]}, seed {dn.seed}"
    if result.ok:
        head = f"devnet completed {steps} of {dn.o.steps} steps in {result.wall_s:.0f} s ({who})"
    else:
        head = f"devnet FAILED after {result.wall_s:.0f} s at step {steps} of {dn.o.steps} ({who}): {result.reason}"
    lines = [head, f"held-out pass rate: start {start} -> end {end}{gain} ({h['points']} evaluations)",
             f"verdicts: {st.get('verdicts_by_reason')}; banned: {[b['peer_id'] for b in st.get('banned') or []]}"]
    outcomes = dn.worker_outcomes()
    for name, w in sorted(outcomes.items(), key=lambda kv: (kv[1]["banned_at_step"] is None, kv[1]["banned_at_step"] or 0, kv[0])):
        if w["banned"]:
            ev = w.get("ban_evidence") or {}
            detail = f": {ev['detail']}" if isinstance(ev.get("detail"), str) else ""
            at = w["banned_at_step"] if w["banned_at_step"] is not None else "?"
            lines.append(f"ban: {name} banned at trainer step {at} ({w['banned']}{detail})")
    if (adversary := dn.adversary_summary()) is not None:
        lines.append(adversary)
    if (chaos := dn.chaos_summary()) is not None:
        lines.append(f"chaos: {chaos}")
    lines.append(f"report: {md} and {png}; logs in {dn.out / 'logs'}/; rerun with --seed {dn.seed}")
    return lines
