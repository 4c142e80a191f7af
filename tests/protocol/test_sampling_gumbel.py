"""Tests of sampling rule ``gumbel-v2`` (protocol.sampling, docs/toploc.md §5.3): its pinned noise, its
distribution and kept sets, its replay under a logit bound, and the bound on what one token can do."""

from __future__ import annotations

import math

import pytest
import torch

from protocol import sampling
from protocol.identity import NodeKey
from protocol.runspec import RunInfo, RunSpec, SamplingSpec, ToplocSpec, sign_run_spec

RULE = sampling.RULE_GUMBEL


def _reference_noise(seed: int, position: int, token: int) -> float:
    """``g`` of one (seed, position, token) from the rule's text, with the Philox known-answer implementation."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)
    words = sampling.philox4x32((t(position & 0xFFFFFFFF), t(position >> 32), t(token // 4), t(0x474D4232)),
                                (t(seed & 0xFFFFFFFF), t(seed >> 32)))
    u = (int(words[token % 4]) + 0.5) / 2**32
    return -math.log(-math.log(u))


def test_noise_is_pinned_and_paths_agree() -> None:
    """The noise is the rule's text (word v mod 4 of Philox block v div 4, tag "GMB2"), the same
    from the full-vocabulary and the per-id paths and on the numpy and the torch paths."""
    seeds = torch.tensor([0, 3, (1 << 63) - 5], dtype=torch.int64)
    pos = torch.tensor([0, 7, (1 << 33) + 2], dtype=torch.int64)
    full = sampling.gumbel_noise(seeds, pos, 1001)  # [3, 1001]: 1001 is not a multiple of 4
    assert full.shape == (3, 1001) and full.dtype == torch.float64
    for b in range(3):
        for v in (0, 1, 2, 3, 4, 998, 1000):
            assert float(full[b, v]) == pytest.approx(_reference_noise(int(seeds[b]), int(pos[b]), v), abs=1e-12)
    ids = torch.tensor([[5, 0, 1000], [999, 4, 4], [3, 2, 1]])
    assert torch.equal(sampling.gumbel_noise(seeds, pos, ids), full.gather(1, ids))
    words = sampling._philox_words(seeds, pos, ids >> 2, sampling.GUMBEL_COUNTER_TAG, use_numpy=False)
    assert torch.equal(sampling._gumbel_of(words, ids & 3), full.gather(1, ids))  # the int64-tensor path (CUDA's)
    lo, hi = -math.log(-math.log(0.5 / 2**32)), -math.log(-math.log(1 - 0.5 / 2**32))
    assert lo <= float(full.min()) and float(full.max()) <= hi and math.isfinite(hi)
    assert not torch.equal(sampling.gumbel_noise(seeds, pos + 1, 1001), full)  # keyed by the position too


def test_distribution_temperature_and_kept_sets() -> None:
    """Gumbel-max follows the tempered softmax; top-p and the EOS gate keep what ``icdf-v1`` keeps; nothing
    kept gives the most probable non-EOS token; log-probs are of the unfiltered distribution."""
    n = 20000
    seeds, pos = torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    for temperature in (1.0, 0.7):
        toks, lps = sampling.sample(logits.expand(n, -1), seeds, pos, temperature, rule=RULE)
        freq = torch.bincount(toks, minlength=4).double() / n
        expected = torch.softmax(logits[0].double() / temperature, -1)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)
        assert torch.allclose(lps.double(), torch.log_softmax(logits[0].double() / temperature, -1)[toks], atol=1e-6)
    five = torch.tensor([[2.0, 1.0, 0.5, 0.0, -3.0]]).expand(4000, -1)
    toks, _ = sampling.sample(five, seeds[:4000], pos[:4000], top_p=0.6, rule=RULE)
    p = torch.softmax(five[0].double(), -1)  # 0.55, 0.20, …: kept {0, 1}
    assert set(toks.tolist()) == {0, 1}
    assert abs(float((toks == 0).double().mean()) - float(p[0] / (p[0] + p[1]))) < 0.03
    gated = torch.tensor([[12.0, 0.0, 1.0, 0.5]]).expand(256, -1)  # EOS 0 holds almost all mass but is gated
    toks, _ = sampling.sample(gated, seeds[:256], pos[:256], eos_ids=(0,), min_eos_prob=1.0, rule=RULE)
    assert 0 not in toks.tolist() and set(toks.tolist()) == {1, 2, 3}
    one, _ = sampling.sample(gated[:4], seeds[:4], pos[:4], top_p=0.5, eos_ids=(0,), min_eos_prob=1.0, rule=RULE)
    assert one.tolist() == [2, 2, 2, 2]  # nucleus = {EOS}, gated: the most probable non-EOS token
    with pytest.raises(ValueError, match="precomputed uniforms"):
        sampling.sample(logits, seeds[:1], pos[:1], rule=RULE, u=torch.zeros(1, sampling.ICDF_DRAWS + 1, dtype=torch.float64))


def _bf16_setup(n: int, vocab: int, seed: int, scale: float = 0.6) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(n, 64, generator=g), torch.randn(vocab, 64, generator=g) * scale
    fp32 = h @ w.T
    bf16 = (h.bfloat16() @ w.bfloat16().T).float()
    err = bf16 - fp32
    delta = 1.5 * float(((err.amax(-1) - err.amin(-1)) / 2).max())
    return fp32, bf16, delta, h, w


@pytest.mark.parametrize(("temperature", "top_p", "floor", "scale"), [(1.0, 1.0, 0.0, 0.6), (0.8, 0.9, 0.1, 0.6), (1.5, 1.0, 0.0, 0.05)])
def test_replay_accepts_workers_within_the_bound_and_rejects_cheats(temperature: float, top_p: float, floor: float, scale: float) -> None:
    """Every token of a worker whose logits lie within δ of the validator's (a bf16 LM head, uniform noise,
    the worst case that moves every other token up by δ) passes, also on flat rows where the worker's token
    is usually outside the validator's candidate set (``scale`` 0.05); greedy, runner-up and beyond-the-bound
    workers are rejected."""
    n, vocab, eos = 192, 2048, 1
    fp32, bf16, delta, _, _ = _bf16_setup(n, vocab, 7, scale)
    g = torch.Generator().manual_seed(1)
    seeds, pos = torch.full((n,), 11, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    common = {"temperature": temperature, "top_p": top_p, "eos_ids": (eos,), "min_eos_prob": floor, "max_near_tie_fraction": 1.0,
              "rule": RULE, "replay_rule": "logit-bound-v1", "logit_bound": delta}
    honest = sampling.sample(fp32, seeds, pos, temperature, top_p, (eos,), floor, RULE)[0]
    down = torch.where(torch.nn.functional.one_hot(honest, vocab).bool(), -0.999 * delta, 0.999 * delta)  # the chosen one down, all others up
    workers = {"bf16 head": bf16, "uniform noise": fp32 + (torch.rand(n, vocab, generator=g) * 2 - 1) * delta + 3.0, "worst case": fp32 + down}
    outside = 0
    for name, x in workers.items():
        toks, _ = sampling.sample(x, seeds, pos, temperature, top_p, (eos,), floor, RULE)
        res = sampling.replay_check(fp32.clone(), toks, 11, sampling.ReplayParams(**common))
        assert res.ok and res.hard_mismatches == 0, (name, res.reason)
        assert float(res.gaps.max()) <= delta
        cand = fp32.topk(sampling.GUMBEL_CANDIDATES, dim=-1).indices
        outside += int((~(cand == toks[:, None]).any(-1)).sum())
    if scale < 0.1:
        assert outside > 0  # the candidate set's lower bound was exercised
    top2 = torch.topk(fp32, 2).indices
    cheats = {
        "greedy": top2[:, 0],
        "runner-up": torch.where(top2[:, 0] == honest, top2[:, 1], top2[:, 0]),
    }
    if scale > 0.1:  # on flat rows the candidates hold little mass and a 3δ worker's window is not seen (§5.3)
        cheats["beyond the bound"] = sampling.sample(fp32 + 3 * delta * torch.where(torch.arange(vocab) < vocab // 2, -1.0, 1.0), seeds,
                                                     pos, temperature, top_p, (eos,), floor, RULE)[0]
    for name, toks in cheats.items():
        res = sampling.replay_check(fp32.clone(), toks, 11, sampling.ReplayParams(**common))
        assert not res.ok and res.hard_mismatches >= 3 and "logit bound" in res.reason, (name, res.hard_mismatches)


def test_one_injected_token_is_admissible_at_most_at_its_bound() -> None:
    """docs/toploc.md §5.3: under ``gumbel-v2`` a chosen ("trigger") token ``c`` passes the replay at a
    position with probability ``q / (m + q)``, ``q = e^{2δ/T} · p_c``, ``m`` the mass of the validator's
    other candidates (so at most ``e^{2δ/T} · p_c / m``); under ``icdf-v1`` at the same δ a low-probability
    token is admissible wherever a uniform's window reaches its interval, far more often. Measured over
    4,096 positions at vocabulary 4,096 for one fixed id (an injector's trigger)."""
    n, vocab, delta, temperature = 4096, 4096, 1.0, 1.0
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=g) * 2.5
    p = torch.softmax(logits.double() / temperature, -1)
    trig = torch.full((n,), 17, dtype=torch.int64)
    admitted = {}
    for rule in (sampling.RULE_ICDF, RULE):
        params = sampling.ReplayParams(temperature=temperature, rule=rule, replay_rule="logit-bound-v1", logit_bound=delta,
                                       max_near_tie_fraction=1.0)
        res = sampling.replay_check(logits.clone(), trig, 9, params)
        admitted[rule] = int((res.gaps <= delta).sum())
    cand = logits.topk(sampling.GUMBEL_CANDIDATES, dim=-1).indices
    others = p.gather(1, cand).masked_fill(cand == 17, 0.0).sum(-1)  # [n] m: the candidates' mass but the trigger's
    q = math.exp(2 * delta / temperature) * p[:, 17]
    expected = float((q / (others + q)).sum())
    sd = math.sqrt(expected)
    assert abs(admitted[RULE] - expected) <= 4 * sd + 2, (admitted[RULE], expected)
    assert admitted[RULE] <= float((q / others).sum()) + 4 * sd + 2  # the stated bound
    assert admitted[sampling.RULE_ICDF] >= 5 * max(admitted[RULE], 1), admitted  # icdf-v1: 139 against 14 when written


def test_replay_refuses_out_of_vocab_nucleus_and_non_finite_and_eps_rule() -> None:
    logits = torch.tensor([[5.0, 0.0, -5.0]] * 4)
    params = sampling.ReplayParams(top_p=0.5, rule=RULE, replay_rule="logit-bound-v1", logit_bound=0.5)
    res = sampling.replay_check(logits, [0, 0, 7, -1], 1, params)
    assert not res.ok and res.hard_mismatches == 2 and math.isinf(float(res.gaps[2]))
    outside = sampling.replay_check(logits, [0, 2, 0, 0], 1, params)
    assert not outside.ok and math.isinf(float(outside.gaps[1]))
    bad = logits.clone()
    bad[1, 1] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        sampling.replay_check(bad, [0, 0, 0, 0], 1, params)
    with pytest.raises(ValueError, match="logit bound"):
        sampling.ReplayParams(rule=RULE)  # eps-v1 cannot replay it


def test_run_spec_names_the_rule_only_under_a_logit_bound() -> None:
    """A spec may name ``gumbel-v2`` with a logit replay rule; with ``eps-v1`` it is refused naming the fields;
    a spec that names no rule keeps ``icdf-v1`` and its run ID (old specs keep their meaning)."""
    key = NodeKey.generate()
    run = RunInfo(coordinator=key.peer_id, seed=42)
    base = RunSpec(run=run)
    assert base.sampling.rule == "icdf-v1"
    named = RunSpec(run=run, sampling=SamplingSpec(rule="icdf-v1"))
    assert sign_run_spec(named, key).run_id == sign_run_spec(base, key).run_id
    ok = RunSpec(run=run, sampling=SamplingSpec(rule="gumbel-v2"), toploc=ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=1.0))
    assert sampling.ReplayParams.from_spec(ok, (0,)).rule == RULE
    assert sign_run_spec(ok, key).run_id != sign_run_spec(RunSpec(run=run, toploc=ok.toploc), key).run_id
    with pytest.raises(ValueError, match="gumbel-v2 is replayed under a logit bound"):
        RunSpec(run=run, sampling=SamplingSpec(rule="gumbel-v2"))
    with pytest.raises(ValueError):
        SamplingSpec(rule="gumbel-v1")  # the removed rule's name stays refused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gumbel_bits_identical_on_gpu_and_no_host_sync() -> None:
    """Noise, tokens, log-probs and the replay's verdicts are the same on CPU and GPU at vocabulary 151,936
    (with and without top-p and the EOS gate), and the sampler never synchronises with the host."""
    g = torch.Generator().manual_seed(12)
    seeds = torch.randint(0, 2**63 - 1, (16,), dtype=torch.int64, generator=g)
    pos = torch.randint(0, 2**40, (16,), dtype=torch.int64, generator=g)
    assert torch.equal(sampling.gumbel_noise(seeds, pos, 151_936), sampling.gumbel_noise(seeds.cuda(), pos.cuda(), 151_936).cpu())
    logits = torch.randn(16, 151_936, generator=g) * 3
    for top_p, floor in ((1.0, 0.0), (0.95, 0.1)):
        t_cpu, l_cpu = sampling.sample(logits, seeds, pos, 0.7, top_p, (1,), floor, RULE)
        t_gpu, l_gpu = sampling.sample(logits.cuda(), seeds.cuda(), pos.cuda(), 0.7, top_p, (1,), floor, RULE)
        assert torch.equal(t_cpu, t_gpu.cpu()) and torch.allclose(l_cpu, l_gpu.cpu(), atol=1e-5)
        one = torch.full((16,), int(seeds[0]))
        toks, _ = sampling.sample(logits, one, torch.arange(16), 0.7, top_p, (1,), floor, RULE)
        params = sampling.ReplayParams(temperature=0.7, top_p=top_p, eos_ids=(1,), min_eos_prob=floor, rule=RULE,
                                       replay_rule="logit-bound-v1", logit_bound=1.0)
        rc = sampling.replay_check(logits, toks, int(seeds[0]), params, 0)
        rg = sampling.replay_check(logits.cuda(), toks.cuda(), int(seeds[0]), params, 0)
        assert rc.ok and rg.ok and torch.equal(rc.tokens, rg.tokens.cpu())
        big = logits.cuda()[:8].repeat(8, 1)  # 64 rows
        s64, p64 = torch.arange(64, device="cuda"), torch.full((64,), 5, device="cuda", dtype=torch.int64)
        sampling.sample(big, s64, p64, 1.0, top_p, (1,), floor, RULE)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            toks64, lps64 = sampling.sample(big, s64, p64, 1.0, top_p, (1,), floor, RULE)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert toks64.shape == (64,) and bool(torch.isfinite(lps64).all())


def _peaked(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Confident rows: one token ≈ 0.78, a runner-up ≈ 0.11, a flat tail of ≈ 1e-4 each (float32 ``[n, vocab]``)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 0.3
    logits[:, 5] += 9.0
    logits[:, 6] += 7.0
    return logits


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_top_p_confident_rows_bound_an_injected_token(floor: float) -> None:
    """With top-p < 1, a confident row has no *surely kept* token (the worker's logits may push the top token alone
    past the reduced nucleus), but the worker's kept set still holds its own most probable token, a token within
    2δ/T of the validator's best: a tail token is admissible only where its score comes within the window of those
    tokens' scores (h42b: before, such rows had no bound at all and a 1e-4 token passed at 2,610 of 4,000
    positions at top_p 0.9 against 2 at top_p 1). Honest workers within δ still pass on these rows."""
    n, vocab, delta, eos = 1500, 1000, 0.5, 1  # h42b measured at 4,000 rows; 1,500 keep the old code failing (≈ 65 % admitted)
    logits = _peaked(n, vocab, 0)
    p = torch.softmax(logits.double(), -1)
    common = {"temperature": 1.0, "eos_ids": (eos,), "min_eos_prob": floor, "rule": RULE, "replay_rule": "logit-bound-v1",
              "logit_bound": delta, "max_near_tie_fraction": 1.0}
    admitted = {}
    for top_p in (1.0, 0.9):
        res = sampling.replay_check(logits.clone(), torch.full((n,), 17), 9, sampling.ReplayParams(top_p=top_p, **common))
        admitted[top_p] = int((res.gaps <= delta).sum())
    q = math.exp(2 * delta) * p[:, 17]
    bound = float((q / (1 - p[:, 17])).sum())  # ≈ 1.1: every row's candidates hold all its mass
    assert admitted[0.9] <= bound + 4 * math.sqrt(bound) + 2, admitted
    assert admitted[1.0] <= bound + 4 * math.sqrt(bound) + 2, admitted
    # honest workers within δ of these logits (a bf16-like perturbation, the worst case for the chosen token) pass
    g = torch.Generator().manual_seed(2)
    seeds, pos = torch.full((n,), 11, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    for top_p in (1.0, 0.9, 0.5):
        honest = sampling.sample(logits, seeds, pos, 1.0, top_p, (eos,), floor, RULE)[0]
        down = torch.where(torch.nn.functional.one_hot(honest, vocab).bool(), -0.999 * delta, 0.999 * delta)
        for name, x in {"noise": logits + (torch.rand(n, vocab, generator=g) * 2 - 1) * delta, "worst case": logits + down,
                        "top down": logits - 0.999 * delta * torch.nn.functional.one_hot(torch.full((n,), 5), vocab)}.items():
            toks = sampling.sample(x, seeds, pos, 1.0, top_p, (eos,), floor, RULE)[0]
            res = sampling.replay_check(logits.clone(), toks, 11, sampling.ReplayParams(top_p=top_p, **common))
            assert res.ok and res.hard_mismatches == 0 and float(res.gaps.max()) <= delta, (top_p, name, res.reason)
    # the worker's kept set may be empty only where EOS, gated, may be its best token: then its most probable non-EOS passes
    gated = torch.tensor([[12.0, 0.0, 1.0, 0.5]]).expand(64, -1).contiguous()
    for top_p in (0.5, 1.0):
        toks = sampling.sample(gated, seeds[:64], pos[:64], 1.0, top_p, (0,), 1.0, RULE)[0]
        assert (top_p < 1.0) == (set(toks.tolist()) == {2})
        params = sampling.ReplayParams(top_p=top_p, **{**common, "eos_ids": (0,), "min_eos_prob": 1.0})
        assert all(r.ok for r in sampling.replay_checks(gated.clone(), [[int(t)] for t in toks], [11] * 64, params, list(range(64))))


@pytest.mark.parametrize(("temperature", "top_p", "floor"), [(0.02, 1.0, 0.0), (0.005, 0.9, 0.1)])
def test_low_temperature_far_tokens_refused_and_honest_pass(temperature: float, top_p: float, floor: float) -> None:
    """The sampler floors tempered logits at −87; the replay scores the claimed token from its unfloored logit. Before
    (h42b), with 2δ/T past ≈ 62 (T < 0.032 at δ = 1) the floor put every token within the window: a token 10⁴ logits
    below the best, or at −inf, passed at 500 of 500 positions at T = 0.02. Honest workers within δ still pass."""
    n, vocab, delta, eos = 500, 1000, 1.0, 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, vocab, generator=g)
    x[:, 999], x[:, 998] = -1e4, -math.inf
    params = sampling.ReplayParams(temperature=temperature, top_p=top_p, eos_ids=(eos,), min_eos_prob=floor, rule=RULE,
                                   replay_rule="logit-bound-v1", logit_bound=delta, max_near_tie_fraction=1.0)
    for far in (999, 998):
        res = sampling.replay_check(x.clone(), torch.full((n,), far), 3, params)
        assert int((res.gaps <= delta).sum()) == 0, far
    seeds, pos = torch.full((n,), 3, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    honest = sampling.sample(x, seeds, pos, temperature, top_p, (eos,), floor, RULE)[0]
    down = torch.where(torch.nn.functional.one_hot(honest, vocab).bool(), -0.999 * delta, 0.999 * delta)
    for name, w in {"noise": x + (torch.rand(n, vocab, generator=g) * 2 - 1) * delta, "worst case": x + down}.items():
        toks = sampling.sample(w, seeds, pos, temperature, top_p, (eos,), floor, RULE)[0]
        res = sampling.replay_check(x.clone(), toks, 3, params)
        assert res.ok and res.hard_mismatches == 0, (name, res.reason)
