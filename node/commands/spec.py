"""`spec init` and `spec show`: the signed run spec."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from node.cli import CliError, command, load_key, load_spec


@command
def _spec(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("spec", help="create or inspect a signed run spec")
    ssub = p.add_subparsers(dest="spec_cmd", required=True, metavar="{init,show,address}")
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
    init.add_argument("--tasks", default=None, help="task set: embedded, a public set — gsm8k (test split), gsm8k_train (train split), math500 (test), "
                      "math_train (train), humaneval, mbpp — or a JSONL/Parquet file in the INTELLECT-2 schema")
    init.add_argument("--data-root", default=None,
                      help="where the public sets are; given (or with a task file path), the task list is pinned in the spec: its "
                           "hash (data.tasks_hash) and the tasks artifact contributors fetch instead of task files (artifacts.tasks)")
    init.add_argument("--tasks-per-submission", type=int, default=None, help="tasks per worker submission (default 2)")
    init.add_argument("--env", default=None, metavar="NAME",
                      help="the run's own environment instead of --tasks: reasoning_gym:NAME[=WEIGHT][,NAME...], verifiers:MODULE or a "
                           ".py file with score(task, completion) (docs/tasks.md § Your own environment); it is opened here (in the "
                           "bubblewrap sandbox) and pinned: env.hash over its files and package versions, data.tasks_hash over its tasks")
    init.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                      help="an env.args value, dotted keys into tables (repeatable): --env-arg basic_arithmetic.max_terms=2")
    init.add_argument("--env-seed", type=int, default=None, help="seed of the environment's task generator (default 0)")
    init.add_argument("--env-train-size", type=int, default=None, help="training tasks the environment generates (default 1000)")
    init.add_argument("--env-heldout-size", type=int, default=None, help="held-out tasks it generates (default 100)")
    init.add_argument("--model-base", default=None, help="'embedded' (default) or a local Qwen2 directory (config, safetensors, tokenizer): "
                      "its dtype and hidden size are read from it and its files pinned by model.base_hash")
    init.add_argument("--hidden-size", type=int, default=None, help="hidden size of the embedded model (≥ TOPLOC top-k 128; read from --model-base DIR otherwise)")
    init.add_argument("--max-tokens", type=int, default=None, help="completion length limit in tokens (default 32)")
    init.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    init.add_argument("--top-p", type=float, default=None, help="nucleus mass (default 1.0)")
    init.add_argument("--sampling-rule", choices=["icdf-v1", "gumbel-v2"], default=None,
                      help="sampling rule (docs/toploc.md §5; default icdf-v1; gumbel-v2 for bf16 workers, with --replay-rule "
                           "logit-bound-v1, -v2 or -v3: a smaller window per token, §5.3)")
    init.add_argument("--target-length", type=int, action="append", default=[], metavar="TOKENS",
                      help="length-control target (repeatable; INTELLECT-2 style 'Think for N tokens')")
    init.add_argument("--length-penalty", type=float, default=None, help="λ of the length penalty (INTELLECT-2: 0.0003)")
    init.add_argument("--learning-rate", type=float, default=None, help="AdamW learning rate (default 1e-5)")
    init.add_argument("--batch-groups", type=int, default=None, help="whole groups per trainer step (default 4)")
    init.add_argument("--old-logprobs", choices=["recompute", "behavior"], default=None,
                      help="GRPO ratio denominator (default recompute, as INTELLECT-2)")
    init.add_argument("--logprob-max-abs", type=float, default=None,
                      help="per-token tolerance on reported vs recomputed sampling log-probs, nats (default 0.01; docs/toploc.md §8)")
    init.add_argument("--logprob-mean-abs", type=float, default=None,
                      help="tolerance on their mean over a completion, nats, ≤ --logprob-max-abs (default 0.001)")
    init.add_argument("--replay-eps", type=float, default=None,
                      help="sampling replay tolerance, probability units (default 1e-4, for fp32 workers; docs/toploc.md §6.1)")
    init.add_argument("--max-near-tie-fraction", type=float, default=None,
                      help="near-tie mismatches allowed per completion (per submission under logit-bound-v2/-v3), share of its tokens (default 0.1)")
    init.add_argument("--replay-rule", choices=["eps-v1", "logit-bound-v1", "logit-bound-v2", "logit-bound-v3"], default=None,
                      help="how the sampling replay tolerates numeric noise: eps-v1 (default; fp32 workers), logit-bound-v1, -v2 or "
                           "-v3 (workers computing in bf16 against float32 validators; need --replay-logit-bound; v2 judges "
                           "near ties per submission and values within --hard-factor of a bound as benign 'precision'; v3 also a "
                           "completion's log-probs at any size, their submission mean beyond --hard-factor a cheat; docs/toploc.md §6)")
    init.add_argument("--replay-logit-bound", type=float, default=None,
                      help="the logit rules' bound δ, nats: measure it with --measure-precision (docs/toploc.md §10)")
    init.add_argument("--worker-dtype", choices=["float32", "bfloat16"], default=None,
                      help="the honest workers' compute dtype the tolerances are for (default float32)")
    init.add_argument("--fp32-logits", action="store_true",
                      help="bf16 workers take their logits from the float32 LM head (the tolerances assume it; docs/toploc.md §10)")
    init.add_argument("--hard-factor", type=float, default=None,
                      help="logit-bound-v2/-v3: values within this multiple of a bound are benign 'precision', beyond it cheats (default 2)")
    init.add_argument("--measure-precision", choices=["float32", "bfloat16"], default=None, metavar="DTYPE",
                      help="measure the tolerances on the base: honest DTYPE submissions (decode batch 1, 8, 64) checked by the "
                           "validators' pipeline; writes replay rule logit-bound-v3 with δ, log-prob bounds, near-tie share and TOPLOC "
                           "thresholds at stated margins over the worst honest values, and prints them (docs/operators.md)")
    init.add_argument("--measure-submissions", type=int, default=20, metavar="N",
                      help="with --measure-precision: honest submissions per batch size (default 20)")
    init.add_argument("--measure-device", default="cpu", metavar="DEVICE",
                      help="with --measure-precision: the torch device the honest submissions are generated on (default cpu; "
                           "'cuda' on a GPU of the kind the run's workers use: their kernels are what the tolerances must cover)")
    init.add_argument("--audit", action="store_true",
                      help="run the per-worker audit (workers whose replay statistics exceed honest compute's, or whose diverged "
                           "rollouts beat their float32 twins more often than honest compute's, are banned; the coordinator calibrates "
                           "the honest baseline itself; docs/toploc.md §11)")
    init.add_argument("--audit-rule", choices=("eprocess-v2", "eprocess-v1"), default=None,
                      help="with --audit: eprocess-v2 (default: the rate test and the twin test, §11.2) or eprocess-v1 (the rate test only)")
    init.add_argument("--min-calibration-decisive", type=int, default=None,
                      help="with --audit (eprocess-v2): the first calibrated step makes reference work until the baseline holds this "
                           "many decisive twins (default 64; more tightens the honest up-share bound)")
    init.add_argument("--twin-share", type=float, default=None,
                      help="with --audit (eprocess-v2): the share of full checks that decode twins (default 1; less saves "
                           "validators' decode time and lets a steerer run proportionally longer before its flag)")
    init.add_argument("--calibration-batches", default=None, metavar="B,B,...",
                      help="with --audit: the decode batch sizes the coordinator's reference submissions round-robin over; each event's "
                           "honest bound is the largest of theirs (default 1,8,64: honest statistics depend on the batch size, "
                           "docs/toploc.md §11.1)")
    init.add_argument("--audit-false-alarm", type=float, default=None, help="with --audit: an honest worker's chance of a flag (default 1e-6)")
    init.add_argument("--calibration-submissions", type=int, default=None,
                      help="with --audit: honest reference submissions the coordinator checks per published step (default 2)")
    init.add_argument("--min-calibration-tokens", type=int, default=None,
                      help="with --audit: no flag before the baseline holds this many replayed tokens (default 2000)")
    init.add_argument("--eos-prob-slack", type=float, default=None,
                      help="eps-v1: P(EOS) of worker and validator may differ by this much at the EOS floor (default 0.01)")
    init.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    init.set_defaults(handler=_run_spec_init)
    show = ssub.add_parser("show", help="print a run spec, whether its signature holds, and its address")
    show.add_argument("path")
    show.set_defaults(handler=_run_spec_show)
    addr = ssub.add_parser("address", help="print the run's address (intellect1:…): the one string contributors join with")
    addr.add_argument("path", help="the signed run spec")
    addr.add_argument("--url", action="append", default=[], metavar="URL",
                      help="HTTP location serving the spec (the coordinator's public URL or a relay's; default: the spec's origin "
                           "and ingest URLs)")
    addr.add_argument("--full-run-id", action="store_true", help="put the whole run ID in the address, not its first 16 hex digits")
    addr.set_defaults(handler=_run_spec_address)


def _run_spec_init(args: argparse.Namespace) -> int:
    import secrets

    from pydantic import ValidationError

    from protocol import runspec as rs
    from protocol.durable import atomic_write

    key = load_key(args.coordinator_key)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise CliError(f"{out} exists; pass --force to overwrite it")
    def given(**kw: Any) -> dict[str, Any]:  # flag values (argparse: Any); the spec's pydantic models check them
        return {k: v for k, v in kw.items() if v is not None}

    rl = given(async_level=args.async_level, group_size=args.group_size, learning_rate=args.learning_rate,
               batch_groups=args.batch_groups, old_logprobs=args.old_logprobs)
    data = given(tasks=args.tasks, tasks_per_submission=args.tasks_per_submission)
    env: dict[str, Any] = {}
    if args.env is not None:
        if args.tasks is not None:
            raise CliError("--env brings its own tasks: leave out --tasks")
        env = _pin_environment(args)
        data["tasks"], data["tasks_hash"] = rs.ENV_TASKS, env.pop("tasks_hash")
    elif args.env_arg or args.env_seed is not None or args.env_train_size is not None or args.env_heldout_size is not None:
        raise CliError("--env-arg, --env-seed, --env-train-size and --env-heldout-size need --env")
    artifacts: dict[str, str] = {}  # an environment's tasks come from the environment every scoring node holds: no tasks artifact
    if args.tasks is not None and args.tasks != "embedded" and (args.data_root is not None or Path(args.tasks).exists()):
        from protocol.artifacts import TASKS_ARTIFACT
        from protocol.dataset import resolve_tasks, tasks_artifact_id

        run_tasks = resolve_tasks(args.tasks, Path(args.data_root) if args.data_root else None)
        data["tasks_hash"] = run_tasks.hash
        artifacts[TASKS_ARTIFACT] = tasks_artifact_id(run_tasks.train).hex()  # workers and validators fetch it: no task files to copy
    model = given(base=args.model_base, hidden_size=args.hidden_size)
    if args.model_base is not None and args.model_base != "embedded":
        model.update(_describe_base(Path(args.model_base), args.hidden_size))
    sampling = given(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, length_penalty=args.length_penalty,
                     target_lengths=args.target_length or None, rule=args.sampling_rule)
    toploc = given(logprob_max_abs=args.logprob_max_abs, logprob_mean_abs=args.logprob_mean_abs, replay_eps=args.replay_eps,
                   max_near_tie_fraction=args.max_near_tie_fraction, replay_rule=args.replay_rule,
                   replay_logit_bound=args.replay_logit_bound, eos_prob_slack=args.eos_prob_slack, worker_dtype=args.worker_dtype,
                   hard_factor=args.hard_factor, fp32_logits=args.fp32_logits or None)
    if args.sampling_rule == "gumbel-v2" and args.measure_precision is None and args.replay_rule not in rs.LOGIT_BOUND_RULES:
        raise CliError("--sampling-rule gumbel-v2 is replayed under a logit bound (toploc.replay_rule): add --measure-precision "
                       "bfloat16 (measures it on the base) or --replay-rule logit-bound-v3 --replay-logit-bound NATS (docs/toploc.md §5.3)")
    if args.measure_precision is not None and args.sampling_rule == "gumbel-v2" and args.replay_rule is None:
        # the measurement writes logit-bound-v3 with its δ; the spec it measures must already be one gumbel-v2 can run under
        toploc |= {"replay_rule": "logit-bound-v3", "replay_logit_bound": toploc.get("replay_logit_bound") or 1.0}
    if not args.audit and any(v is not None for v in (args.audit_false_alarm, args.calibration_submissions, args.min_calibration_tokens,
                                                      args.audit_rule, args.min_calibration_decisive, args.twin_share,
                                                      args.calibration_batches)):
        raise CliError("--audit-rule, --audit-false-alarm, --calibration-submissions, --min-calibration-tokens, "
                       "--min-calibration-decisive, --twin-share and --calibration-batches need --audit")
    if (args.min_calibration_decisive is not None or args.twin_share is not None) and args.audit_rule == "eprocess-v1":
        raise CliError("--min-calibration-decisive and --twin-share are for --audit-rule eprocess-v2 (eprocess-v1 decodes no twins)")
    audit = given(false_alarm=args.audit_false_alarm, calibration_submissions=args.calibration_submissions,
                  min_calibration_tokens=args.min_calibration_tokens, min_calibration_decisive=args.min_calibration_decisive,
                  twin_share=args.twin_share) | (
        {"rule": args.audit_rule or "eprocess-v2", "calibration_batches": _calibration_batches(args.calibration_batches)} if args.audit else {})
    shard = given(keep_steps=args.keep_steps)  # not given: the spec keeps rl.async_level + 1 (protocol.window.fresh_steps)
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
            model=rs.ModelSpec(**model),
            data=rs.DataSpec(**data),
            sampling=rs.SamplingSpec(**sampling),
            toploc=rs.ToplocSpec(**toploc),
            rl=rs.RLSpec(**rl),
            shardcast=rs.ShardcastSpec(**shard),
            network=rs.NetworkSpec(bootstrap=args.bootstrap, ingest_urls=args.ingest_url, origin_urls=args.origin_url),
            env=rs.EnvSpec(**env),
            audit=rs.AuditSpec(**audit),
            artifacts=artifacts,
        )
        if args.measure_precision is not None:
            spec = spec.model_copy(update={"toploc": _measured_toploc(spec, args)})
            spec = rs.RunSpec.model_validate(spec.model_dump())  # the whole spec checked again with the measured section
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError says nothing to a user
        raise CliError(f"invalid option{' for ' + where if where else ''}: {msg}") from None
    from protocol.tasks import training_split_warning

    if (warning := training_split_warning(spec.data.tasks)) is not None:
        print(f"warning: {warning}")
    signed = rs.sign_run_spec(spec, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, rs.dump_run_spec(signed).encode())
    print(f"run spec written to {out}; run ID {signed.run_id.hex()}")
    if (address := spec_address(signed, [])) is not None:
        print(f"run address: {address}")
    return 0


def _calibration_batches(text: str | None) -> list[int]:
    """``--calibration-batches`` (comma-separated decode batch sizes) as ``audit.calibration_batches``; not given: the
    sizes new runs calibrate (:data:`protocol.runspec.CALIBRATION_BATCHES_NEW_RUNS`). The spec checks the range and order.

    Raises:
        CliError: an entry is not an integer.
    """
    from protocol.runspec import CALIBRATION_BATCHES_NEW_RUNS

    if text is None:
        return list(CALIBRATION_BATCHES_NEW_RUNS)
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise CliError(f"--calibration-batches wants comma-separated decode batch sizes (e.g. 1,8,64), got {text!r}") from None


def _pin_environment(args: argparse.Namespace) -> dict[str, Any]:
    """Open ``--env`` here (its sandbox), print what it is, and return the ``[env]`` fields plus ``tasks_hash``."""
    from node.cli import env_arg_values
    from protocol.envs import open_environment
    from protocol.runspec import EnvSpec
    from protocol.tasks import dataset_hash

    fields: dict[str, Any] = {"name": args.env, "args": env_arg_values(args.env_arg)}
    fields.update({k: v for k, v in (("seed", args.env_seed), ("train_size", args.env_train_size),
                                     ("heldout_size", args.env_heldout_size)) if v is not None})
    defaults = EnvSpec.model_fields
    env = open_environment(args.env, args=fields["args"], seed=fields.get("seed", defaults["seed"].default),
                           train_size=fields.get("train_size", defaults["train_size"].default),
                           heldout_size=fields.get("heldout_size", defaults["heldout_size"].default))
    try:
        tasks = env.tasks
        fields["hash"] = env.hash
        fields["tasks_hash"] = dataset_hash(tasks.train)
        print(f"environment {args.env}: {len(env.source.files)} files, packages {env.source.packages or 'none pinned'}; env.hash {env.hash}; "
              f"{len(tasks.train)} training tasks (tasks_hash {fields['tasks_hash']}), {len(tasks.heldout)} held out"
              f"{f' ({tasks.dropped} more dropped: a training task has the same prompt)' if tasks.dropped else ''}")
    finally:
        env.close()
    return fields


def _measured_toploc(spec: Any, args: argparse.Namespace) -> Any:
    """``[toploc]`` from :func:`node.precision.measure_precision` on the run's base (prints the table)."""
    import tempfile

    import torch

    from node.coordinator.base import prepare_base
    from node.precision import measure_precision
    from protocol.dataset import resolve_run_tasks
    from protocol.models import load_tokenizer

    if args.measure_submissions < 1:
        raise CliError("--measure-submissions must be ≥ 1")
    if args.fp32_logits and args.measure_precision != "bfloat16":
        raise CliError("--fp32-logits is for --measure-precision bfloat16")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tasks = resolve_run_tasks(spec, Path(args.data_root) if args.data_root else None)  # the run's own environment too (--env)
    with tempfile.TemporaryDirectory() as tmp:
        base = prepare_base(spec, tasks, Path(tmp) / "base")
        print(f"measuring honest {args.measure_precision} workers on {base} ({args.measure_submissions} submissions per batch size) …")
        m = measure_precision(spec, base, tasks.train, load_tokenizer(base), args.measure_precision, submissions=args.measure_submissions,
                              fp32_head=args.fp32_logits, device=args.measure_device)
    toploc = m.toploc(spec.toploc, spec.sampling.temperature)
    print("\n".join(m.lines(toploc)))
    return toploc


def _describe_base(path: Path, hidden_size: int | None) -> dict[str, object]:
    """The ``[model]`` values a local base directory dictates: dtype, hidden size and ``base_hash``."""
    from protocol.models import ModelLoadError, base_hash, inspect_model_dir

    if not (path / "config.json").is_file():
        raise CliError(f"--model-base {path} has no config.json (a local Qwen2 directory: config.json, *.safetensors, tokenizer)")
    try:
        info = inspect_model_dir(path)
        digest = base_hash(path)
    except ModelLoadError as e:
        raise CliError(str(e)) from None
    if hidden_size is not None and hidden_size != info.hidden_size:
        raise CliError(f"--hidden-size {hidden_size} contradicts {path}/config.json (hidden_size {info.hidden_size}); omit it")
    if info.config_dtype not in (None, info.dtype):
        print(f"warning: {path}/config.json says dtype {info.config_dtype}, the safetensors hold {info.dtype}; the spec uses {info.dtype}")
    print(
        f"base model {path}: {info.parameters:,} parameters, {info.dtype}, hidden {info.hidden_size}, {info.layers} layers, "
        f"vocabulary {info.vocab_size} (tokenizer {info.tokenizer_size}), EOS {list(info.eos_token_ids)}, "
        f"chat template {'yes' if info.chat_template else 'no'}; base_hash {digest}"
    )
    return {"hidden_size": info.hidden_size, "dtype": info.dtype, "base_hash": digest}


def _run_spec_show(args: argparse.Namespace) -> int:
    from protocol.runspec import dump_run_spec

    signed = load_spec(args.path)
    print(dump_run_spec(signed), end="")
    print(f"# signature: valid (coordinator {signed.spec.run.coordinator}); run ID {signed.run_id.hex()}")
    if (address := spec_address(signed, [])) is not None:
        print(f"# run address: {address}")
    return 0


def spec_address(signed: Any, urls: list[str], *, full_run_id: bool = False) -> str | None:
    """The run's address from its spec: ``urls`` (else the spec's origin and ingest URLs) and its
    bootstrap multiaddrs; ``None`` when the spec names no location at all."""
    from protocol.address import format_run_address

    net = signed.spec.network
    http = urls or list(dict.fromkeys([*net.origin_urls, *net.ingest_urls]))
    if not http and not net.bootstrap:
        return None
    return format_run_address(signed.spec.run.coordinator, signed.run_id, http, net.bootstrap[:8],
                              run_id_hex=signed.run_id.hex() if full_run_id else None)


def _run_spec_address(args: argparse.Namespace) -> int:
    from protocol.errors import AddressError

    signed = load_spec(args.path)
    try:
        address = spec_address(signed, args.url, full_run_id=args.full_run_id)
    except AddressError as e:
        raise CliError(str(e)) from None
    if address is None:
        raise CliError("the spec names no origin, ingest or bootstrap location: pass --url http://COORDINATOR:PORT")
    print(address)
    return 0
