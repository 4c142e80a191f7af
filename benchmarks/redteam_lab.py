"""Red-team lab for issue #33's verification: the coordinator's calibration, honest bf16 workers of other decode
configurations, and audit-aware adversaries (answer steerer, trigger injector, twin-aware controller, down farming,
log-prob shift), all with the real worker, pipeline and audit code. Kept from the red-team rounds (a33, i33b, a33b,
s39, h41b; their notes and raw outputs are outside the repository); h41b added the per-token replay log and
the ``LAB_BOUNDS_CONFIG`` switch.

Run from the repository root with its venv (``OMP_NUM_THREADS=1``; everything is cached under ``$LAB_WORK``,
default ``./redteam-work``: the spec's tolerances ``toploc.json`` -- measured on first use the devnet's way, or copy
one in to pin δ -- and the calibration ``audit.sqlite``)::

    python benchmarks/redteam_lab.py setup                                   # tolerances, calibration; prints per-config bounds
    python benchmarks/redteam_lab.py honest --config b64|b8|b1|nocache|bf16head --seed S --submissions N
    python benchmarks/redteam_lab.py aware --budget 1.43 --max-gap 1.0 --submissions 100           # rationed answer steerer
    python benchmarks/redteam_lab.py aware --mode trigger --trigger x --budget 1.43 --max-gap 1.0 --submissions 400
    python benchmarks/redteam_lab.py aware --ceiling 5 ... ; farm ... ; lpshift ...
    python benchmarks/redteam_lab.py aware --sampling-rule gumbel-v2 ...   # any command: the spec's sampling.rule (default icdf-v1)

The calibration depends on the sampling rule: give each rule its own ``LAB_WORK`` (copy one ``toploc.json`` into each to
compare the rules at the same δ).

Environment: ``LAB_LOG_TOKENS=file`` appends one JSON line per ``protocol.sampling.replay_checks`` call (the
validator's differing tokens with gap, ids and float32 probabilities; ``benchmarks/trigger_signal.py`` reads
it); ``LAB_BOUNDS_CONFIG=64`` tests workers against one decode configuration's bounds instead of the max over
configurations; ``LAB_DILUTE=K``: the answer steerer adds up to K neutral divergences per submission (rows already off the
answer, one admissible cheapest-gap token each: decided twins that are neither up nor down, against ``up_rate``);
``LAB_STEER_EVERY=n``: rows are steered up only in every n-th submission;
``LAB_GRIND=G`` (h42b): the aware steerer decodes G unused counters per submission (each with a copy of its ration) and
submits the one with the most steered tokens (trigger mode) or passes (answer mode): counters are the worker's to choose;
``LAB_MIN_DECISIVE``, ``LAB_SABOTAGE_MAX_GAP`` as in the earlier rounds.

The spec is the devnet's bf16 spec (``node.devnet.config.devnet_spec(worker_dtype="bf16", sampling_rule=...)``: embedded tasks,
4 tasks x 16 rollouts, ≤ 4 tokens, T = 1.5, DEVNET_AUDIT) with the tolerances measured the devnet's way (12
submissions at batch 8 and 64, bf16 with float32 logits); the baseline is the coordinator's calibration
(``AuditCalibration.calibrate``: its burst at step 0 over ``audit.calibration_batches``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORK = Path(os.environ.get("LAB_WORK", "redteam-work"))  # the spec, tolerances and calibration are cached here
SABOTAGE_MAX_GAP = float(os.environ.get("LAB_SABOTAGE_MAX_GAP", "1.0"))  # i33b: a fraction of delta
DILUTE = int(os.environ.get("LAB_DILUTE", "0"))  # h41b: neutral divergences per submission (answer mode), against up_rate
STEER_EVERY = int(os.environ.get("LAB_STEER_EVERY", "1"))  # h41b: rows are steered up only in every n-th submission
GRIND = int(os.environ.get("LAB_GRIND", "1"))  # h42b: aware steerer submits the best of this many unused counters
MIN_DECISIVE = int(os.environ.get("LAB_MIN_DECISIVE", "64"))  # i33b: audit.min_calibration_decisive of the lab's spec
if MIN_DECISIVE > 64:  # a bigger twin baseline than the default burst limit collects
    import node.coordinator.calibrate as _cal

    _cal.MAX_BURST_SUBMISSIONS = 8192
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from node.coordinator.base import EMBEDDED_BASE_DIR
from node.coordinator.calibrate import AuditCalibration, worker_engine
from node.devnet.config import devnet_spec
from node.engine.base import Generation
from node.engine.hf import TransformersEngine, seeds_tensor
from node.precision import measure_precision
from node.worker.rollouts import build_submission, prove_and_score, seal_submission
from node.worker.steering import answer_tokens, judge_tokens
from protocol import sampling
from protocol.audit import EVENTS, AuditState, event_counts
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.inference import completion_rows, forward, pad_left
from protocol.messages import ReplayStats, Submission
from protocol.models import load_model, load_tokenizer
from protocol.rollout import plan_submission
from protocol.runspec import RunSpec, ToplocSpec
from trainer.ledger.audit import WorkerAudit
from validator.pipeline import SubmissionChecker

# --- h41b: per-token log of every replay (LAB_LOG_TOKENS=file): one JSON line per replay_checks call -------------------
_orig_replay_checks = sampling.replay_checks
_IN_CHECK = [False]  # set while the validator's pipeline checks a submission (else: the steerer's own judge_tokens)


def _logged_replay_checks(logits, completions, seeds, params=None, start_positions=None, *, overwrite=False):
    params = sampling.ReplayParams() if params is None else params
    path = os.environ.get("LAB_LOG_TOKENS")
    if not path:
        return _orig_replay_checks(logits, completions, seeds, params, start_positions, overwrite=overwrite)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # [R, V] float32, before the check may overwrite
    res = _orig_replay_checks(logits, completions, seeds, params, start_positions, overwrite=overwrite)
    row = 0
    recs = []
    n = 0
    for comp, r in zip(completions, res):
        c = torch.as_tensor(comp, dtype=torch.int64).reshape(-1)
        n += int(c.numel())
        d = r.differs if r.differs is not None else r.gaps > 0
        for i in torch.nonzero(d).flatten().tolist():
            pr = probs[row + i]
            ci, ri = int(c[i]), int(r.tokens[i])
            lo, hi = min(ci, ri), max(ci, ri)
            between = float(pr[lo + 1:hi].sum()) if hi - lo > 1 else 0.0
            rank = int((pr > pr[ci]).sum()) if 0 <= ci < pr.numel() else -1
            recs.append([round(float(r.gaps[i]) / params.logit_bound, 6), ci, ri, float(pr[ci]) if 0 <= ci < pr.numel() else -1.0,
                         float(pr[ri]), between, rank, i])
        row += int(c.numel())
    with open(path, "a") as fh:
        fh.write(json.dumps({"src": "check" if _IN_CHECK[0] else "other", "tokens": n, "differs": recs}) + "\n")
    return res


sampling.replay_checks = _logged_replay_checks


COORD = NodeKey.from_seed(b"c" * 32)
AUDIT_RULE = "eprocess-v2"
SAMPLING_RULE = [sampling.RULE_ICDF]  # h42b: the spec's sampling.rule (--sampling-rule), set before the Lab is made


def base_spec(measured: ToplocSpec | None) -> RunSpec:
    draft = ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=1.0, worker_dtype="bfloat16")
    spec = devnet_spec(COORD, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="/ip4/127.0.0.1/tcp/1", seed=3,
                       worker_dtype="bf16", measured=measured or draft, sampling_rule=SAMPLING_RULE[0])
    return spec.model_copy(update={"audit": spec.audit.model_copy(update={"rule": AUDIT_RULE,  # i33b: the audit rule under test
                                                                          "min_calibration_decisive": MIN_DECISIVE})})


class Lab:
    def __init__(self, policy_dir: Path = EMBEDDED_BASE_DIR) -> None:
        self.policy_dir = policy_dir
        self.tok = load_tokenizer(policy_dir)
        self.tasks = resolve_tasks("embedded").train
        self.policy = load_model(policy_dir).eval()
        self.spec = self._spec()
        self.checker = SubmissionChecker(self.spec, self.tasks, self.tok, lambda s: self.policy, trainer_step=lambda: 0,
                                         counter_seen=lambda *_: False)

    def _spec(self) -> RunSpec:
        path = WORK / "toploc.json"
        if path.exists():
            return base_spec(ToplocSpec.model_validate_json(path.read_text()))
        draft = base_spec(None)
        t = time.time()
        m = measure_precision(draft, self.policy_dir, self.tasks, self.tok, "bfloat16", submissions=12, batches=(8, 64), fp32_head=True)
        toploc = m.toploc(draft.toploc, draft.sampling.temperature)
        print("\n".join(m.lines(toploc)), f"({time.time() - t:.0f} s)")
        WORK.mkdir(parents=True, exist_ok=True)
        path.write_text(toploc.model_dump_json())
        return base_spec(toploc)

    def bounds(self, audit: WorkerAudit) -> dict[str, float]:
        """h41b: the audit's bounds (the max over configurations), or one configuration's (LAB_BOUNDS_CONFIG=64)."""
        cfg = os.environ.get("LAB_BOUNDS_CONFIG")
        if not cfg:
            return audit.baseline.bounds()
        return audit.baseline.per_config[int(cfg)].bounds(self.spec.audit.baseline_confidence)

    def baseline(self) -> WorkerAudit:
        """The coordinator's calibration at step 0 (its burst to min_calibration_tokens), cached in WORK/audit.sqlite."""
        audit = WorkerAudit(self.spec.audit, WORK / "audit.sqlite")
        if not audit.ready():
            t = time.time()
            cal = AuditCalibration(self.spec, self.spec.run_id, self.tasks, lambda: self.tok, lambda s: self.policy_dir,
                                   lambda s: self.policy, audit)
            n = cal.calibrate(0)
            print(f"calibrated: {n} reference submissions, {audit.baseline.tokens()} tokens, outcomes {dict(cal.outcomes)} "
                  f"({time.time() - t:.0f} s)")
        return audit

    def check(self, raw: bytes) -> Any:
        _IN_CHECK[0] = True
        try:
            res = self.checker.check(open_envelope(raw, run_id=self.spec.run_id, expect=Submission))
        finally:
            _IN_CHECK[0] = False
        log = os.environ.get("LAB_LOG_STATS")  # a33b: every verdict's signed statistics, one JSON line each
        if log and res.stats is not None:
            with open(log, "a") as fh:
                fh.write(json.dumps({"reason": res.reason, "stats": json.loads(res.stats.model_dump_json())}) + "\n")
        return res


def pooled_rates(audit: WorkerAudit) -> dict[str, str]:
    pooled = audit.baseline.pooled()
    return {k: f"{pooled.get(k, (0, 0))[0]}/{pooled.get(k, (0, 0))[1]}" for k in EVENTS}


# --- honest workers of other configurations --------------------------------------------------------------------------


def honest_engine(lab: Lab, config: str) -> Any:
    """``b1`` / ``b8`` / ``b64``: decode batch; ``nocache``: full forward per step (batch 64); ``bf16head``: the
    worker's logits from its bf16 head although the spec says float32 logits; ``fp32``: a float32 worker."""
    spec = lab.spec
    if config.startswith("b") and config[1:].isdigit():
        return worker_engine(spec, lab.policy_dir, max_batch=int(config[1:]))
    if config == "nocache":
        from false_rejections import NoCacheEngine

        return NoCacheEngine.from_dir(lab.policy_dir, max_batch=64, compute_dtype=torch.bfloat16, fp32_head=True)
    if config == "nocache1":
        from false_rejections import NoCacheEngine

        return NoCacheEngine.from_dir(lab.policy_dir, max_batch=1, compute_dtype=torch.bfloat16, fp32_head=True)
    if config == "bf16head":
        return TransformersEngine.from_dir(lab.policy_dir, max_batch=64, compute_dtype=torch.bfloat16, fp32_head=False)
    if config == "fp32":
        return TransformersEngine.from_dir(lab.policy_dir, max_batch=64)
    raise SystemExit(f"unknown config {config}")


def sign_count(sign: dict[str, int], rs: Any, ts: Any) -> None:
    """Rollouts whose completion differs from the float32 twin's (same seeds): how often the claimed one passes where the
    twin fails (up) and the reverse (down). Honest noise is near symmetric (measured up-share 0.58-0.66); steering is not."""
    from protocol.rollout import unpack_u32

    for r, t in zip(rs, ts):
        if list(unpack_u32(r.completion_ids)) != list(unpack_u32(t.completion_ids)):
            sign["diverged"] += 1
            a, b = r.task_reward >= 1.0, t.task_reward >= 1.0
            sign["up"] += int(a and not b)
            sign["down"] += int(b and not a)


def run_honest(lab: Lab, config: str, submissions: int, seed: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    audit = lab.baseline()
    bounds = lab.bounds(audit)
    engine = honest_engine(lab, config)
    key = NodeKey.from_seed(seed.to_bytes(4, "big") * 8)
    state = AuditState(rule=lab.spec.audit.rule)
    reasons: dict[str, int] = {}
    sign = {"diverged": 0, "up": 0, "down": 0}
    twin = TransformersEngine(lab.policy, lab.tok) if config != "fp32" else None
    peak = -math.inf
    comp_peak = ("", -math.inf)
    passes = rollouts = 0
    for counter in range(submissions):
        raw = build_submission(lab.spec, lab.spec.run_id, key, engine, lab.tok, lab.tasks, 0, counter)
        result = lab.check(raw)
        reasons[result.reason] = reasons.get(result.reason, 0) + 1
        body = open_envelope(raw, run_id=lab.spec.run_id, expect=Submission).body
        rollouts += len(body.rollouts)
        passes += sum(r.task_reward >= 1.0 for r in body.rollouts)
        if twin is not None:
            tb = open_envelope(build_submission(lab.spec, lab.spec.run_id, key, twin, lab.tok, lab.tasks, 0, counter),
                               run_id=lab.spec.run_id, expect=Submission).body
            sign_count(sign, body.rollouts, tb.rollouts)
        if result.stats is not None and result.accepted:  # s39: accepted verdicts only
            state.observe(result.stats, bounds)
            peak = max(peak, state.log_e_value() / math.log(10))
            for ck, cv in state.log_wealth.items():
                if cv > comp_peak[1]:
                    comp_peak = (ck, cv)
        if (counter + 1) % 10 == 0:
            print(f"  [{counter + 1}] {reasons} rates {({k: v for k, v in state.totals.items() if v[0]})} log10E "
                  f"{state.log_e_value() / math.log(10):.2f} peak {peak:.2f}", file=sys.stderr, flush=True)
    flag = state.flag(lab.spec.audit.false_alarm, bounds)
    tokens = state.totals.get("differ", (0, 1))[1]
    out = {"config": config, "threads": threads, "submissions": submissions, "rollouts": rollouts, "tokens": tokens,
           "reasons": reasons, "pass_rate": round(passes / max(1, rollouts), 4),
           "rates": {k: f"{v[0]}/{v[1]} = {v[0] / max(1, v[1]):.5f}" for k, v in state.totals.items()},
           "bounds": {k: round(v, 5) for k, v in bounds.items()},
           "ratio_to_bound": {k: round(state.totals[k][0] / max(1, state.totals[k][1]) / bounds[k], 3) for k in EVENTS if k in state.totals},
           "log10_e_final": round(state.log_e_value() / math.log(10), 2), "log10_e_peak": round(peak, 2),
           "peak_component_log10": (comp_peak[0], round(comp_peak[1] / math.log(10), 2)),
           "threshold_log10": round(math.log10(1 / lab.spec.audit.false_alarm), 1), "flagged": flag is not None,
           "reward_sign_vs_fp32_twin(diverged rollouts: up = passes where twin fails, down = reverse)": sign}
    return out


# --- the audit-aware steerer -------------------------------------------------------------------------------------------


class Budget:
    """Keeps the steerer's cumulative event counts at ``factor`` x the public honest bounds (the audit's ``p0``).

    The audit's alternatives are p1 = r p0 with r ≥ 2: a worker whose every event rate is ≤ p0 (1.0) has a
    negative drift on every component; the smallest rate with a positive drift is (r - 1) / ln r = 1.44 p0 (r = 2).
    """

    def __init__(self, bounds: dict[str, float], edges: tuple[float, ...], factor: float) -> None:
        self.bounds, self.edges, self.factor = bounds, edges, factor
        self.counts = dict.fromkeys(EVENTS, 0)
        self.tokens = 0

    def events_of(self, gap: float) -> list[str]:
        if gap <= 0:
            return []
        if math.isinf(gap):
            return ["differ", "impossible"] + [f"gap_over_{i}" for i in range(len(self.edges))]
        return ["differ"] + [f"gap_over_{i}" for i, e in enumerate(self.edges) if gap > e]

    def fits(self, gap: float, horizon: int) -> bool:
        """Whether one more event set of ``gap`` keeps each count ≤ factor · p0 · (tokens + horizon)."""
        n = self.tokens + horizon
        return all(self.counts[e] + 1 <= self.factor * self.bounds[e] * n for e in self.events_of(gap))

    def take(self, gap: float) -> None:
        for e in self.events_of(gap):
            self.counts[e] += 1

    def sync(self, stats: ReplayStats) -> None:
        """Replace the predicted counts of the last submission with the validator's (the worker computes
        in float32 like the validator, so they agree to its rounding)."""


@torch.no_grad()
def steered_submission(lab: Lab, key: NodeKey, counter: int, mode: str, trigger: int | None, budget: Budget,
                       horizon: int, stats: dict[str, int], sabotage: set[int] | None = None, max_steered_rows: int = 10**9) -> tuple[bytes, list[int]]:
    """One submission of a float32 worker that emits the policy's own token (it computes as the validator
    does: no bf16 noise of its own) except where it prefers another admissible token and the budget allows."""
    spec, tok, policy = lab.spec, lab.tok, lab.policy
    s = spec.sampling
    eos = int(tok.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    plan = plan_submission(spec, lab.tasks, tok, key.peer_id, 0, counter)
    prompts = [list(p.prompt_ids) for p in plan for _ in p.seeds]
    seeds = [int(x) for p in plan for x in p.seeds]
    answers = [answer_tokens(p, tok) for p in plan for _ in p.seeds]
    b_n = len(prompts)
    ids, mask, pos = pad_left(prompts, pad)
    out = forward(policy, ids, mask, pos, use_cache=True, logits_positions=torch.tensor([ids.shape[1] - 1]))
    cache, logits = out.cache, out.logits[:, -1]
    seed_t = seeds_tensor(seeds, "cpu")
    next_pos = pos[:, -1:] + 1
    emitted: list[list[int]] = [[] for _ in range(b_n)]
    steered_rows: set[int] = set()
    sabotaged: set[int] = set()
    diluted: set[int] = set()
    done = [False] * b_n
    on_answer = [a is not None for a in answers]
    for i in range(s.max_tokens):
        honest, _ = sampling.sample(logits, seed_t, torch.full((b_n,), i, dtype=torch.int64), s.temperature, s.top_p, (eos,),
                                    spec.toploc.eos_min_prob, s.rule)
        h = honest.tolist()
        active = [b for b in range(b_n) if not done[b]]
        budget.tokens += len(active)
        stats["tokens"] += len(active)
        if mode == "answer":
            want = {b: answers[b][i] for b in active if on_answer[b] and i < len(answers[b]) and answers[b][i] != h[b]
                    and b not in (sabotage or ()) and (b in steered_rows or len(steered_rows) < max_steered_rows)}
            # i33b balancing: rows whose honest completion passes, steered off the answer once (a "down" for the twin test)
            for b in active:
                if sabotage and b in sabotage and b not in sabotaged and on_answer[b] and i < len(answers[b]) and answers[b][i] == h[b]:
                    top = logits[b].topk(3).indices.tolist()
                    alt = next((t for t in top if t != h[b] and t != eos), None)
                    if alt is not None:
                        want[b] = alt
        else:
            want = {b: trigger for b in active if h[b] != trigger}
        cands = list(want)
        choice = list(h)
        if DILUTE and mode == "answer" and i >= 1:  # h41b: neutral divergences on rows already off the answer (their twin fails too)
            dil = [b for b in active if not on_answer[b] and b not in want and b not in steered_rows and b not in diluted
                   and b not in (sabotage or ())][: max(0, DILUTE - len(diluted))]
            if dil:
                alts = []
                for b in dil:
                    top = logits[b].topk(6).indices.tolist()
                    alts.extend((b, t) for t in top if t != h[b] and t != eos)
                jd = judge_tokens(spec, logits[torch.tensor([b for b, _ in alts])], [t for _, t in alts], [seeds[b] for b, _ in alts],
                                  [i] * len(alts), eos) if alts else []
                best: dict[int, tuple[float, int]] = {}
                for (b, t), j in zip(alts, jd):
                    if j.admissible and j.differs and math.isfinite(j.gap) and (b not in best or j.gap < best[b][0]):
                        best[b] = (j.gap, t)
                for b, (g, t) in sorted(best.items(), key=lambda x: x[1][0]):
                    if len(diluted) < DILUTE and budget.fits(g, horizon):
                        budget.take(g)
                        choice[b] = t
                        diluted.add(b)
                        stats["diluted"] = stats.get("diluted", 0) + 1
        if cands:
            judged = judge_tokens(spec, logits[torch.tensor(cands)], [want[b] for b in cands], [seeds[b] for b in cands], [i] * len(cands), eos)
            order = sorted(zip(cands, judged), key=lambda x: x[1].gap)  # the cheapest deviations first
            for b, j in order:
                if not j.admissible or math.isinf(j.gap):
                    continue
                if not (sabotage and b in sabotage) and b not in steered_rows and len(steered_rows) >= max_steered_rows:
                    continue  # h41b: the cap holds within one position too (several rows were steered at once before)
                stats["chances"] += 1
                sab_gap = getattr(budget, "sabotage_max_gap", None) if sabotage and b in sabotage else None
                if budget.fits(j.gap, horizon, sab_gap) if sab_gap is not None else budget.fits(j.gap, horizon):
                    budget.take(j.gap if j.differs else 0.0)
                    choice[b] = want[b]
                    stats["taken"] += 1
                    stats["gap_sum"] += j.gap
                    if sabotage and b in sabotage:
                        sabotaged.add(b)
                        stats["sabotaged"] = stats.get("sabotaged", 0) + 1
                    else:
                        steered_rows.add(b)
        for b in active:
            emitted[b].append(choice[b])
            if answers[b] is None or i >= len(answers[b]) or choice[b] != answers[b][i]:
                on_answer[b] = False
            done[b] = choice[b] == eos
        if all(done) or i + 1 == s.max_tokens:
            break
        tk = torch.tensor([pad if d else e[-1] for d, e in zip(done, emitted)], dtype=torch.int64)[:, None]
        mask = torch.cat([mask, torch.ones((b_n, 1), dtype=mask.dtype)], dim=1)
        out = forward(policy, tk, mask, next_pos, cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
        next_pos = next_pos + 1
    gens = []
    for ids_, rows in zip(emitted, completion_rows(policy, prompts, emitted, pad)):
        lg = policy.lm_head(rows).float()
        t = torch.tensor(ids_, dtype=torch.int64)
        lp = torch.log_softmax(lg / s.temperature, dim=-1).gather(-1, t[:, None])[:, 0]
        gens.append(Generation(completion_ids=t, logprobs=lp.float(), hidden=rows.to(torch.bfloat16),
                               finish="eos" if ids_[-1] == eos else "length"))
    rollouts = prove_and_score(spec, tok, plan, gens)
    return seal_submission(spec.run_id, key, 0, counter, plan, rollouts), [int(r.task_reward >= 1.0) for r in rollouts]


def run_steer(lab: Lab, mode: str, trigger: str | None, factor: float, submissions: int, seed: int, horizon: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    audit = lab.baseline()
    bounds = lab.bounds(audit)
    params = sampling.ReplayParams.from_spec(lab.spec, (int(lab.tok.eos_token_id),))
    trig = None
    if mode == "trigger":
        trig = int(lab.tok.convert_tokens_to_ids(trigger))
    key = NodeKey.from_seed(seed.to_bytes(4, "big") * 8)
    budget = Budget(bounds, params.gap_edges, factor)
    state = AuditState()
    stats = {"tokens": 0, "chances": 0, "taken": 0, "gap_sum": 0.0}
    reasons: dict[str, int] = {}
    steered_pass = honest_pass = rollouts = 0
    trig_emitted = trig_honest = tokens_all = 0
    peak = -math.inf
    flagged_at = None
    honest_engine_fp32 = TransformersEngine(lab.policy, lab.tok)  # the same worker without steering: paired comparison
    for counter in range(submissions):
        raw, passes = steered_submission(lab, key, counter, mode, trig, budget, horizon, stats)
        result = lab.check(raw)
        reasons[result.reason] = reasons.get(result.reason, 0) + 1
        if result.stats is not None:
            for (k, n) in event_counts(result.stats).values():  # the validator's counts replace the prediction
                pass
            state.observe(result.stats, bounds)
            peak = max(peak, state.log_e_value() / math.log(10))
            if flagged_at is None and state.flag(lab.spec.audit.false_alarm, bounds) is not None:
                flagged_at = stats["tokens"]
        body = open_envelope(raw, run_id=lab.spec.run_id, expect=Submission).body
        honest_raw = build_submission(lab.spec, lab.spec.run_id, key, honest_engine_fp32, lab.tok, lab.tasks, 0, counter)
        hbody = open_envelope(honest_raw, run_id=lab.spec.run_id, expect=Submission).body
        rollouts += len(body.rollouts)
        if result.accepted:
            steered_pass += sum(passes)
        honest_pass += sum(r.task_reward >= 1.0 for r in hbody.rollouts)
        if trig is not None:
            e, h, n = trigger_counts(body.rollouts, hbody.rollouts, trig)
            trig_emitted, trig_honest, tokens_all = trig_emitted + e, trig_honest + h, tokens_all + n
    return {"mode": mode, "trigger": trigger, "factor": factor, "horizon": horizon, "submissions": submissions, "rollouts": rollouts,
            "reasons": reasons, "tokens": stats["tokens"], "chances": stats["chances"], "taken": stats["taken"],
            "mean_gap_taken": round(stats["gap_sum"] / max(1, stats["taken"]), 4),
            "steered_per_1e4_tokens": round(1e4 * stats["taken"] / max(1, stats["tokens"]), 1),
            "pass_rate_steered(accepted only)": round(steered_pass / max(1, rollouts), 4),
            "pass_rate_same_worker_honest": round(honest_pass / max(1, rollouts), 4),
            "extra_passes_per_1e4_tokens": round(1e4 * (steered_pass - honest_pass) / max(1, stats["tokens"]), 1),
            **({"trigger_rate": round(trig_emitted / max(1, tokens_all), 5), "trigger_rate_honest": round(trig_honest / max(1, tokens_all), 5)}
               if trig is not None else {}),
            "worker_rates": {k: f"{v[0]}/{v[1]}" for k, v in state.totals.items()},
            "bounds": {k: round(v, 5) for k, v in bounds.items()},
            "log10_e_final": round(state.log_e_value() / math.log(10), 2), "log10_e_peak": round(peak, 2),
            "flagged_after_tokens": flagged_at}


# --- the audit-aware steerer, with exact accounting (red team 2) -------------------------------------------------------


class AwareBudget:
    """The audit-aware steerer's ration: a steered token (it differs from the replay's choice) counts
    ``differ`` and every ``gap_over_i`` whose edge its gap exceeds; the worker keeps each event's count
    ≤ ``factor`` · p0 · tokens (the counts are re-synced with the validator's after each submission).
    ``max_gap``: steer only tokens whose gap ≤ this (nats); e.g. δ/16 moves only ``differ``."""

    def __init__(self, bounds: dict[str, float], edges: tuple[float, ...], factor: float, max_gap: float,
                 differ_factor: float | None = None) -> None:
        self.bounds, self.edges, self.factor, self.max_gap = bounds, edges, factor, max_gap
        self.differ_factor = factor if differ_factor is None else differ_factor
        self.counts = dict.fromkeys(EVENTS, 0)
        self.tokens = 0

    def events_of(self, gap: float) -> list[str]:
        if math.isinf(gap):
            return ["differ", "impossible"] + [f"gap_over_{i}" for i in range(len(self.edges))]
        return ["differ"] + [f"gap_over_{i}" for i, e in enumerate(self.edges) if gap > e]

    def fits(self, gap: float, horizon: int, max_gap: float | None = None) -> bool:
        if gap > (self.max_gap if max_gap is None else max_gap):
            return False
        n = self.tokens + horizon
        return all(self.counts[e] + 1 <= (self.differ_factor if e == "differ" else self.factor) * self.bounds[e] * n
                   for e in self.events_of(gap))

    def take(self, gap: float) -> None:
        for e in self.events_of(max(gap, 1e-30)):
            self.counts[e] += 1

    def sync(self, totals: dict[str, tuple[int, int]]) -> None:
        for e in EVENTS:
            if e in totals:
                self.counts[e] = totals[e][0]
        self.tokens = totals.get("differ", (0, self.tokens))[1]


def lowered_logprobs(body: Submission, shift: float) -> Submission:
    """``body`` with every reported sampling log-prob lowered by ``shift`` nats (capped at 0): the log-prob
    shift adversary's submission."""
    import numpy as np

    from protocol.rollout import pack_f32

    rs = []
    for r in body.rollouts:
        lp = np.frombuffer(r.logprobs, dtype="<f4").astype(np.float64)
        rs.append(r.model_copy(update={"logprobs": pack_f32(np.minimum(lp - shift, 0.0).astype(np.float32))}))
    return body.model_copy(update={"rollouts": rs})


def trigger_counts(rollouts: Any, honest_rollouts: Any, trig: int) -> tuple[int, int, int]:
    """Times ``trig`` was emitted in the steered completions and in the same worker's honest ones, and the
    steered completions' tokens."""
    from protocol.rollout import unpack_u32

    emitted = honest = tokens = 0
    for r, hr in zip(rollouts, honest_rollouts):
        c, hc = unpack_u32(r.completion_ids), unpack_u32(hr.completion_ids)
        emitted += sum(t == trig for t in c)
        honest += sum(t == trig for t in hc)
        tokens += len(c)
    return emitted, honest, tokens


def ci95(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / max(1, n)
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, 1.96 * sd / math.sqrt(n)


def run_aware(lab: Lab, mode: str, trigger: str | None, factor: float, differ_factor: float | None, max_gap_frac: float,
              submissions: int, seed: int, horizon: int, keys: int, report_every: int, balance: float | None = None,
              max_steered_rows: int = 10**9, ceiling: float | None = None) -> dict[str, Any]:
    """The audit-aware steerer: rations its deviations by the public bounds (:class:`AwareBudget`), optionally
    spread over ``keys`` identities (each with its own audit state and its own ration)."""
    torch.set_num_threads(1)
    audit = lab.baseline()
    bounds = lab.bounds(audit)
    params = sampling.ReplayParams.from_spec(lab.spec, (int(lab.tok.eos_token_id),))
    delta = params.limit
    trig = int(lab.tok.convert_tokens_to_ids(trigger)) if mode == "trigger" else None
    ids = [NodeKey.from_seed((seed + 1000 * j).to_bytes(4, "big") * 8) for j in range(keys)]
    budgets = [AwareBudget(bounds, params.gap_edges, factor, max_gap_frac * delta, differ_factor) for _ in ids]
    for bud in budgets:
        bud.sabotage_max_gap = SABOTAGE_MAX_GAP * delta  # i33b: sabotage may spend the gap_over budgets too
    states = [AuditState(rule=lab.spec.audit.rule) for _ in ids]
    flag_sub: list[int | None] = [None] * keys
    flag_info: list[Any] = [None] * keys
    stats = {"tokens": 0, "chances": 0, "taken": 0, "gap_sum": 0.0}
    reasons: dict[str, int] = {}
    gains: list[float] = []
    steered_pass = honest_pass = rollouts = 0
    trig_emitted = trig_honest = tokens_all = 0
    peaks = [-math.inf] * keys
    flagged_at: list[int | None] = [None] * keys
    traj: list[tuple[int, float]] = []
    sign = {"diverged": 0, "up": 0, "down": 0}
    honest_engine_fp32 = TransformersEngine(lab.policy, lab.tok)
    ctl = {"predicted_up": 0, "predicted_down": 0, "resteered": 0, "twin_log10_peak": -99.0}

    for counter in range(submissions):
        j = counter % keys
        key, budget, state = ids[j], budgets[j], states[j]
        sub_counter = counter // keys  # the submission counter used (LAB_GRIND picks among several)
        sabotage: set[int] | None = None
        if balance is not None:  # keep the signed up-share at `balance`: sabotage enough honest-passing rows
            pre = open_envelope(build_submission(lab.spec, lab.spec.run_id, key, honest_engine_fp32, lab.tok, lab.tasks, 0, counter // keys),
                                run_id=lab.spec.run_id, expect=Submission).body
            ups, dec = state.totals.get("up", (0, 0))
            downs = dec - ups
            est = 3 if counter == 0 else ups / counter  # ups per submission so far
            need = max(0, math.ceil((ups + est) * (1 - balance) / balance - downs))
            passing = [b for b, r in enumerate(pre.rollouts) if r.task_reward >= 1.0]
            sabotage = set(passing[:need])
        if ceiling is not None:  # a33b: twin-aware controller (predicts each twin exactly: it is the float32 honest path)
            raw, passes, sabotage = controlled_submission(lab, key, counter // keys, mode, trig, budget, horizon, stats, max_steered_rows,
                                                          state, bounds, ceiling, honest_engine_fp32, ctl)
        elif GRIND > 1 and sabotage is None:  # h42b: the best of GRIND unused counters (its own budget copy each)
            rows = max_steered_rows if (counter // keys) % STEER_EVERY == 0 else 0
            tries = []
            for g_ in range(GRIND):
                b_, s_ = copy.deepcopy(budget), dict(stats)
                c_ = (counter // keys) * GRIND + g_
                raw_, passes_ = steered_submission(lab, key, c_, mode, trig, b_, horizon, s_, None, rows)
                tries.append((s_["taken"] if trig is not None else sum(passes_), c_, raw_, passes_, b_, s_))
            _, sub_counter, raw, passes, budget, best_stats = max(tries, key=lambda x: (x[0], -x[1]))
            budgets[j] = budget
            stats.update(best_stats)
        else:
            rows = max_steered_rows if (counter // keys) % STEER_EVERY == 0 else 0  # h41b: steer up only every n-th submission
            raw, passes = steered_submission(lab, key, counter // keys, mode, trig, budget, horizon, stats, sabotage, rows)
        result = lab.check(raw)
        reasons[result.reason] = reasons.get(result.reason, 0) + 1
        if result.stats is not None and result.accepted:  # s39: accepted verdicts only
            state.observe(result.stats, bounds)
            if ceiling is not None:  # a33b: the twin test's own mixture (what flags where the rate test does not bind)
                tl = round(twin_log_mixture(state.log_wealth, bounds["up"], 0, 0) / math.log(10), 2)
                ctl["twin_actual_log10_peak"] = max(ctl.get("twin_actual_log10_peak", -99.0), tl)
                ctl["twin_actual_log10_final"] = tl
                if tl >= math.log10(2e6) and ctl.get("twin_alone_flag_sub") is None:
                    ctl["twin_alone_flag_sub"] = counter
            budget.sync(state.totals)
            peaks[j] = max(peaks[j], state.log_e_value() / math.log(10))
            fl = state.flag(lab.spec.audit.false_alarm, bounds)
            if flagged_at[j] is None and fl is not None:
                flagged_at[j] = state.totals["differ"][1]
                flag_sub[j] = counter
                flag_info[j] = fl.detail()
        body = open_envelope(raw, run_id=lab.spec.run_id, expect=Submission).body
        honest_raw = build_submission(lab.spec, lab.spec.run_id, key, honest_engine_fp32, lab.tok, lab.tasks, 0, sub_counter)
        hbody = open_envelope(honest_raw, run_id=lab.spec.run_id, expect=Submission).body
        rollouts += len(body.rollouts)
        sign_count(sign, body.rollouts, hbody.rollouts)
        sp = sum(passes) if result.accepted else 0
        hp = sum(r.task_reward >= 1.0 for r in hbody.rollouts)
        steered_pass += sp
        honest_pass += hp
        gains.append(sp - hp)
        if trig is not None:
            e, h, n = trigger_counts(body.rollouts, hbody.rollouts, trig)
            trig_emitted, trig_honest, tokens_all = trig_emitted + e, trig_honest + h, tokens_all + n
        if report_every and (counter + 1) % report_every == 0:
            traj.append((stats["tokens"], round(max(s.log_e_value() for s in states) / math.log(10), 2)))
            print(f"  [{counter + 1}] tokens {stats['tokens']} taken {stats['taken']} log10E {[round(s.log_e_value() / math.log(10), 2) for s in states]} "
                  f"gain/sub {ci95(gains)[0]:.2f}", file=sys.stderr, flush=True)
    g, gci = ci95(gains)
    return {"mode": mode, "trigger": trigger if trig is not None else None, "factor": factor, "differ_factor": differ_factor,
            "max_gap": f"{max_gap_frac} x delta = {max_gap_frac * delta:.4f}", "horizon": horizon, "keys": keys,
            "submissions": submissions, "rollouts": rollouts, "reasons": reasons, "tokens": stats["tokens"], "chances": stats["chances"],
            "taken": stats["taken"], "sabotaged": stats.get("sabotaged", 0), "diluted": stats.get("diluted", 0), "mean_gap_taken": round(stats["gap_sum"] / max(1, stats["taken"]), 4),
            "steered_per_1e4_tokens": round(1e4 * stats["taken"] / max(1, stats["tokens"]), 1),
            "pass_rate_steered(accepted only)": round(steered_pass / max(1, rollouts), 4),
            "pass_rate_same_worker_honest": round(honest_pass / max(1, rollouts), 4),
            "gain_passes_per_submission(64 rollouts)": f"{g:.3f} ± {gci:.3f} (95% CI, n={len(gains)})",
            "gain_pass_rate_pp": f"{100 * g / 64:.2f} ± {100 * gci / 64:.2f}",
            **({"trigger_rate": round(trig_emitted / max(1, tokens_all), 5), "trigger_rate_honest": round(trig_honest / max(1, tokens_all), 5)}
               if trig is not None else {}),
            "worker_rates": [{k: f"{v[0]}/{v[1]}" for k, v in s.totals.items()} for s in states],
            "bounds": {k: round(v, 5) for k, v in bounds.items()},
            "log10_e_final": [round(s.log_e_value() / math.log(10), 2) for s in states], "log10_e_peak": [round(p, 2) for p in peaks],
            "flagged_after_tokens(own, counted)": flagged_at, "flagged_at_submission(0-based, overall counter)": flag_sub,
            "flag_detail": flag_info,
            "gain_passes_before_flag(through the flagging submission)": (sum(gains[: min(x for x in flag_sub if x is not None) + 1])
                                                                        if any(x is not None for x in flag_sub) else None),
            "validator_twin_counts(signed)": [{k: v for k, v in s.totals.items() if k == "up"} for s in states],
            "reward_sign_vs_fp32_twin": sign, "trajectory(tokens, max log10E)": traj, "controller": ctl if ceiling is not None else None}


def twin_log_mixture(log_wealth: dict[str, float], p0: float, u: int, d: int) -> float:
    """log of the twin test's mixture after adding u ups and d downs (protocol.audit's formula)."""
    from protocol.audit import UP_FRACTIONS
    logs = []
    for f in UP_FRACTIONS:
        p1 = p0 + f * (1 - p0)
        logs.append(log_wealth.get(f"up@{f:g}", 0.0) + u * math.log(p1 / p0) + d * (math.log1p(-p1) - math.log1p(-p0)))
    top = max(logs)
    return top + math.log(sum(math.exp(x - top) for x in logs) / len(logs))


def controlled_submission(lab: Lab, key: NodeKey, counter: int, mode: str, trig: int | None, budget: Any, horizon: int,
                          stats: dict[str, int], max_steered_rows: int, state: AuditState, bounds: dict[str, float], ceiling: float,
                          engine: Any, ctl: dict[str, Any]) -> tuple[bytes, list[int], set[int]]:
    """a33b: steer, predict the twin outcome of every diverged row (the twin is the honest float32 path), and add
    only as many sabotaged rows (downs) as keep the twin mixture below 10**ceiling."""
    from protocol.rollout import unpack_u32
    hraw = build_submission(lab.spec, lab.spec.run_id, key, engine, lab.tok, lab.tasks, 0, counter)
    hb = open_envelope(hraw, run_id=lab.spec.run_id, expect=Submission).body
    hc = [unpack_u32(r.completion_ids) for r in hb.rollouts]
    hp = [r.task_reward >= 1.0 for r in hb.rollouts]
    snap_counts, snap_tokens, snap_stats = dict(budget.counts), budget.tokens, dict(stats)

    def predict(raw: bytes) -> tuple[int, int]:
        body = open_envelope(raw, run_id=lab.spec.run_id, expect=Submission).body
        u = d = 0
        for r, c0, p in zip(body.rollouts, hc, hp):
            if unpack_u32(r.completion_ids) == c0:
                continue
            cp = r.task_reward >= 1.0
            u += cp and not p
            d += p and not cp
        return u, d

    raw, passes = steered_submission(lab, key, counter, mode, trig, budget, horizon, stats, None, max_steered_rows)
    u, d = predict(raw)
    p0 = bounds["up"]
    limit = ceiling * math.log(10)
    need = 0
    while twin_log_mixture(state.log_wealth, p0, u, d + need) > limit and need < 64:
        need += 1
    sabotage: set[int] = set()
    if need:  # sabotage first: cap the rows steered up until the prediction fits (ups would eat the differ ration first)
        sabotage = set([b for b in range(len(hp)) if hp[b]][:need + 1])  # one spare: not every sabotage is admissible
        for rows in range(u, -1, -1):
            budget.counts, budget.tokens = dict(snap_counts), snap_tokens
            stats.clear(); stats.update(snap_stats)
            raw, passes = steered_submission(lab, key, counter, mode, trig, budget, horizon, stats, sabotage, min(rows, max_steered_rows))
            u, d = predict(raw)
            ctl["resteered"] += 1
            if twin_log_mixture(state.log_wealth, p0, u, d) <= limit:
                break
    ctl["predicted_up"] += u
    ctl["predicted_down"] += d
    ctl["twin_log10_peak"] = max(ctl["twin_log10_peak"], round(twin_log_mixture(state.log_wealth, p0, u, d) / math.log(10), 2))
    return raw, passes, sabotage


def run_farm(lab: Lab, submissions: int, ceiling: float, seed: int, shift: float, report_every: int) -> dict[str, Any]:
    """a33b: "down farming". Accepted submissions are steered unbalanced (the rationed steerer); whenever the
    next one would lift the twin mixture above 10**ceiling the worker instead sends a *farm* submission: every
    honest-passing row steered off its answer (each a predictable ``down``), no row steered up, and its reported
    log-probs lowered by ``shift`` nats so that the validator rejects it as ``precision`` (benign: no ban, no
    reputation reset, nothing trained) -- its signed replay statistics, downs included, still count in the audit."""

    from protocol.envelope import seal
    from protocol.rollout import unpack_u32

    torch.set_num_threads(1)
    audit = lab.baseline()
    bounds = lab.bounds(audit)
    params = sampling.ReplayParams.from_spec(lab.spec, (int(lab.tok.eos_token_id),))
    delta = params.limit
    key = NodeKey.from_seed(seed.to_bytes(4, "big") * 8)
    budget = AwareBudget(bounds, params.gap_edges, 1.0, delta / 16)
    budget.sabotage_max_gap = SABOTAGE_MAX_GAP * delta
    state = AuditState(rule=lab.spec.audit.rule)
    eng = TransformersEngine(lab.policy, lab.tok)
    stats = {"tokens": 0, "chances": 0, "taken": 0, "gap_sum": 0.0}
    reasons: dict[str, dict[str, int]] = {"steered": {}, "farm": {}}
    gains_acc: list[float] = []
    acc_pass = acc_honest = acc_rows = farm_honest_lost = farm_rows = 0
    flagged = None
    peak = -99.0
    p0, limit = bounds["up"], ceiling * math.log(10)
    for counter in range(submissions):
        hraw = build_submission(lab.spec, lab.spec.run_id, key, eng, lab.tok, lab.tasks, 0, counter)
        hb = open_envelope(hraw, run_id=lab.spec.run_id, expect=Submission).body
        hc = [unpack_u32(r.completion_ids) for r in hb.rollouts]
        hp = [r.task_reward >= 1.0 for r in hb.rollouts]
        snap_counts, snap_tokens, snap_stats = dict(budget.counts), budget.tokens, dict(stats)
        raw, passes = steered_submission(lab, key, counter, "answer", None, budget, 0, stats, None)
        body = open_envelope(raw, run_id=lab.spec.run_id, expect=Submission).body
        u = sum(1 for r, c0, p in zip(body.rollouts, hc, hp) if unpack_u32(r.completion_ids) != c0 and r.task_reward >= 1.0 and not p)
        d = sum(1 for r, c0, p in zip(body.rollouts, hc, hp) if unpack_u32(r.completion_ids) != c0 and r.task_reward < 1.0 and p)
        kind = "steered"
        if twin_log_mixture(state.log_wealth, p0, u, d) > limit:  # farm instead
            kind = "farm"
            budget.counts, budget.tokens = dict(snap_counts), snap_tokens
            stats.clear(); stats.update(snap_stats)
            sab = {b for b in range(len(hp)) if hp[b]}
            raw, passes = steered_submission(lab, key, counter, "answer", None, budget, 0, stats, sab, 0)
            body = open_envelope(raw, run_id=lab.spec.run_id, expect=Submission).body
            raw = seal(key, lab.spec.run_id, lowered_logprobs(body, shift))
        result = lab.check(raw)
        reasons[kind][result.reason] = reasons[kind].get(result.reason, 0) + 1
        if result.stats is not None and result.accepted:  # s39: accepted verdicts only
            state.observe(result.stats, bounds)
            budget.sync(state.totals)
            peak = max(peak, state.log_e_value() / math.log(10))
            if flagged is None and state.flag(lab.spec.audit.false_alarm, bounds) is not None:
                flagged = (counter, state.totals["differ"][1], state.flag(lab.spec.audit.false_alarm, bounds).detail())
        if kind == "steered" and result.accepted:
            acc_rows += len(passes); acc_pass += sum(passes); acc_honest += sum(hp); gains_acc.append(sum(passes) - sum(hp))
        elif kind == "farm":
            farm_rows += len(hp); farm_honest_lost += sum(hp)
        if report_every and (counter + 1) % report_every == 0:
            print(f"  [{counter + 1}] {reasons} up {state.totals.get('up')} log10E {state.log_e_value() / math.log(10):.2f}", file=sys.stderr, flush=True)
    g, gci = ci95(gains_acc)
    return {"submissions": submissions, "reasons": reasons, "tokens": stats["tokens"], "taken": stats["taken"],
            "trained(accepted steered) pass rate": round(acc_pass / max(1, acc_rows), 4), "same rows honest": round(acc_honest / max(1, acc_rows), 4),
            "gain per accepted submission (pp)": f"{100 * g / 64:.2f} ± {100 * gci / 64:.2f} (n={len(gains_acc)})",
            "farm rows (untrained)": farm_rows, "honest passes given up in farm submissions": farm_honest_lost,
            "net gain over all submissions incl. farms (passes/sub)": round((acc_pass - acc_honest - farm_honest_lost) / submissions, 3),
            "worker_rates": {k: f"{v[0]}/{v[1]}" for k, v in state.totals.items()}, "bounds_up": round(p0, 4),
            "log10_e_peak": round(peak, 2), "log10_e_final": round(state.log_e_value() / math.log(10), 2),
            "twin_log10_final": round(twin_log_mixture(state.log_wealth, p0, 0, 0) / math.log(10), 2),
            "flagged (counter, tokens, detail)": flagged}


def run_lpshift(lab: Lab, shifts: list[float], submissions: int, seed: int) -> dict[str, Any]:
    """A worker that reports its sampling log-probs lowered by ``c`` nats per token (the trainer's importance
    weight π_old / π_behavior grows by e^c where the spec uses behavior log-probs): what the pipeline and the
    audit see. Tokens, proofs and rewards are the honest float32 worker's."""

    from protocol.envelope import seal

    torch.set_num_threads(1)
    audit = lab.baseline()
    bounds = lab.bounds(audit)
    key = NodeKey.from_seed(seed.to_bytes(4, "big") * 8)
    eng = TransformersEngine(lab.policy, lab.tok)
    out: dict[str, Any] = {}
    bodies = [open_envelope(build_submission(lab.spec, lab.spec.run_id, key, eng, lab.tok, lab.tasks, 0, c), run_id=lab.spec.run_id,
                            expect=Submission).body for c in range(submissions)]
    for c in shifts:
        state = AuditState()
        reasons: dict[str, int] = {}
        for body in bodies:
            raw = seal(key, lab.spec.run_id, lowered_logprobs(body, c))
            res = lab.check(raw)
            reasons[res.reason] = reasons.get(res.reason, 0) + 1
            if res.stats is not None and res.accepted:  # s39: accepted verdicts only
                state.observe(res.stats, bounds)
        out[f"shift {c}"] = {"reasons": reasons, "logprob_over": state.totals.get("logprob_over"),
                             "log10_e": round(state.log_e_value() / math.log(10), 2),
                             "flagged": state.flag(lab.spec.audit.false_alarm, bounds) is not None,
                             "importance_weight_gain": round(math.exp(c), 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--sampling-rule", choices=list(sampling.RULES), default=sampling.RULE_ICDF,
                        help="the spec's sampling.rule (h42b); use one LAB_WORK per rule: the calibration depends on it")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str) -> argparse.ArgumentParser:  # every command takes --sampling-rule
        return sub.add_parser(name, parents=[common])

    add("setup")
    h = add("honest")
    h.add_argument("--config", default="b64")
    h.add_argument("--submissions", type=int, default=100)
    h.add_argument("--seed", type=int, default=1)
    h.add_argument("--threads", type=int, default=1)
    st = add("steer")
    st.add_argument("--mode", choices=["answer", "trigger"], default="answer")
    st.add_argument("--trigger", default="x")
    st.add_argument("--budget", type=float, default=1.0, help="event counts kept at this multiple of the public bounds")
    st.add_argument("--horizon", type=int, default=0, help="tokens of look-ahead credit in the budget")
    st.add_argument("--submissions", type=int, default=50)
    st.add_argument("--seed", type=int, default=7)
    aw = add("aware")
    aw.add_argument("--mode", choices=["answer", "trigger"], default="answer")
    aw.add_argument("--trigger", default="x")
    aw.add_argument("--budget", type=float, default=1.0, help="every event count kept at this multiple of its public bound")
    aw.add_argument("--differ-budget", type=float, default=None, help="the differ count's multiple (default --budget)")
    aw.add_argument("--max-gap", type=float, default=1 / 16, help="steer only tokens whose gap <= this fraction of delta")
    aw.add_argument("--horizon", type=int, default=0)
    aw.add_argument("--keys", type=int, default=1, help="identities the steerer alternates (round robin)")
    aw.add_argument("--submissions", type=int, default=200)
    aw.add_argument("--seed", type=int, default=11)
    aw.add_argument("--report-every", type=int, default=50)
    aw.add_argument("--balance", type=float, default=None, help="i33b: keep the signed up-share at this by steering passing rollouts to fail")
    aw.add_argument("--ceiling", type=float, default=None, help="a33b: twin-aware controller, log10 twin-mixture ceiling")
    aw.add_argument("--max-steered-rows", type=int, default=10**9, help="i33b: rows steered up per submission at most")
    fm = add("farm")
    fm.add_argument("--submissions", type=int, default=300)
    fm.add_argument("--ceiling", type=float, default=5.0)
    fm.add_argument("--shift", type=float, default=0.7)
    fm.add_argument("--seed", type=int, default=11)
    fm.add_argument("--report-every", type=int, default=50)
    ls = add("lpshift")
    ls.add_argument("--shifts", default="0,0.2,0.4,0.6,0.7")
    ls.add_argument("--submissions", type=int, default=20)
    ls.add_argument("--seed", type=int, default=21)
    args = ap.parse_args()
    SAMPLING_RULE[0] = args.sampling_rule
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    lab = Lab()
    print(f"sampling rule {lab.spec.sampling.rule}, replay rule {lab.spec.toploc.replay_rule}, δ = {lab.spec.toploc.replay_logit_bound} nats, "
          f"T = {lab.spec.sampling.temperature}, top_p = {lab.spec.sampling.top_p}; LAB_WORK {WORK}", file=sys.stderr)
    t = time.time()
    if args.cmd == "setup":
        audit = lab.baseline()
        print(json.dumps({"toploc": lab.spec.toploc.model_dump(), "audit": lab.spec.audit.model_dump(), "tokens": audit.baseline.tokens(),
                          "pooled": pooled_rates(audit), "bounds": audit.baseline.bounds(),
                          "per_config": {c: {"pooled": {k: list(v) for k, v in cc.pooled().items()}, "twins": cc.twins,
                                             "bounds": {k: round(v, 5) for k, v in cc.bounds(lab.spec.audit.baseline_confidence).items()}}
                                         for c, cc in audit.baseline.per_config.items()}}, indent=1))
    elif args.cmd == "honest":
        print(json.dumps(run_honest(lab, args.config, args.submissions, args.seed, args.threads), indent=1))
    elif args.cmd == "lpshift":
        print(json.dumps(run_lpshift(lab, [float(x) for x in args.shifts.split(",")], args.submissions, args.seed), indent=1))
    elif args.cmd == "farm":
        print(json.dumps(run_farm(lab, args.submissions, args.ceiling, args.seed, args.shift, args.report_every), indent=1))
    elif args.cmd == "aware":
        print(json.dumps(run_aware(lab, args.mode, args.trigger, args.budget, args.differ_budget, args.max_gap, args.submissions, args.seed,
                                   args.horizon, args.keys, args.report_every, args.balance, args.max_steered_rows, args.ceiling), indent=1))
    else:
        print(json.dumps(run_steer(lab, args.mode, args.trigger, args.budget, args.submissions, args.seed, args.horizon), indent=1))
    print(f"{time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
