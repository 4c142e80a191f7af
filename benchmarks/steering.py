"""Steering workers against the per-worker audit, and honest bf16 workers' false alarms.

A steering worker decodes honestly in bf16 but, wherever the right answer's next token passes the
validator's replay of the run's rule, emits that token (``node/worker/steering.py``) at a rate R
of its chances; its proofs and log-probs are honest ones of what it emitted. This script measures,
with the real worker, pipeline and audit code, per replay bound δ and steering rate R:

* the tokens it emits before the coordinator's audit flags it (``protocol/audit.py``; baseline
  calibrated the coordinator's way: honest reference submissions in bf16, ``node/coordinator/
  calibrate.py``, round-robin over ``--calibration-batches``), its submissions accepted and rejected (``precision``) meanwhile, and the pass
  rate of its rollouts before the flag against honest workers' on the same policy (its *gain*);
* the false alarms among honest bf16 workers (decode batch 1, 8 or 64: another padding and
  reduction order than the calibration's), over ≥ 10⁴ rollouts, and how close the nearest came;
  under ``--audit-rule eprocess-v2`` (the default) with the twin test (``docs/toploc.md`` §11.2): the
  validators' float32 twins of diverged rollouts, the honest up-share against its calibrated bound,
  and what the twins cost the validator per honest submission (seconds and share of the full check);
* what one token can do: per answer position, how many tokens the replay admits within δ and
  how often the right answer's token is among them, under ``icdf-v1`` and under Gumbel-max with the
  same δ (on the same validator logits: ``gumbel-v2``'s own replay when ``--sampling-rule gumbel-v2``
  names it, else scores within 2δ/T with noise of no rule);
  and the honest bf16 tolerances with a bf16 LM head against an fp32 one ("fp32 logits").

It ends with one line: ``steering: flagged after N tokens at rate R; honest false alarms K / M``
(R = 1.0 at the first δ; the table has the rest).

Example::

    python benchmarks/steering.py                                  # embedded base, measured δ, 0.5 and 1.0
    python benchmarks/steering.py --policy devnet-out/latest/coordinator/policies/step-40 --deltas measured
    python benchmarks/steering.py --quick                          # a smaller run (fewer honest rollouts)
    python benchmarks/steering.py --quick --sampling-rule gumbel-v2  # the spec's sampling.rule (default icdf-v1)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.coordinator.base import EMBEDDED_BASE_DIR
from node.coordinator.calibrate import worker_engine
from node.devnet.config import EMBEDDED_RL, EMBEDDED_SAMPLING
from node.engine.hf import TransformersEngine
from node.precision import measure_precision
from node.worker.rollouts import build_submission, seal_submission
from node.worker.steering import answer_tokens, steer_generate
from protocol import sampling
from protocol.audit import AuditState, Baseline
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.inference import prefill_completions
from protocol.messages import Submission
from protocol.models import head_weight, load_model, load_tokenizer
from protocol.rollout import plan_submission
from protocol.runspec import AUDIT_RULE_EPROCESS_V2, AuditSpec, DataSpec, ModelSpec, RunInfo, RunSpec, ToplocSpec
from validator.pipeline import SubmissionChecker

EOS = 1


@dataclass
class Outcome:
    """One steering worker's run against the audit."""

    rate: float
    tokens: int = 0
    up: int = 0
    down: int = 0
    flagged_after: int | None = None
    submissions: int = 0
    accepted: int = 0
    precision: int = 0
    passes: int = 0
    rollouts: int = 0
    taken: int = 0
    chances: int = 0
    log10_e: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)


def make_spec(delta: float | None, measured_toploc: Any, audit: AuditSpec, tasks_per_submission: int,
              rule: str = sampling.RULE_ICDF) -> RunSpec:
    key = NodeKey.from_seed(b"s" * 32)
    toploc = measured_toploc if delta is None else measured_toploc.model_copy(update={"replay_logit_bound": delta})
    return RunSpec(run=RunInfo(coordinator=key.peer_id, seed=5), model=ModelSpec(hidden_size=128, dtype="bfloat16"),
                   data=DataSpec(tasks_per_submission=tasks_per_submission), sampling=EMBEDDED_SAMPLING.model_copy(update={"rule": rule}),
                   rl=EMBEDDED_RL, toploc=toploc, audit=audit)


def checked(checker: SubmissionChecker, spec: RunSpec, raw: bytes) -> Any:
    return checker.check(open_envelope(raw, run_id=spec.run_id, expect=Submission))


def calibrate(spec: RunSpec, policy_dir: Path, tasks: list, tok: Any, checker: SubmissionChecker, tokens: int) -> tuple[Baseline, int]:
    """The coordinator's calibration (``node/coordinator/calibrate.py``'s engines): honest bf16 reference
    submissions round-robin over the decode batch sizes of ``audit.calibration_batches`` until *each* holds
    ``tokens`` replayed tokens and, under ``eprocess-v2``, ``audit.min_calibration_decisive`` decisive twins
    (at most 2,048 submissions per batch size); the bounds are the largest over the batch sizes."""
    batches = spec.audit.calibration_batches
    base = Baseline(spec.audit.baseline_confidence, 1 << 20, batches)
    engines = {b: worker_engine(spec, policy_dir, max_batch=b) for b in batches}
    key, counter, rejected = NodeKey.generate(), 0, 0
    twins = spec.audit.rule == AUDIT_RULE_EPROCESS_V2
    while (base.tokens() < tokens or (twins and base.decisive() < spec.audit.min_calibration_decisive)) and counter < 2048 * len(batches):
        batch = batches[counter % len(batches)]
        if base.per_config[batch].tokens() >= tokens and (not twins or base.per_config[batch].twins[1] >= spec.audit.min_calibration_decisive):
            counter += 1  # this batch size holds enough: the others catch up
            continue
        result = checked(checker, spec, build_submission(spec, spec.run_id, key, engines[batch], tok, tasks, 0, counter))
        counter += 1
        rejected += not result.accepted
        if result.stats is not None and result.accepted:  # the coordinator calibrates on accepted reference work only
            base.add(0, result.stats, config=batch)
    return base, rejected


def honest_workers(spec: RunSpec, policy_dir: Path, tasks: list, tok: Any, checker: SubmissionChecker, bounds: dict[str, float],
                   rollouts: int, per_worker: int) -> dict[str, Any]:
    """Honest bf16 workers (batch 1 / 8 / 64 in turn), ``per_worker`` submissions each, until ``rollouts``: their audit."""
    engines = {b: worker_engine(spec, policy_dir, max_batch=b) for b in (1, 8, 64)}
    flagged, n_rollouts, workers, passes, tokens, worst = 0, 0, 0, 0, 0, -math.inf
    reasons: dict[str, int] = {}
    twin_s = check_s = 0.0
    subs = diverged = decided = up = down = 0
    while n_rollouts < rollouts:
        key, state = NodeKey.generate(), AuditState(rule=spec.audit.rule)
        engine = engines[(1, 8, 64)[workers % 3]]
        workers += 1
        for counter in range(per_worker):
            raw = build_submission(spec, spec.run_id, key, engine, tok, tasks, 0, counter)
            env = open_envelope(raw, run_id=spec.run_id, expect=Submission)
            result = checker.check(env)
            reasons[result.reason] = reasons.get(result.reason, 0) + 1
            n_rollouts += len(env.body.rollouts)
            passes += sum(r.task_reward >= 1.0 for r in env.body.rollouts)
            subs += 1
            check_s += result.seconds
            twin_s += result.timings.get("twins", 0.0)
            if result.stats is not None and result.accepted:  # the audit counts accepted verdicts only
                tokens += result.stats.tokens
                state.observe(result.stats, bounds)
                diverged, decided = diverged + result.stats.diverged, decided + result.stats.decided
                up, down = up + result.stats.up, down + result.stats.down
                worst = max(worst, state.log_e_value() / math.log(10))
        flagged += state.flag(spec.audit.false_alarm, bounds) is not None
    return {"flagged": flagged, "workers": workers, "rollouts": n_rollouts, "tokens": tokens, "pass_rate": passes / max(1, n_rollouts),
            "max_log10_e": worst, "reasons": reasons, "submissions": subs, "check_s": check_s, "twin_s": twin_s, "diverged": diverged,
            "decided": decided, "up": up, "down": down}


def steer(spec: RunSpec, policy: torch.nn.Module, policy_dir: Path, tasks: list, tok: Any, checker: SubmissionChecker,
          bounds: dict[str, float], rate: float, max_tokens: int, seed: int) -> Outcome:
    """A steering worker at ``rate`` until the audit flags it or it emitted ``max_tokens``."""
    worker = load_model(policy_dir).to(torch.bfloat16).eval()
    head = head_weight(policy_dir) if spec.toploc.fp32_logits else None  # the worker's logits as the spec says honest ones are made
    key, state, out = NodeKey.generate(), AuditState(rule=spec.audit.rule), Outcome(rate)
    rng = random.Random(seed)
    counter = 0
    while out.flagged_after is None and out.tokens < max_tokens:
        plan = plan_submission(spec, tasks, tok, key.peer_id, 0, counter)
        steered = steer_generate(spec, policy, worker, tok, plan, rate, rng, head_fp32=head)
        raw = seal_submission(spec.run_id, key, 0, counter, plan, steered.rollouts)
        counter += 1
        result = checked(checker, spec, raw)
        out.submissions += 1
        out.reasons[result.reason] = out.reasons.get(result.reason, 0) + 1
        out.accepted += result.accepted
        out.precision += result.reason == "precision"
        out.taken += sum(steered.taken)
        out.chances += sum(steered.chances)
        out.tokens += sum(steered.tokens)
        if result.accepted:  # what training would see from it
            out.rollouts += len(steered.rollouts)
            out.passes += sum(r.task_reward >= 1.0 for r in steered.rollouts)
        if result.stats is not None and result.accepted:  # the audit counts accepted verdicts only
            out.up, out.down = out.up + result.stats.up, out.down + result.stats.down
            state.observe(result.stats, bounds)
            if state.flag(spec.audit.false_alarm, bounds) is not None:
                out.flagged_after = out.tokens
    out.log10_e = state.log_e_value() / math.log(10)
    return out


def admissible(spec: RunSpec, policy: torch.nn.Module, tasks: list, tok: Any, positions: int, seed: int) -> dict[str, float]:
    """Per answer position of honest fp32 completions: tokens the replay admits within δ under
    ``icdf-v1`` and under Gumbel-max (same δ: under a ``gumbel-v2`` spec the rule's own replay, else
    scores within 2δ/T of the best with noise not of the rule), and how often the right answer's token
    is among them. The completions are the spec's rule's."""
    params = sampling.ReplayParams.from_spec(spec, (EOS,))
    gumbel_rule = params.rule == sampling.RULE_GUMBEL
    icdf_params = dataclasses.replace(params, rule=sampling.RULE_ICDF)
    engine = TransformersEngine(policy, tok)
    key = NodeKey.generate()
    g = torch.Generator().manual_seed(seed)
    icdf_n, gum_n, icdf_hit, gum_hit, n = [], [], 0, 0, 0
    counter = 0
    while n < positions:
        plan = plan_submission(spec, tasks, tok, key.peer_id, 0, counter)
        counter += 1
        prompts = [list(p.prompt_ids) for p in plan for _ in p.seeds]
        seeds = [int(s) for p in plan for s in p.seeds]
        answers = [answer_tokens(p, tok) for p in plan for _ in p.seeds]
        gens = engine.generate(prompts, seeds, _params(spec))
        pre = prefill_completions(policy, prompts, [x.completion_ids.tolist() for x in gens], tok.pad_token_id or 0)
        for p, gen, seed_, ans in zip(pre, gens, seeds, answers, strict=True):
            comp = gen.completion_ids.tolist()
            for i in range(len(comp)):
                if ans is None or i >= len(ans) or comp[:i] != ans[:i]:
                    break  # answer positions only: the prefix so far is the answer's
                vocab = p.logits.shape[1]
                rows = p.logits[i : i + 1].repeat(vocab, 1)
                reps = sampling.replay_checks(rows.clone(), [[v] for v in range(vocab)], [seed_] * vocab, icdf_params, [i] * vocab)
                ok = torch.tensor([r.hard_mismatches == 0 for r in reps])
                icdf_n.append(int(ok.sum()))
                icdf_hit += bool(ok[ans[i]])
                if gumbel_rule:  # the rule's replay (its seeded noise, candidate set and kept sets)
                    reps = sampling.replay_checks(rows, [[v] for v in range(vocab)], [seed_] * vocab, params, [i] * vocab)
                    adm = torch.tensor([r.hard_mismatches == 0 for r in reps])
                else:
                    z = p.logits[i].double() / spec.sampling.temperature
                    gumbel = -torch.log(-torch.log(torch.rand(vocab, generator=g, dtype=torch.float64).clamp_min(1e-300)))
                    score = z + gumbel
                    adm = score >= score.max() - 2 * params.logit_bound / spec.sampling.temperature
                gum_n.append(int(adm.sum()))
                gum_hit += bool(adm[ans[i]])
                n += 1
    return {"positions": n, "icdf_mean": statistics.mean(icdf_n), "icdf_right": icdf_hit / n, "gumbel_mean": statistics.mean(gum_n),
            "gumbel_right": gum_hit / n}


def _params(spec: RunSpec) -> Any:
    from node.worker.rollouts import sampling_params

    return sampling_params(spec, EOS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=str(EMBEDDED_BASE_DIR), help="policy directory (default: the embedded devnet base)")
    ap.add_argument("--deltas", default="measured,0.5,1.0", help="replay bounds δ, nats; 'measured': from the honest measurement")
    ap.add_argument("--rates", default="1.0,0.1,0.01", help="steering rates (share of chances taken)")
    ap.add_argument("--honest-rollouts", type=int, default=10_240, help="honest bf16 rollouts for false alarms (≥ 10⁴)")
    ap.add_argument("--calibration-tokens", type=int, default=20_000, help="tokens of honest reference submissions in the baseline")
    ap.add_argument("--measure-submissions", type=int, default=20, help="honest submissions per batch size to measure the tolerances")
    ap.add_argument("--max-steer-tokens", type=int, default=30_000, help="give up on a steerer after this many of its tokens")
    ap.add_argument("--positions", type=int, default=400, help="answer positions for the admissible-set counts")
    ap.add_argument("--quick", action="store_true", help="2,048 honest rollouts, 8 measured submissions per batch, 10,000 calibration tokens")
    ap.add_argument("--logits", choices=["fp32", "bf16"], default="fp32",
                    help="the bf16 workers' LM head the run's spec assumes (toploc.fp32_logits; default fp32, as the devnet's)")
    ap.add_argument("--audit-rule", choices=["eprocess-v2", "eprocess-v1"], default="eprocess-v2",
                    help="the audit: eprocess-v2 (rate and twin tests, default) or eprocess-v1 (rate test only)")
    ap.add_argument("--calibration-batches", default="1,8,64",
                    help="decode batch sizes the calibration covers, --calibration-tokens each (audit.calibration_batches; "
                         "default 1,8,64 as new runs; 64: the calibration before issue #33)")
    ap.add_argument("--sampling-rule", choices=list(sampling.RULES), default=sampling.RULE_ICDF,
                    help="the spec's sampling.rule (gumbel-v2 is replayed under the logit bound; its admissible counts use its replay)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.honest_rollouts, args.measure_submissions, args.calibration_tokens = 2048, 8, 10_000
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    policy_dir = Path(args.policy)
    tok = load_tokenizer(policy_dir)
    tasks = resolve_tasks("embedded").train
    policy = load_model(policy_dir).eval()
    audit = AuditSpec(rule=args.audit_rule, min_calibration_tokens=0, calibration_batches=[int(b) for b in args.calibration_batches.split(",")])
    base_spec = make_spec(None, ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=1.0), audit, 4, args.sampling_rule)
    t0 = time.time()
    print(f"policy {policy_dir}; sampling rule {args.sampling_rule}, T={EMBEDDED_SAMPLING.temperature}, {EMBEDDED_SAMPLING.max_tokens} tokens; "
          f"{base_spec.data.tasks_per_submission} tasks x {base_spec.rl.group_size} rollouts per submission")
    # 1. the honest tolerances, bf16 head and fp32 head
    meas = {}
    for head in ("bf16", "fp32"):
        m = measure_precision(base_spec, policy_dir, tasks, tok, "bfloat16", submissions=args.measure_submissions,
                              **({"fp32_head": True} if head == "fp32" else {}))
        meas[head] = m
        chosen = m.toploc(base_spec.toploc, base_spec.sampling.temperature)
        print(f"\n[honest bf16 workers, {head} LM head] " + "\n".join(m.lines(chosen)))
    measured = meas[args.logits].toploc(base_spec.toploc, base_spec.sampling.temperature)
    deltas = [None if d == "measured" else float(d) for d in args.deltas.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    rows, first_line = [], None
    for delta in deltas:
        spec = make_spec(delta, measured, audit, 4, args.sampling_rule)
        d = spec.toploc.replay_logit_bound
        checker = SubmissionChecker(spec, tasks, tok, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda *_: False)
        baseline, cal_rejected = calibrate(spec, policy_dir, tasks, tok, checker, args.calibration_tokens)
        bounds = baseline.bounds()
        honest = honest_workers(spec, policy_dir, tasks, tok, checker, bounds, args.honest_rollouts, 4)
        adm = admissible(spec, policy, tasks, tok, args.positions, args.seed)
        print(f"\n[δ = {d:.3g} nats{' (measured)' if delta is None else ''}] calibration {baseline.tokens_by_config()} tokens by decode batch "
              f"({cal_rejected} reference submissions rejected); honest bounds: "
              + ", ".join(f"{k} {v:.2g}" for k, v in bounds.items()))
        print(f"  honest: {honest['flagged']} of {honest['workers']} workers flagged over {honest['rollouts']} rollouts "
              f"({honest['tokens']} tokens; nearest log10 E {honest['max_log10_e']:.2f} of {math.log10(1 / spec.audit.false_alarm):.0f}); "
              f"verdicts {honest['reasons']}; pass rate {honest['pass_rate']:.3f}")
        if spec.audit.rule == AUDIT_RULE_EPROCESS_V2:
            print(f"  twins: calibration up {baseline.twins[0]} of {baseline.twins[1]} decisive (by batch {baseline.decisive_by_config()}; "
                  f"bound {bounds['up']:.3f}); honest workers "
                  f"{honest['diverged']} diverged rollouts, {honest['decided']} decided, up {honest['up']} / down {honest['down']}; "
                  f"validator time on twins {1e3 * honest['twin_s'] / max(1, honest['submissions']):.1f} ms per submission = "
                  f"{honest['twin_s'] / max(1e-9, honest['check_s']):.1%} of the full check "
                  f"({1e3 * honest['check_s'] / max(1, honest['submissions']):.1f} ms)")
        print(f"  one token: icdf-v1 admits {adm['icdf_mean']:.2f} tokens per answer position, the right one at {adm['icdf_right']:.1%}; "
              f"Gumbel-max at the same δ {adm['gumbel_mean']:.2f}, the right one at {adm['gumbel_right']:.1%} ({adm['positions']} positions"
              + ("; gumbel-v2's replay" if spec.sampling.rule == sampling.RULE_GUMBEL else "; not the rule's noise") + ")")
        for rate in rates:
            o = steer(spec, policy, policy_dir, tasks, tok, checker, bounds, rate, args.max_steer_tokens, args.seed + int(rate * 1000))
            gain = (o.passes / o.rollouts if o.rollouts else math.nan) - honest["pass_rate"]
            flag = f"flagged after {o.flagged_after} tokens" if o.flagged_after is not None else f"NOT flagged in {o.tokens} tokens"
            print(f"  steer rate {rate:g}: {flag} ({o.submissions} submissions: {o.accepted} accepted, {o.precision} precision, "
                  f"{o.reasons}); took {o.taken} of {o.chances} chances; accepted rollouts' pass rate "
                  f"{o.passes}/{o.rollouts} = {o.passes / max(1, o.rollouts):.3f} (gain {gain:+.3f} over honest); log10 E {o.log10_e:.1f}"
                  + (f"; twins up {o.up} / down {o.down}" if spec.audit.rule == AUDIT_RULE_EPROCESS_V2 else ""))
            rows.append((d, rate, o, gain, honest))
            if first_line is None and rate == 1.0:
                first_line = (o, honest)
    print(f"\n{time.time() - t0:.0f} s in all")
    if first_line is not None:
        o, h = first_line
        n = o.flagged_after if o.flagged_after is not None else f">{o.tokens}"
        print(f"steering: flagged after {n} tokens at rate 1.0; honest false alarms {h['flagged']} / {h['rollouts']} "
              f"(rollouts of {h['workers']} workers)")


if __name__ == "__main__":
    main()
