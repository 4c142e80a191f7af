"""Tests of protocol.sampling: Philox KATs, Gumbel-max rule, replay, termination, log-probs, seeds."""

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


def test_gumbel_noise_is_keyed_by_seed_and_position_and_pinned() -> None:
    seeds = torch.tensor([1, 1, 2, -1], dtype=torch.int64)
    positions = torch.tensor([0, 1, 0, 0], dtype=torch.int64)
    g = sampling.gumbel_noise(seeds, positions, 1000)
    assert g.shape == (4, 1000) and g.dtype == torch.float64
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.equal(g, sampling.gumbel_noise(seeds, positions, 1000))
    assert torch.equal(g[:, :10], sampling.gumbel_noise(seeds, positions, 10))  # prefix-stable in V
    # Pinned value: a change to the stream is a protocol change.
    ref = sampling.philox4x32(_t(7, 3, 0, sampling.COUNTER_TAG), _t(5, 0))[0]  # type: ignore[arg-type]
    u = (int(ref) + 0.5) / 2**32
    one = sampling.gumbel_noise(torch.tensor([5]), torch.tensor([3]), 8)[0, 7]
    assert float(one) == -math.log(-math.log(u))


def test_gumbel_noise_is_standard_gumbel() -> None:
    g = sampling.gumbel_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096).flatten()
    assert abs(float(g.mean()) - 0.5772) < 0.01  # Euler–Mascheroni
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.03


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
    res = sampling.replay_check(logits, toks, 42, 0, 0.8, 0.9)
    assert res.ok and res.hard_mismatches == 0 and res.near_ties == 0 and torch.equal(res.tokens, toks)
    assert bool((res.gaps == 0).all()) and bool((res.margins > 0).all())
    noisy = logits + 1e-5 * torch.randn_like(logits)
    assert sampling.replay_check(noisy, toks, 42, 0, 0.8, 0.9).ok


def test_replay_rejects_other_seed_or_other_model() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 500) * 2
    toks = _generate(logits, 7)
    wrong_seed = sampling.replay_check(logits, toks, 8)
    assert not wrong_seed.ok and wrong_seed.hard_mismatches > 30 and "differ" in wrong_seed.reason
    cheap = _generate(logits + torch.randn_like(logits), 7)  # a different model, right seed
    res = sampling.replay_check(logits, cheap, 7)
    assert not res.ok and res.hard_mismatches > 0
    shifted = sampling.replay_check(logits, toks, 7, start_position=1)
    assert not shifted.ok


def test_replay_near_ties_counted_and_bounded() -> None:
    logits = torch.zeros(20, 50)
    toks = _generate(logits, 3)
    res = sampling.replay_check(logits, toks, 3)
    assert res.ok
    # Force near ties: make the claimed token the runner-up where the margin is tiny.
    g = sampling.gumbel_noise(torch.full((20,), 3), torch.arange(20), 50)
    top2 = torch.topk(g, 2, dim=-1)
    fake = toks.clone()
    logits2 = logits.clone()
    for i in range(3):
        gap = float(top2.values[i, 0] - top2.values[i, 1])
        logits2[i, top2.indices[i, 1]] = gap - 0.01  # runner-up now 0.01 below the winner
        fake[i] = top2.indices[i, 1]
    res2 = sampling.replay_check(logits2, fake, 3, eps=0.1, max_near_tie_fraction=0.1)
    assert res2.near_ties == 3 and res2.hard_mismatches == 0 and res2.allowed_near_ties == 2 and not res2.ok
    assert sampling.replay_check(logits2, fake, 3, eps=0.1, max_near_tie_fraction=0.2).ok
    assert not sampling.replay_check(logits2, fake, 3, eps=0.001).ok


def test_replay_handles_out_of_vocab_and_nucleus() -> None:
    logits = torch.tensor([[5.0, 0.0, -5.0]] * 4)
    res = sampling.replay_check(logits, [0, 0, 7, -1], 1, top_p=0.5)
    assert not res.ok and res.hard_mismatches == 2 and math.isinf(float(res.gaps[2]))
    outside = sampling.replay_check(logits, [0, 2, 0, 0], 1, top_p=0.5)
    assert not outside.ok and math.isinf(float(outside.gaps[1]))
    with pytest.raises(ValueError):
        sampling.replay_check(logits, [0, 0], 1)


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
    ref = torch.tensor([-1.0, -2.0, -0.5])
    assert sampling.logprob_check([-1.0, -2.01, -0.5], ref).ok
    assert not sampling.logprob_check([-1.0, -3.0, -0.5], ref).ok
    assert not sampling.logprob_check([-1.1, -2.1, -0.6], ref).ok  # mean 0.1 > 0.05
    assert not sampling.logprob_check([-1.0, float("nan"), -0.5], ref).ok
    assert not sampling.logprob_check([-1.0], ref).ok


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
def test_noise_bits_identical_on_gpu() -> None:
    seeds = torch.randint(-(2**63), 2**63 - 1, (16,), dtype=torch.int64)
    pos = torch.randint(0, 2**40, (16,), dtype=torch.int64)
    key = (seeds[:, None] & 0xFFFFFFFF, (seeds[:, None] >> 32) & 0xFFFFFFFF)
    vocab = torch.arange(151_936, dtype=torch.int64)[None, :]
    ctr = (
        vocab,
        pos[:, None] & 0xFFFFFFFF,
        (pos[:, None] >> 32) & 0xFFFFFFFF,
        torch.zeros_like(pos[:, None]) + sampling.COUNTER_TAG,
    )
    cpu = sampling.philox4x32(ctr, key)
    gpu = sampling.philox4x32(tuple(c.cuda() for c in ctr), tuple(k.cuda() for k in key))  # type: ignore[arg-type]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
    logits = torch.randn(16, 151_936)
    t_cpu, _ = sampling.sample(logits, seeds, pos, 0.7, 0.95)
    t_gpu, _ = sampling.sample(logits.cuda(), seeds.cuda(), pos.cuda(), 0.7, 0.95)
    assert torch.equal(t_cpu, t_gpu.cpu())
