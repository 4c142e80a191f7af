"""Tests of protocol.sampling: Philox KATs, the sampling rule (icdf-v1), its chunked CDF and nucleus, replay, termination, log-probs, seeds."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import sampling


def _t(*values: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(v, dtype=torch.int64) for v in values)


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [  # Random123 kat_vectors, philox4x32 R=10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter: tuple[int, ...], key: tuple[int, ...], expected: tuple[int, ...]) -> None:
    out = sampling.philox4x32(_t(*counter), _t(*key))  # type: ignore[arg-type]
    assert tuple(int(o) for o in out) == expected


def test_icdf_uniforms_are_keyed_and_pinned() -> None:
    seeds = torch.tensor([1, 1, 2, -1], dtype=torch.int64)
    positions = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    u = sampling.uniforms(seeds, positions)
    assert u.shape == (4, sampling.ICDF_DRAWS + 1) and u.dtype == torch.float64
    assert bool(((u >= 0) & (u < 1)).all()) and len(set(u.flatten().tolist())) == u.numel()
    assert torch.equal(u, sampling.uniforms(seeds, positions))
    # Pinned: uniform 2j+1 of position 3, seed 5 is words 2, 3 of Philox block j (a change is a protocol change).
    w = sampling.philox4x32(_t(3, 0, 2, sampling.ICDF_COUNTER_TAG), _t(5, 0))  # type: ignore[arg-type]
    expected = ((int(w[2]) << 21) | (int(w[3]) >> 11)) / 2**53
    assert float(sampling.uniforms(torch.tensor([5]), torch.tensor([3]))[0, 5]) == expected


def test_icdf_uniforms_numpy_and_torch_paths_agree() -> None:
    """The CPU (numpy uint64) and device (int64 tensor, what CUDA runs) paths give the same words."""
    g = torch.Generator().manual_seed(3)
    seeds = torch.randint(-(2**63), 2**63 - 1, (256,), dtype=torch.int64, generator=g)
    pos = torch.cat([torch.randint(0, 2**40, (128,), generator=g), torch.arange(128)])
    a = sampling._uniform_words(seeds, pos, 9, use_numpy=True)
    b = sampling._uniform_words(seeds, pos, 9, use_numpy=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _icdf_reference(logits: list[float], seed: int, position: int, temperature: float, top_p: float, eos: set[int], floor: float) -> int:
    """``icdf-v1`` written out in plain Python floats, token by token (the normative text)."""
    z = [x / temperature for x in logits]
    mx = max(z)
    e = [math.exp(x - mx) for x in z]
    tot = sum(e)
    p = [x / tot for x in e]
    order = sorted(range(len(z)), key=lambda v: (-p[v], v))
    keep, acc = set(), 0.0
    for v in order:
        if acc < top_p:
            keep.add(v)
        acc += p[v]
    if eos and sum(p[v] for v in eos) < floor:
        keep -= eos
    u = sampling.uniforms(torch.tensor([seed]), torch.tensor([position]))[0].tolist()
    cdf = [sum(e[: k + 1]) for k in range(len(e))]
    for j in range(sampling.ICDF_DRAWS):
        tok = next(k for k in range(len(e)) if cdf[k] > u[j] * cdf[-1])
        if tok in keep:
            return tok
    if not keep:
        return max((v for v in range(len(z)) if v not in eos), key=lambda v: (z[v], -v))
    kc = [sum(e[v] for v in range(k + 1) if v in keep) for k in range(len(e))]
    return next(k for k in range(len(e)) if kc[k] > u[sampling.ICDF_DRAWS] * kc[-1])


@pytest.mark.parametrize(("temperature", "top_p", "floor"), [(1.0, 1.0, 0.0), (0.7, 0.6, 0.0), (1.3, 1.0, 0.3), (0.9, 0.5, 0.5), (1.0, 0.05, 0.99)])
def test_icdf_matches_reference(temperature: float, top_p: float, floor: float) -> None:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 40, generator=g) * 2
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    pos = torch.arange(64, dtype=torch.int64) * 7
    toks, _ = sampling.sample(logits, seeds, pos, temperature, top_p, (1, 3), floor, rule=sampling.RULE_ICDF)
    for i in range(64):
        ref = _icdf_reference(logits[i].tolist(), int(seeds[i]), int(pos[i]), temperature, top_p, {1, 3}, floor)
        assert int(toks[i]) == ref, i


def test_icdf_fallback_and_empty_kept_set() -> None:
    # EOS (id 0) holds almost all mass (P = 1 − 3.3e-5, far from the floor 1 at float32 precision) but is
    # gated: 16 draws almost always all land on it, and the fallback picks among the rest
    logits = torch.tensor([[12.0, 0.0, 1.0, 0.5]]).expand(256, -1)
    seeds, pos = torch.arange(256), torch.zeros(256, dtype=torch.int64)
    toks, _ = sampling.sample(logits, seeds, pos, eos_ids=(0,), min_eos_prob=1.0, rule=sampling.RULE_ICDF)
    assert 0 not in toks.tolist() and set(toks.tolist()) == {1, 2, 3}
    res = sampling.replay_check(logits[:8], toks[:8], 0, sampling.ReplayParams(eos_ids=(0,), min_eos_prob=1.0))  # seed 0 for row 0 only: row 0 checks out
    assert float(res.gaps[0]) == 0.0
    # nucleus = {EOS} and EOS gated: nothing kept, the most probable non-EOS token
    one, _ = sampling.sample(logits[:4], seeds[:4], pos[:4], top_p=0.5, eos_ids=(0,), min_eos_prob=1.0)
    assert one.tolist() == [2, 2, 2, 2]
    assert sampling.replay_check(logits[:4], one[:1].expand(4), 0, sampling.ReplayParams(top_p=0.5, eos_ids=(0,), min_eos_prob=1.0)).ok


def test_sample_matches_softmax_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]], dtype=torch.float32)
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64)
    toks, lps = sampling.sample(logits.expand(n, -1), seeds, torch.zeros(n, dtype=torch.int64), temperature=1.0)
    freq = torch.bincount(toks, minlength=4).double() / n
    expected = torch.softmax(logits[0].double(), -1)
    assert torch.allclose(freq, expected, atol=0.015)
    assert torch.allclose(lps.double(), torch.log_softmax(logits[0].double(), -1)[toks], atol=1e-6)
    assert lps.dtype == torch.float32 and toks.dtype == torch.int64


def test_temperature_and_top_p_semantics() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -3.0]])
    n = 4000
    seeds, pos = torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    # top_p: keep v iff mass ranked before v < top_p
    probs = torch.softmax(logits[0].double() / 0.7, -1)
    toks, lps = sampling.sample(logits.expand(n, -1), seeds, pos, temperature=0.7, top_p=0.8)
    before = torch.cumsum(probs, 0) - probs  # logits already sorted descending
    allowed = set(torch.nonzero(before < 0.8).flatten().tolist())
    assert set(toks.tolist()) <= allowed and len(allowed) < 5
    # logprob is of the unfiltered tempered distribution
    assert torch.allclose(lps.double(), torch.log(probs)[toks], atol=1e-6)
    # top-1 nucleus is greedy
    greedy, _ = sampling.sample(logits.expand(8, -1), seeds[:8], pos[:8], temperature=1.0, top_p=1e-9)
    assert greedy.tolist() == [0] * 8
    # low temperature concentrates
    cold, _ = sampling.sample(logits.expand(n, -1), seeds, pos, temperature=0.05)
    assert (cold == 0).float().mean() > 0.99
    with pytest.raises(ValueError):
        sampling.sample(logits, seeds[:1], pos[:1], temperature=0.0)
    with pytest.raises(ValueError):
        sampling.sample(logits, seeds[:1], pos[:1], top_p=1.5)


def test_sample_is_batch_independent() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    seeds = torch.randint(0, 2**62, (8,))
    pos = torch.arange(8, dtype=torch.int64) * 3
    toks, lps = sampling.sample(logits, seeds, pos, 0.9, 0.95)
    for i in range(8):
        t1, l1 = sampling.sample(logits[i : i + 1], seeds[i : i + 1], pos[i : i + 1], 0.9, 0.95)
        assert int(t1) == int(toks[i]) and float(l1) == float(lps[i])


def _generate(logits: torch.Tensor, seed: int, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    n = logits.shape[0]
    toks, _ = sampling.sample(
        logits, torch.full((n,), seed, dtype=torch.int64), torch.arange(n, dtype=torch.int64), temperature, top_p
    )
    return toks


def test_replay_accepts_honest_and_tolerates_noise() -> None:
    torch.manual_seed(1)
    logits = torch.randn(100, 500) * 2
    toks = _generate(logits, 42, 0.8, 0.9)
    res = sampling.replay_check(logits, toks, 42, sampling.ReplayParams(temperature=0.8, top_p=0.9), 0)
    assert res.ok and res.hard_mismatches == 0 and res.near_ties == 0 and torch.equal(res.tokens, toks)
    assert bool((res.gaps == 0).all()) and bool((res.margins > 0).all())
    noisy = logits + 1e-5 * torch.randn_like(logits)
    assert sampling.replay_check(noisy, toks, 42, sampling.ReplayParams(temperature=0.8, top_p=0.9), 0).ok
    assert res.logprobs is not None
    torch.testing.assert_close(res.logprobs, torch.log_softmax(logits.double() / 0.8, -1).gather(-1, toks[:, None])[:, 0])


def test_replay_rejects_other_seed_or_other_model() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 500) * 2
    toks = _generate(logits, 7)
    wrong_seed = sampling.replay_check(logits, toks, 8)
    assert not wrong_seed.ok and wrong_seed.hard_mismatches > 30 and "differ" in wrong_seed.reason
    cheap = _generate(logits + torch.randn_like(logits), 7)  # a different model, right seed
    res = sampling.replay_check(logits, cheap, 7)
    assert not res.ok and res.hard_mismatches > 0
    shifted = sampling.replay_check(logits, toks, 7, sampling.ReplayParams(), 1)
    assert not shifted.ok


def test_icdf_replay_near_ties_counted_and_bounded() -> None:
    """A claimed token whose CDF interval ends within ε of the uniform is a near tie, further away a hard mismatch."""
    n, vocab = 20, 50
    logits = torch.zeros(n, vocab)  # uniform: token k covers [k/50, (k+1)/50)
    u = sampling.uniforms(torch.full((n,), 3), torch.arange(n))[:, 0]
    toks = _generate(logits, 3)
    assert torch.equal(toks, (u * vocab).floor().long())
    # claim the neighbour on the nearer side: distance to its interval = distance of u to the shared end
    frac = u * vocab - toks
    nearer = torch.where(frac < 0.5, toks - 1, toks + 1).clamp(0, vocab - 1)
    dist = torch.minimum(frac, 1 - frac) / vocab
    order = torch.argsort(dist)
    fake = toks.clone()
    fake[order[:3]] = nearer[order[:3]]
    eps = float(dist[order[2]]) * 1.01
    res = sampling.replay_check(logits, fake, 3, sampling.ReplayParams(eps=eps, max_near_tie_fraction=0.1))
    assert res.near_ties == 3 and res.hard_mismatches == 0 and res.allowed_near_ties == 2 and not res.ok
    assert sampling.replay_check(logits, fake, 3, sampling.ReplayParams(eps=eps, max_near_tie_fraction=0.2)).ok
    tight = sampling.replay_check(logits, fake, 3, sampling.ReplayParams(eps=float(dist[order[0]]) * 0.99))
    assert not tight.ok and tight.hard_mismatches == 3
    torch.testing.assert_close(res.gaps[order[:3]], dist[order[:3]].double())


def test_icdf_weights_are_never_subnormal() -> None:
    """Peaked logits (a spread of hundreds of nats) give no subnormal or zero float32 weight: below
    e^-87 ``exp`` returns subnormals, whose arithmetic made the check 4-8x slower on x86 CPUs. The
    floor moves no CDF edge measurably: sampler and replay still agree on every token."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4096, generator=g) * 60.0  # logits spread over ~±200 nats
    w, _ = sampling._icdf_weights(x.clone(), 1.0)
    assert float(w.min()) >= torch.finfo(torch.float32).tiny
    assert float(w.min()) == pytest.approx(math.exp(sampling.EXP_FLOOR), rel=1e-6)
    seeds = torch.arange(4, dtype=torch.int64) + 11
    for i in range(3):
        tok, _ = sampling.sample(x.clone(), seeds, torch.full((4,), i), 1.0, 1.0)
        for r in range(4):
            rep = sampling.replay_check(x[r : r + 1].clone(), [int(tok[r])], int(seeds[r]), sampling.ReplayParams(temperature=1.0, top_p=1.0, eps=1e-4, max_near_tie_fraction=0.0), i)
            assert rep.ok and int(rep.tokens[0]) == int(tok[r])


@pytest.mark.slow
def test_icdf_single_token_deviation_caught_at_the_stated_rate() -> None:
    """docs/toploc.md §6: a claimed token c' ≠ the rule's token c passes only if u lies within ε of
    c''s interval. For a deviation chosen without looking at u, u is uniform on c's interval, so
    P(pass) = |[lo_c, hi_c) ∩ [lo_c' − ε, hi_c' + ε]| / p_c. Measured over 3 × 512 one-token
    deviations (random token, the policy's runner-up, the id-neighbour) on flat and peaked rows
    at vocabulary 32,768, the caught count matches that prediction."""
    g = torch.Generator().manual_seed(5)
    vocab, n = 32_768, 64
    eps = sampling.DEFAULT_ICDF_EPS
    measured: dict[str, list[float]] = {"random": [0, 0, 0], "runner-up": [0, 0, 0], "neighbour": [0, 0, 0]}  # trials, caught, predicted pass
    for seed in range(8):
        logits = torch.randn(n, vocab, generator=g) * (1.0 if seed % 2 else 6.0)  # flat and peaked rows
        toks = _generate(logits, seed)
        p = torch.softmax(logits.double(), -1)
        cdf = torch.cumsum(p, -1)
        u = sampling.uniforms(torch.full((n,), seed), torch.arange(n))[:, 0]
        top2 = torch.topk(p, 2).indices
        fakes = {
            "random": (toks + torch.randint(1, vocab, (n,), generator=g)) % vocab,
            "runner-up": torch.where(top2[:, 0] == toks, top2[:, 1], top2[:, 0]),
            "neighbour": (toks + 1) % vocab,
        }
        for kind, fake in fakes.items():
            res = sampling.replay_check(logits, fake, seed, sampling.ReplayParams(max_near_tie_fraction=1.0))  # every position deviates: per-position gaps
            for i in (0, 17, 41):  # each position is judged alone: a one-token deviation gives the same verdict
                single = toks.clone()
                single[i] = fake[i]
                assert sampling.replay_check(logits, single, seed).ok == bool(res.gaps[i] <= eps)
            lo_c, hi_c = (cdf.gather(-1, toks[:, None]) - p.gather(-1, toks[:, None]))[:, 0], cdf.gather(-1, toks[:, None])[:, 0]
            lo_f, hi_f = (cdf.gather(-1, fake[:, None]) - p.gather(-1, fake[:, None]))[:, 0] - eps, cdf.gather(-1, fake[:, None])[:, 0] + eps
            overlap = (torch.minimum(hi_c, hi_f) - torch.maximum(lo_c, lo_f)).clamp_min(0) / (hi_c - lo_c)
            assert bool(((u >= lo_c - 1e-12) & (u < hi_c + 1e-12)).all())
            m = measured[kind]
            m[0] += n
            m[1] += int((res.gaps > eps).sum())
            m[2] += float(overlap.sum())
    for kind, (trials, caught, predicted_pass) in measured.items():
        sd = math.sqrt(max(predicted_pass * (1 - predicted_pass / trials), 1.0))
        assert abs((trials - caught) - predicted_pass) <= 4 * sd + 1, (kind, trials, caught, predicted_pass)
    assert measured["random"][1] == measured["random"][0]  # a token chosen without u is caught
    assert measured["runner-up"][1] >= 0.99 * measured["runner-up"][0]


def test_replay_handles_out_of_vocab_and_nucleus() -> None:
    logits = torch.tensor([[5.0, 0.0, -5.0]] * 4)
    res = sampling.replay_check(logits, [0, 0, 7, -1], 1, sampling.ReplayParams(top_p=0.5))
    assert not res.ok and res.hard_mismatches == 2 and math.isinf(float(res.gaps[2]))
    outside = sampling.replay_check(logits, [0, 2, 0, 0], 1, sampling.ReplayParams(top_p=0.5))
    assert not outside.ok and math.isinf(float(outside.gaps[1]))
    with pytest.raises(ValueError):
        sampling.replay_check(logits, [0, 0], 1)
    with pytest.raises(ValueError, match="unknown sampling rule"):
        sampling.replay_check(logits, [0, 0, 0, 0], 1, sampling.ReplayParams(rule="gumbel-v0"))
    with pytest.raises(ValueError, match="unknown sampling rule"):
        sampling.sample(logits, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), rule="nope")


def test_termination_rules() -> None:
    eos = 2
    logits = torch.tensor([0.0, 0.0, math.log(0.3)])  # P(eos) = 0.3 / 2.3 = 0.13
    low = torch.tensor([0.0, 0.0, -10.0])
    assert sampling.termination_check(logits, [5, 6, eos], [eos], max_tokens=8).ok
    res = sampling.termination_check(low, [5, 6, eos], [eos], max_tokens=8)
    assert not res.ok and res.p_eos < 0.1 and "P(EOS)" in res.reason
    assert sampling.termination_check(low, [5] * 8, [eos], max_tokens=8).ok
    assert not sampling.termination_check(low, [5] * 7, [eos], max_tokens=8).ok
    assert not sampling.termination_check(logits, [5] * 9, [eos], max_tokens=8).ok
    assert not sampling.termination_check(logits, [5, eos, eos], [eos], max_tokens=8).ok
    assert not sampling.termination_check(logits, [], [eos], max_tokens=8).ok
    # temperature sharpens: at T = 0.5, P(eos) = 0.09 / 2.09 = 0.043 < 0.1
    assert not sampling.termination_check(logits, [eos], [eos], max_tokens=8, temperature=0.5).ok
    # several EOS ids: their probabilities add
    assert sampling.termination_check(torch.tensor([0.0, -2.0, -2.0]), [1], [1, 2], max_tokens=4).p_eos == pytest.approx(
        2 * math.exp(-2) / (1 + 2 * math.exp(-2))
    )


def test_logprob_check() -> None:
    """Both tolerances are the caller's (the run spec's); the result names the worst position."""
    ref = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    loose = {"max_abs": 0.5, "mean_abs": 0.05}
    ok = sampling.logprob_check([-1.0, -2.01, -0.5], ref, **loose)
    assert ok.ok and ok.reason == "" and ok.position == 1
    assert ok.max_abs_err == pytest.approx(0.01) and ok.mean_abs_err == pytest.approx(0.01 / 3)
    far = sampling.logprob_check([-1.0, -3.0, -0.5], ref, **loose)
    assert not far.ok and far.position == 1 and far.max_abs_err == pytest.approx(1.0) and "max" in far.reason
    biased = sampling.logprob_check([-1.1, -2.1, -0.6], ref, **loose)  # every token 0.1 off: max holds, mean 0.1 > 0.05
    assert not biased.ok and "mean" in biased.reason and "max" not in biased.reason
    # the same inputs against other tolerances: nothing is built in
    assert sampling.logprob_check([-1.1, -2.1, -0.6], ref, max_abs=0.2, mean_abs=0.2).ok
    assert not sampling.logprob_check([-1.0, -2.01, -0.5], ref, max_abs=0.005, mean_abs=0.005).ok
    # a difference exactly at the tolerance passes
    assert sampling.logprob_check([-1.0, -2.25, -0.5], ref, max_abs=0.25, mean_abs=0.25).ok
    nan = sampling.logprob_check([-1.0, float("nan"), -0.5], ref, **loose)
    assert not nan.ok and nan.position == 1 and nan.max_abs_err == math.inf
    assert not sampling.logprob_check([-1.0, -2.0, float("-inf")], ref, **loose).ok
    assert not sampling.logprob_check([-1.0], ref, **loose).ok
    assert not sampling.logprob_check([], torch.tensor([], dtype=torch.float64), **loose).ok
    with pytest.raises(TypeError):
        sampling.logprob_check([-1.0, -2.0, -0.5], ref)  # type: ignore[call-arg]  # no default tolerances


def test_derive_sequence_seed_layout() -> None:
    data = (
        b"intellect-node/sequence-seed/v1\x00"
        + (7).to_bytes(8, "big")
        + (3).to_bytes(8, "big")
        + len(b"12D3KooWpeer").to_bytes(2, "big")
        + b"12D3KooWpeer"
        + len("task-é".encode()).to_bytes(2, "big")
        + "task-é".encode()
        + (5).to_bytes(4, "big")
    )
    expected = int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1
    assert sampling.derive_sequence_seed(7, 3, "12D3KooWpeer", "task-é", 5) == expected
    assert 0 <= expected < 2**63
    with pytest.raises(ValueError):
        sampling.derive_sequence_seed(-1, 0, "p", "t", 0)
    with pytest.raises(ValueError):
        sampling.derive_sequence_seed(0, 0, "p", "t", 2**32)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.text(max_size=40), st.text(max_size=40), st.integers(0, 2**32 - 1)
)
def test_derive_sequence_seed_is_injective_on_fields(run_seed: int, step: int, peer: str, task: str, idx: int) -> None:
    s = sampling.derive_sequence_seed(run_seed, step, peer, task, idx)
    assert 0 <= s < 2**63
    assert s != sampling.derive_sequence_seed(run_seed, step, peer, task, (idx + 1) % 2**32)
    assert s != sampling.derive_sequence_seed(run_seed, step, peer + task[:1], task[1:], idx) or not task


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rule_bits_identical_on_gpu() -> None:
    """Philox words, uniforms, tokens, log-probs and the replay's verdicts are the same on CPU and GPU
    at vocabulary 151,936 (with and without top-p and the EOS gate)."""
    g = torch.Generator().manual_seed(12)
    seeds = torch.randint(-(2**63), 2**63 - 1, (16,), dtype=torch.int64, generator=g)
    pos = torch.randint(0, 2**40, (16,), dtype=torch.int64, generator=g)
    key = (seeds[:, None] & 0xFFFFFFFF, (seeds[:, None] >> 32) & 0xFFFFFFFF)
    ctr = tuple(torch.randint(0, 2**32, (16, 1000), dtype=torch.int64, generator=g) for _ in range(4))
    cpu = sampling.philox4x32(ctr, key)  # type: ignore[arg-type]
    gpu = sampling.philox4x32(tuple(c.cuda() for c in ctr), tuple(k.cuda() for k in key))  # type: ignore[arg-type]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
    assert torch.equal(sampling.uniforms(seeds, pos), sampling.uniforms(seeds.cuda(), pos.cuda()).cpu())
    logits = torch.randn(16, 151_936, generator=g) * 3
    for top_p, floor in ((1.0, 0.0), (0.95, 0.1)):
        t_cpu, l_cpu = sampling.sample(logits, seeds, pos, 0.7, top_p, (1,), floor)
        t_gpu, l_gpu = sampling.sample(logits.cuda(), seeds.cuda(), pos.cuda(), 0.7, top_p, (1,), floor)
        assert torch.equal(t_cpu, t_gpu.cpu()) and torch.allclose(l_cpu, l_gpu.cpu(), atol=1e-5)
        one = torch.full((16,), int(seeds[0]))
        toks, _ = sampling.sample(logits, one, torch.arange(16), 0.7, top_p, (1,), floor)
        rc = sampling.replay_check(logits, toks, int(seeds[0]), sampling.ReplayParams(temperature=0.7, top_p=top_p, eos_ids=(1,), min_eos_prob=floor), 0)
        rg = sampling.replay_check(logits.cuda(), toks.cuda(), int(seeds[0]), sampling.ReplayParams(temperature=0.7, top_p=top_p, eos_ids=(1,), min_eos_prob=floor), 0)
        assert rc.ok and rg.ok and torch.equal(rc.tokens, rg.tokens.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("top_p", "floor"), [(1.0, 0.0), (1.0, 0.1), (0.9, 0.1)])
def test_sampler_never_syncs_with_the_host(top_p: float, floor: float) -> None:
    """The decode loop's sampler stays asynchronous on CUDA: any host synchronisation raises."""
    logits = torch.randn(64, 151_936, device="cuda")
    seeds = torch.arange(64, device="cuda", dtype=torch.int64)
    pos = torch.full((64,), 5, device="cuda", dtype=torch.int64)
    sampling.sample(logits, seeds, pos, 1.0, top_p, (1,), floor)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        toks, lps = sampling.sample(logits, seeds, pos, 1.0, top_p, (1,), floor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert toks.shape == (64,) and bool(torch.isfinite(lps).all())


def test_icdf_row_blocks_do_not_change_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU splits large batches into row blocks (memory); tokens, log-probs and replay are the same."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(9, 300, generator=g)
    seeds, pos = torch.randint(0, 2**62, (9,), generator=g), torch.arange(9, dtype=torch.int64)
    whole = sampling.sample(logits, seeds, pos, 0.9, 0.9, (1,), 0.1)
    rep = sampling.replay_check(logits, whole[0], 3, sampling.ReplayParams(top_p=0.9, eos_ids=(1,), min_eos_prob=0.1))
    monkeypatch.setattr(sampling, "_ICDF_BLOCK_ELEMENTS", 600)  # 2 rows per block
    monkeypatch.setattr(sampling, "_REPLAY_BLOCK_ELEMENTS", 600)
    blocked = sampling.sample(logits, seeds, pos, 0.9, 0.9, (1,), 0.1)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])
    rep2 = sampling.replay_check(logits, whole[0], 3, sampling.ReplayParams(top_p=0.9, eos_ids=(1,), min_eos_prob=0.1))
    assert torch.equal(rep.gaps, rep2.gaps) and torch.equal(rep.tokens, rep2.tokens) and torch.equal(rep.logprobs, rep2.logprobs)
    work = logits.clone()  # the check may use the caller's buffer: same results, the buffer's values are spent
    rep3 = sampling.replay_check(work, whole[0], 3, sampling.ReplayParams(top_p=0.9, eos_ids=(1,), min_eos_prob=0.1), overwrite=True)
    assert torch.equal(rep.gaps, rep3.gaps) and torch.equal(rep.tokens, rep3.tokens) and torch.equal(rep.logprobs, rep3.logprobs)
    assert not torch.equal(work, logits)


def test_icdf_precomputed_uniforms_give_the_same_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode loop may hand ``sample`` the rows' uniforms computed ahead (all positions at once):
    the same tokens and log-probs, also across row blocks; other shapes are refused."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(9, 300, generator=g)
    seeds, pos = torch.randint(0, 2**62, (9,), generator=g), torch.arange(9, dtype=torch.int64) * 5
    ahead = sampling.uniforms(seeds.repeat_interleave(4), torch.arange(0, 40, 10).repeat(9)).view(9, 4, -1)  # positions 0, 10, 20, 30
    pos = torch.full((9,), 20, dtype=torch.int64)
    for top_p, floor in ((1.0, 0.0), (1.0, 0.3), (0.9, 0.1)):
        ref = sampling.sample(logits, seeds, pos, 0.8, top_p, (1,), floor)
        got = sampling.sample(logits, seeds, pos, 0.8, top_p, (1,), floor, u=ahead[:, 2])
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    monkeypatch.setattr(sampling, "_ICDF_BLOCK_ELEMENTS", 600)  # 2 rows per block
    got = sampling.sample(logits, seeds, pos, 0.8, 0.9, (1,), 0.1, u=ahead[:, 2])
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    with pytest.raises(ValueError):
        sampling.sample(logits, seeds, pos, u=ahead[:, 2, :5])
    with pytest.raises(ValueError):
        sampling.sample(logits, seeds, pos, rule="gumbel-v1", u=ahead[:, 2])


def test_chunked_cdf_edges_within_the_stated_bound_and_search_lands_in_them() -> None:
    """Every CDF edge of the chunked sums lies within (CDF_CHUNK − 1) · 2^-24 · total of the exact
    (float64) cumulative sum of the same float32 weights; a search for any target lands in the
    interval that ``interval`` reports for the found id, and that id is the exact rule's token
    wherever the target is farther than the bound from an edge. Vocabularies with and without a
    short last chunk, flat and peaked rows."""
    g = torch.Generator().manual_seed(21)
    bound = (sampling.CDF_CHUNK - 1) * 2.0**-24
    for vocab, scale in ((50, 1.0), (4097, 3.0), (32_768, 1.0), (32_768, 12.0), (151_936, 2.0)):
        w = torch.exp(torch.randn(8, vocab, generator=g) * scale)
        w = w / w.amax(-1, keepdim=True)  # the sampler's weights lie in [0, 1]
        exact = torch.cumsum(w.double(), -1)  # [8, V]
        cdf = sampling._ChunkedCDF(w)
        total = exact[:, -1]
        assert bool(((cdf.total - total).abs() <= bound * total).all())
        ids = torch.randint(0, vocab, (8, 64), generator=g)
        lo, hi = cdf.interval(ids)
        ex_hi = exact.gather(-1, ids)
        assert bool(((hi - ex_hi).abs() <= bound * total[:, None]).all())
        assert bool(((lo - (ex_hi - w.gather(-1, ids).double())).abs() <= bound * total[:, None]).all())
        u = torch.rand(8, 256, generator=g, dtype=torch.float64)
        t = sampling._targets(u, cdf.total)
        found, f_lo, f_hi = cdf.search(t)
        assert bool(((f_lo <= t) & (t < f_hi)).all())
        assert torch.equal(cdf.interval(found)[0], f_lo) and torch.equal(cdf.interval(found)[1], f_hi)
        rule = torch.searchsorted(exact, u * total[:, None], right=True).clamp_max(vocab - 1)  # smallest k with cum[k] > u·total
        far = ((exact.gather(-1, rule) - u * total[:, None]).abs() > 2 * bound * total[:, None]) & (
            (u * total[:, None] - (exact.gather(-1, rule) - w.gather(-1, rule).double())).abs() > 2 * bound * total[:, None])
        assert torch.equal(found[far], rule[far]) and int(far.sum()) > 0.5 * far.numel()


@pytest.mark.parametrize("scale", [0.3, 1.0, 6.0, 40.0])
def test_nucleus_bounds_equal_the_sorted_rule(scale: float) -> None:
    """The check's kept sets (mass histogram + a sort of the boundary bins, no vocabulary sort) are
    the sampler's sorted-prefix sets, at several masses, with many tied weights and the top-token
    exception (a mass below every token keeps just the top one)."""
    g = torch.Generator().manual_seed(22)
    x = torch.randn(16, 4096, generator=g) * scale
    x[:4] = (x[:4] * 4).round() / 4  # rows with many exactly equal weights
    e, _ = sampling._icdf_weights(x, 1.0)
    total = sampling._ChunkedCDF(e).total
    limits = (1e-9, 0.3, 0.9, 0.95, 0.999, 1.0005)
    nucleus = sampling._Nucleus(e, total, limits)
    for i, lim in enumerate(limits):
        ref = sampling._kept_mask(e, total, lim, None, None) if lim < 1 else torch.ones_like(e, dtype=torch.bool)
        got = nucleus.kept_all(i)
        assert torch.equal(got, ref), (lim, int((got != ref).sum()))
        ids = torch.randint(0, 4096, (16, 32), generator=g)
        assert torch.equal(nucleus.kept(ids, i), ref.gather(-1, ids))
    assert bool((nucleus.kept_all(0).sum(-1) >= 1).all())


def _within_bound_workers(fp32: torch.Tensor, h: torch.Tensor, w: torch.Tensor, delta: float, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Honest workers' logits within ``delta`` of ``fp32`` (up to a common shift): a bf16 LM head,
    uniform noise, and the worst case for CDF edges (every id below a split point down, the rest up)."""
    n, vocab = fp32.shape
    split = torch.randint(0, vocab, (n, 1), generator=g)
    sign = torch.where(torch.arange(vocab) < split, -1.0, 1.0)
    return {
        "bf16 head": (h.bfloat16() @ w.bfloat16().T).float(),
        "uniform noise": fp32 + (torch.rand(n, vocab, generator=g) * 2 - 1) * delta + 3.0,
        "worst-case edges": fp32 + 0.999 * delta * sign - 1.0,
    }


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_logit_bound_replay_accepts_workers_within_the_bound_and_rejects_cheats(temperature: float, top_p: float) -> None:
    """Replay rule ``logit-bound-v1`` (docs/toploc.md §6.2): every token of a worker whose logits lie
    within δ of the validator's (a bf16 LM head against float32, δ its measured error × 1.5; noise
    up to δ; the worst case for CDF edges; P(EOS) around the gate's floor) is accepted, where
    ``eps-v1`` at the old bf16 setting (ε = 0.05) rejects; a worker beyond the bound (3δ), a greedy
    worker and one choosing the policy's runner-up are rejected."""
    g = torch.Generator().manual_seed(7)
    n, vocab, hidden, eos, floor = 192, 2048, 64, 1, 0.1
    h, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.6
    w[eos] = 0.0  # EOS's logit set per row below: P(EOS) spread around the floor
    fp32 = h @ w.T
    fp32[:, eos] = torch.logsumexp(torch.cat([fp32[:, :eos], fp32[:, eos + 1 :]], -1), -1) + torch.linspace(-4.5, 0.5, n)
    bf16 = (h.bfloat16() @ w.bfloat16().T).float()
    bf16[:, eos] = fp32[:, eos].bfloat16().float()
    err = bf16 - fp32
    delta = 1.5 * float(((err.amax(-1) - err.amin(-1)) / 2).max())
    assert 0.01 < delta < 1.0
    workers = _within_bound_workers(fp32, h, w, delta, g)
    workers["bf16 head"] = bf16
    seeds, pos = torch.full((n,), 11, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    common = {"temperature": temperature, "top_p": top_p, "eos_ids": (eos,), "min_eos_prob": floor, "max_near_tie_fraction": 1.0}
    eps_rejects = 0
    for name, x in workers.items():
        toks, _ = sampling.sample(x, seeds, pos, temperature, top_p, (eos,), floor)
        res = sampling.replay_check(fp32.clone(), toks, 11, sampling.ReplayParams(**common, replay_rule="logit-bound-v1", logit_bound=delta))
        assert res.ok and res.hard_mismatches == 0, (name, res.reason)
        assert float(res.gaps.max()) <= delta
        eps_rejects += sampling.replay_check(fp32.clone(), toks, 11, sampling.ReplayParams(**common, eps=0.05)).hard_mismatches
    assert eps_rejects > 0  # the old rule at the old bf16 setting rejected honest workers
    p = torch.softmax(fp32.double() / temperature, -1)
    top2 = torch.topk(p, 2).indices
    honest = sampling.sample(fp32, seeds, pos, temperature, top_p, (eos,), floor)[0]
    cheats = {
        "beyond the bound": sampling.sample(fp32 + 3 * delta * torch.where(torch.arange(vocab) < vocab // 2, -1.0, 1.0), seeds, pos,
                                            temperature, top_p, (eos,), floor)[0],
        "greedy": top2[:, 0],
        "runner-up": torch.where(top2[:, 0] == honest, top2[:, 1], top2[:, 0]),
    }
    for name, toks in cheats.items():
        res = sampling.replay_check(fp32.clone(), toks, 11, sampling.ReplayParams(**common, replay_rule="logit-bound-v1", logit_bound=delta))
        assert not res.ok and res.hard_mismatches >= 3 and "logit bound" in res.reason, (name, res.hard_mismatches)


def test_logit_bound_termination_and_unknown_replay_rules() -> None:
    """Under ``logit-bound-v1`` the termination check's slack is the most logits within δ can move
    P(EOS) to the floor; an unknown replay rule or a missing bound is refused."""
    slack = sampling.termination_slack(0.1, 1.0, "logit-bound-v1", logit_bound=0.75)
    assert slack == pytest.approx(0.1 - 1 / (1 + math.exp(math.log(9) + 1.5)), abs=2**-15)  # P(EOS) ≥ σ(logit 0.1 − 1.5) ≈ 0.024
    assert sampling.termination_slack(0.1, 1.0, "eps-v1", eos_prob_slack=0.02) == 0.02
    eos = 2
    for p_eos, ok in ((0.03, True), (0.02, False)):
        logits = torch.tensor([0.0, 0.0, math.log(2 * p_eos / (1 - p_eos))])
        assert sampling.termination_check(logits, [5, eos], [eos], 8, min_eos_prob=0.1, eos_prob_slack=slack).ok is ok
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="unknown replay rule"):
        sampling.replay_check(logits, [0, 1], 1, sampling.ReplayParams(replay_rule="logit-bound-v0"))
    with pytest.raises(ValueError, match="logit bound"):
        sampling.replay_check(logits, [0, 1], 1, sampling.ReplayParams(replay_rule="logit-bound-v1"))


@pytest.mark.parametrize(("temperature", "delta", "top_p"), [(0.002, 1.0, 0.7), (0.01, 4.0, 0.95), (0.01, 4.0, 1.0), (1e-40, 1.0, 0.9)])
def test_logit_bound_replay_at_a_low_temperature_the_run_spec_allows(temperature: float, delta: float, top_p: float) -> None:
    """``2δ / T`` passes 709 at temperatures the run spec accepts (δ = 1, T < 0.0028; δ = 4, T < 0.0113):
    the check's ``math.exp`` of it raised OverflowError on every submission, so a validator retried
    each one forever and judged none; below T = 2.9e-39, ``1 / T`` overflowed float32 and the sampler
    and the check both failed on NaN weights. An honest worker's tokens pass; a fixed token is rejected."""
    from protocol.runspec import SamplingSpec, ToplocSpec

    SamplingSpec(temperature=temperature, top_p=top_p)  # the spec allows it
    ToplocSpec(replay_rule="logit-bound-v1", replay_logit_bound=delta)
    g = torch.Generator().manual_seed(3)
    n, vocab, eos = 32, 300, 7
    x = torch.randn(n, vocab, generator=g) * 4
    seeds, pos = torch.full((n,), 5, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    toks, _ = sampling.sample(x, seeds, pos, temperature, top_p, (eos,), 0.1)
    common = {"temperature": temperature, "top_p": top_p, "eos_ids": (eos,), "min_eos_prob": 0.1, "replay_rule": "logit-bound-v1", "logit_bound": delta}
    assert sampling.replay_check(x.clone(), toks, 5, sampling.ReplayParams(**common)).ok
    assert not sampling.replay_check(x.clone(), [0] * n, 5, sampling.ReplayParams(**common)).ok


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_replay_refuses_non_finite_validator_logits_instead_of_judging(top_p: float, bad: float) -> None:
    """A NaN or +inf in the validator's own logits made every interval NaN: with top-p 1 each claimed
    token became a hard mismatch (a ``sampling`` cheat verdict against an honest worker, a ban when
    reproduced); with top-p < 1 the nucleus indexed out of bounds. The check now raises ValueError
    naming the row: the validator's failure, no verdict."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 200, generator=g) * 3
    seeds, pos = torch.full((6,), 9, dtype=torch.int64), torch.arange(6, dtype=torch.int64)
    toks, _ = sampling.sample(x, seeds, pos, 1.0, top_p)
    x[4, 17] = bad
    for rule in ({}, {"replay_rule": "logit-bound-v1", "logit_bound": 1.0}):
        with pytest.raises(ValueError, match="row 4 are not finite"):
            sampling.replay_check(x.clone(), toks, 9, sampling.ReplayParams(top_p=top_p, **rule))


def test_logit_bound_v2_leaves_out_of_bound_and_near_ties_to_the_submission() -> None:
    """``logit-bound-v2`` judges the same gaps as v1 but fails a completion only for a token no logits
    within any bound pick (gap ∞): out-of-bound tokens (finite gap > δ) are counted for the caller's
    per-submission judgment, near ties are not capped per completion; v1 rejects both."""
    g = torch.Generator().manual_seed(5)
    n, vocab = 24, 64
    x = torch.randn(n, vocab, generator=g) * 2
    seeds, pos = torch.full((n,), 3, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    honest, _ = sampling.sample(x, seeds, pos, 1.0, 1.0)
    top2 = torch.topk(x, 2).indices
    runner = torch.where(top2[:, 0] == honest, top2[:, 1], top2[:, 0])  # a differing, plausible token everywhere
    v1 = sampling.ReplayParams(replay_rule="logit-bound-v1", logit_bound=0.05, max_near_tie_fraction=0.1)
    v2 = sampling.ReplayParams(replay_rule="logit-bound-v2", logit_bound=0.05, max_near_tie_fraction=0.1)
    r1, r2 = (sampling.replay_check(x.clone(), runner, 3, p) for p in (v1, v2))
    assert not r1.ok and r1.hard_mismatches > 0
    assert r2.ok and r2.out_of_bound == r1.hard_mismatches - r1.impossible and r2.impossible == 0
    assert r2.allowed_near_ties == n and r2.gaps.tolist() == r1.gaps.tolist()
    differ, over = r2.gap_counts(v2.gap_edges)
    assert differ == int((runner != r2.tokens).sum()) and over[-1] == r2.out_of_bound and over == sorted(over, reverse=True)
    bad = runner.clone()
    bad[5] = vocab + 3  # outside the vocabulary: impossible under any bound
    r3 = sampling.replay_check(x.clone(), bad, 3, v2)
    assert not r3.ok and r3.impossible == 1 and "no logits within" in r3.reason
