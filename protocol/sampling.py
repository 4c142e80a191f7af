"""Replayable sampling: two versioned counter-based rules, their replay checks, termination and log-prob rules.

TOPLOC (arXiv 2501.16007) proves which hidden states produced a completion but not that its
tokens were *sampled* from them: a worker could generate with a cheap model and then prefill the
policy to make valid proofs. So sampling is made a deterministic function of the policy's logits
and a seed the worker cannot choose, and the validator recomputes every token
(``docs/toploc.md`` §5–§6). The run spec's ``sampling.rule`` names the rule of a run.

Shared by both rules (normative):

* **Seed.** :func:`derive_sequence_seed` hashes (run seed, policy step, peer ID, task ID, sample
  index) into a 63-bit sequence seed.
* **Temperature.** ``z = float64(logits) / temperature``, ``temperature > 0``.
* **Top-p.** Sort ``softmax(z)`` descending (equal probabilities by lower token id) and keep the
  shortest prefix whose cumulative probability reaches ``top_p``: token ``v`` is kept iff the
  total probability of the tokens ranked before it is ``< top_p`` (the top token always is).
  ``top_p = 1.0`` keeps every token.
* **EOS gate.** With EOS ids and a floor ``min_eos_prob`` (the run spec's
  ``toploc.eos_min_prob``), EOS tokens are not kept where ``P(EOS) = Σ_e softmax(z)[e]``
  (unfiltered) is below the floor; so an honest completion can only end where the policy gives
  EOS at least that probability, which is what the termination check demands.
* **Log-prob.** ``logprob = log_softmax(z)[token]`` of the *unfiltered* tempered distribution,
  computed in float64 and returned as float32.

Rule ``icdf-v1`` (:data:`RULE_ICDF`, the default): inverse-CDF draws from a few counter-based
uniforms per position (``docs/toploc.md`` §5.1).

* **Uniforms.** Philox block ``j`` of position ``t`` has counter ``(t mod 2^32, t >> 32, j,
  0x49434446)`` and key ``(seed mod 2^32, seed >> 32)``; uniform ``2j`` is made of its words 0
  and 1, uniform ``2j + 1`` of words 2 and 3, as ``(hi · 2^21 + (lo >> 11)) / 2^53 ∈ [0, 1)``.
  :data:`ICDF_DRAWS` = 16 draws and one fallback uniform: 9 blocks per position.
* **Draws.** ``w_v = exp(z_v − max z)`` over the unfiltered distribution, canonical order =
  token id; draw ``j`` is the smallest id ``k`` with ``Σ_{v ≤ k} w_v > u_j · Σ_v w_v``.
* **Choice.** The first draw whose token is kept (top-p, EOS gate): rejection sampling, so the
  token follows the renormalised kept distribution exactly, and the kept set never moves any
  token's interval.
* **Fallback.** All 16 draws rejected: inverse CDF over the kept tokens with the last uniform;
  nothing kept (the nucleus holds only gated EOS tokens): the most probable non-EOS token.
* Weights may be computed in float32 (as here: relative error ~1e-7) and summed in any order in
  float64; the replay tolerance (an absolute ε on ``u``) absorbs rounding and device
  differences. Cost per position: one exp, one cumulative sum, 16 binary searches.

Rule ``gumbel-v1`` (:data:`RULE_GUMBEL`, still accepted for runs whose spec names it): Gumbel-max
with noise for every vocabulary entry.

* **Noise.** For token id ``v`` at completion position ``t``,
  ``r = Philox4x32-10(counter=(v, t mod 2^32, t >> 32, 0x47554D42), key=(seed mod 2^32, seed >> 32))``
  word 0 (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3"),
  ``u = (r + 0.5) / 2^32`` and ``g = −log(−log u)`` in float64. The integer stream is computed
  with integer ops that never overflow (int64 tensors; on the CPU numpy uint64, whose
  32×32-bit products are exact), so it is bit-identical on every device.
* **Choice.** ``token = argmax over kept v of (z_v + g_v)`` (lowest id on an exact tie).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from protocol.identity import PeerId

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RULE",
    "RULES",
    "RULE_GUMBEL",
    "RULE_ICDF",
    "LogprobResult",
    "ReplayResult",
    "TerminationResult",
    "derive_sequence_seed",
    "gumbel_noise",
    "logprob_check",
    "philox4x32",
    "replay_check",
    "sample",
    "termination_check",
    "uniforms",
]

SEED_DOMAIN = b"intellect-node/sequence-seed/v1\x00"
"""Domain-separation prefix of the sequence-seed hash input (32 bytes)."""
RULE_ICDF = "icdf-v1"
"""Inverse-CDF sampling from one counter-based uniform per position (the default rule)."""
RULE_GUMBEL = "gumbel-v1"
"""Gumbel-max with Philox noise for every vocabulary entry (the first rule)."""
RULES = (RULE_ICDF, RULE_GUMBEL)
"""Every rule a run spec may name."""
DEFAULT_RULE = RULE_ICDF
COUNTER_TAG = 0x47554D42
"""Fourth Philox counter word of the ``gumbel-v1`` noise ("GUMB"), reserving other values for other streams."""
ICDF_COUNTER_TAG = 0x49434446
"""Fourth Philox counter word of the ``icdf-v1`` uniforms ("ICDF")."""
ICDF_DRAWS = 16
"""``icdf-v1`` draws per position before the fallback (inverse CDF over the kept set)."""
DEFAULT_REPLAY_EPS = 0.1
"""``gumbel-v1`` replay tolerance ε, in units of the perturbed score ``z + g`` (nats at temperature 1)."""
DEFAULT_ICDF_EPS = 1e-4
"""``icdf-v1`` replay tolerance ε: the claimed token passes if ``u`` lies within this distance of
its interval of the validator's cumulative distribution (probability units)."""
DEFAULT_MAX_NEAR_TIE_FRACTION = 0.1
"""Near-tie mismatches tolerated per completion: at most ``ceil(fraction · T)`` of T tokens."""
DEFAULT_NUCLEUS_SLACK = 1e-3
"""Probability slack when deciding whether a claimed token lies inside the validator's nucleus."""
DEFAULT_MIN_EOS_PROB = 0.1
"""A completion may stop with EOS only where the recomputed P(EOS) is at least this."""
DEFAULT_EOS_PROB_SLACK = 0.01
"""Numeric slack around the EOS floor: worker and validator may see P(EOS) differ by this much."""
_ROW_BLOCK = 64  # rows of [T, V] scored at once in replay (bounds memory for large vocabularies)
_ICDF_BLOCK_ELEMENTS = 1 << 20
"""icdf-v1 on the CPU works on row blocks of at most this many float64 entries (8 MiB): larger
temporaries come from fresh mmap'd pages, and their page faults cost more than the arithmetic
(measured 2.1 vs 0.67 ms per row at vocabulary 151,936)."""

_M32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


# --------------------------------------------------------------------------------------------
# Seed derivation
# --------------------------------------------------------------------------------------------


def derive_sequence_seed(run_seed: int, step: int, peer_id: PeerId, task_id: str, sample_index: int) -> int:
    """The sequence seed of one completion; the worker cannot choose it.

    Byte layout hashed with SHA-256 (all integers big-endian)::

        b"intellect-node/sequence-seed/v1\\x00"     32 bytes
        u64(run_seed) || u64(step)                  16 bytes
        u16(len(peer)) || peer                      peer = peer_id.encode("utf-8")
        u16(len(task)) || task                      task = task_id.encode("utf-8")
        u32(sample_index)

    The seed is the first 8 digest bytes as a big-endian integer, shifted right by one bit, so
    it lies in ``[0, 2^63)`` and fits an int64 tensor.

    Args:
        run_seed: the run spec's seed, ``0 ≤ run_seed < 2^64``.
        step: policy step the completion is generated with, ``0 ≤ step < 2^64``.
        peer_id: the worker's libp2p peer ID string (``12D3KooW…``), ≤ 65535 UTF-8 bytes.
        task_id: the task's ID, ≤ 65535 UTF-8 bytes.
        sample_index: index of the completion within its group, ``0 ≤ sample_index < 2^32``.

    Returns:
        The 63-bit sequence seed.

    Raises:
        ValueError: an argument out of range.
    """
    if not (0 <= run_seed < 1 << 64 and 0 <= step < 1 << 64 and 0 <= sample_index < 1 << 32):
        raise ValueError("run_seed and step must be in [0, 2^64), sample_index in [0, 2^32)")
    peer, task = peer_id.encode("utf-8"), task_id.encode("utf-8")
    if len(peer) > 0xFFFF or len(task) > 0xFFFF:
        raise ValueError("peer_id and task_id must be at most 65535 UTF-8 bytes")
    data = b"".join(
        [
            SEED_DOMAIN,
            run_seed.to_bytes(8, "big"),
            step.to_bytes(8, "big"),
            len(peer).to_bytes(2, "big"),
            peer,
            len(task).to_bytes(2, "big"),
            task,
            sample_index.to_bytes(4, "big"),
        ]
    )
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1


# --------------------------------------------------------------------------------------------
# Counter-based generator
# --------------------------------------------------------------------------------------------


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a · b`` for a 32-bit constant ``a`` and int64 ``b`` in
    ``[0, 2^32)``, splitting ``b`` into 16-bit halves so no intermediate exceeds 2^49."""
    p_lo = a * (b & 0xFFFF)  # < 2^48
    p_hi = a * (b >> 16)  # < 2^48
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    hi = (p_hi + (p_lo >> 16)) >> 16
    return hi, lo


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
    rounds: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 (Random123) on int64 tensors holding 32-bit words.

    Args:
        counter: four broadcastable int64 tensors with values in ``[0, 2^32)``.
        key: two broadcastable int64 tensors with values in ``[0, 2^32)``.
        rounds: 10 for Philox4x32-10.

    Returns:
        Four int64 tensors in ``[0, 2^32)`` (the broadcast shape), identical on every device.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W0) & _M32
            k1 = (k1 + _PHILOX_W1) & _M32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise for each (sequence, position) and every token id.

    Args:
        seeds: ``[B]`` int64 sequence seeds (all 64 bits are used, two's complement).
        positions: ``[B]`` int64 completion positions, ``≥ 0`` (0 = first generated token).
        vocab_size: V.

    Returns:
        ``[B, V]`` float64 ``−log(−log u)`` on the device of ``seeds``.
    """
    device = seeds.device
    seeds = seeds.to(torch.int64).reshape(-1, 1)  # [B, 1]
    positions = positions.to(device=device, dtype=torch.int64).reshape(-1, 1)  # [B, 1]
    if device.type == "cpu":
        r = _philox_word0_numpy(seeds, positions, vocab_size)  # [B, V] in [0, 2^32)
    else:
        vocab = torch.arange(vocab_size, dtype=torch.int64, device=device).reshape(1, -1)  # [1, V]
        zero = torch.zeros_like(positions)
        key = (seeds & _M32, (seeds >> 32) & _M32)
        counter = (vocab, positions & _M32, (positions >> 32) & _M32, zero + COUNTER_TAG)
        r = philox4x32(counter, key)[0]  # [B, V] in [0, 2^32)
    u = (r.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)  # (0, 1), exact
    return -torch.log(-torch.log(u))


def _philox_word0_numpy(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Word 0 of the noise stream's Philox4x32-10 on the CPU, with numpy ``uint64`` words.

    Same integers as :func:`philox4x32` on the counters of :func:`gumbel_noise`, about 3× faster:
    a product of two 32-bit words is below 2^64, so one exact ``uint64`` multiply replaces the
    16-bit split that int64 tensors need. The last round computes only word 0.

    Args:
        seeds: ``[B, 1]`` int64 sequence seeds (two's complement of the u64 seed).
        positions: ``[B, 1]`` int64 completion positions, ``≥ 0``.
        vocab_size: V.

    Returns:
        ``[B, V]`` int64 tensor with values in ``[0, 2^32)``.
    """
    m32, s32 = np.uint64(_M32), np.uint64(32)
    mul0, mul1 = np.uint64(_PHILOX_M0), np.uint64(_PHILOX_M1)
    s = seeds.numpy().astype(np.uint64)  # [B, 1], two's complement → u64 bits
    p = positions.numpy().astype(np.uint64)  # [B, 1]
    k0, k1 = s & m32, s >> s32  # [B, 1] each
    c0 = np.arange(vocab_size, dtype=np.uint64).reshape(1, -1)  # [1, V]
    c1, c2, c3 = p & m32, p >> s32, np.full_like(p, COUNTER_TAG)  # [B, 1] each; broadcasting keeps early rounds cheap
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(_PHILOX_W0)) & m32
            k1 = (k1 + np.uint64(_PHILOX_W1)) & m32
        prod1 = c2 * mul1  # exact, < 2^64
        if r == 9:
            c0 = (prod1 >> s32) ^ c1 ^ k0
            break
        prod0 = c0 * mul0
        c0, c1, c2, c3 = (prod1 >> s32) ^ c1 ^ k0, prod1 & m32, (prod0 >> s32) ^ c3 ^ k1, prod0 & m32
    shape = (s.shape[0], vocab_size)
    out = c0 if c0.shape == shape and c0.flags.writeable else np.broadcast_to(c0, shape).copy()
    return torch.from_numpy(out.view(np.int64))


def _philox_numpy(c: list[np.ndarray], k: list[np.ndarray]) -> list[np.ndarray]:
    """Philox4x32-10 on numpy ``uint64`` arrays holding 32-bit words (exact 32×32-bit products)."""
    m32, s32 = np.uint64(_M32), np.uint64(32)
    c0, c1, c2, c3 = c
    k0, k1 = k
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(_PHILOX_W0)) & m32
            k1 = (k1 + np.uint64(_PHILOX_W1)) & m32
        prod0, prod1 = c0 * np.uint64(_PHILOX_M0), c2 * np.uint64(_PHILOX_M1)
        c0, c1, c2, c3 = (prod1 >> s32) ^ c1 ^ k0, prod1 & m32, (prod0 >> s32) ^ c3 ^ k1, prod0 & m32
    return [c0, c1, c2, c3]


def _uniform_words(seeds: torch.Tensor, positions: torch.Tensor, blocks: int, *, use_numpy: bool) -> list[torch.Tensor]:
    """The four words of ``icdf-v1`` Philox blocks ``0 … blocks−1`` for ``[B]`` seeds and positions:
    ``[B, blocks]`` int64 in ``[0, 2^32)`` each, on the device of ``seeds``; numpy ``uint64`` on the
    CPU, int64 tensor ops (:func:`philox4x32`) elsewhere, the same integers (tested)."""
    device = seeds.device
    seeds = seeds.to(torch.int64).reshape(-1, 1)  # [B, 1]
    positions = positions.to(device=device, dtype=torch.int64).reshape(-1, 1)  # [B, 1]
    if use_numpy:
        m32, s32 = np.uint64(_M32), np.uint64(32)
        sd = seeds.cpu().numpy().astype(np.uint64)  # two's complement → u64 bits
        ps = positions.cpu().numpy().astype(np.uint64)
        j = np.arange(blocks, dtype=np.uint64).reshape(1, -1)
        c = [np.broadcast_to(x, (sd.shape[0], blocks)).copy() for x in (ps & m32, ps >> s32, j, np.full_like(ps, ICDF_COUNTER_TAG))]
        words = _philox_numpy(c, [sd & m32, sd >> s32])
        return [torch.from_numpy(np.ascontiguousarray(w).view(np.int64)).to(device) for w in words]
    jt = torch.arange(blocks, dtype=torch.int64, device=device).reshape(1, -1)
    zero = torch.zeros_like(jt)
    key = (seeds & _M32, (seeds >> 32) & _M32)
    lo, hi = (positions & _M32) + zero, ((positions >> 32) & _M32) + zero  # [B, blocks]
    return list(philox4x32((lo, hi, jt + torch.zeros_like(lo), torch.zeros_like(lo) + ICDF_COUNTER_TAG), key))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, count: int = ICDF_DRAWS + 1) -> torch.Tensor:
    """The ``icdf-v1`` uniforms of each (sequence, position): ``count`` of them from ``ceil(count / 2)``
    Philox blocks, not one per vocabulary entry.

    Uniform ``2j`` comes from words 0 and 1, uniform ``2j + 1`` from words 2 and 3 of
    ``Philox4x32-10(counter=(t mod 2^32, t >> 32, j, 0x49434446), key=(seed mod 2^32, seed >> 32))``,
    as ``(hi · 2^21 + (lo >> 11)) / 2^53`` for words ``(hi, lo)``.

    Args:
        seeds: ``[B]`` int64 sequence seeds (all 64 bits are used, two's complement).
        positions: ``[B]`` int64 completion positions, ``≥ 0``.
        count: uniforms per row (default: the rule's draws plus its fallback uniform).

    Returns:
        ``[B, count]`` float64 in ``[0, 1)`` on the device of ``seeds``, bit-identical on every
        device (no host synchronisation on CUDA).
    """
    return _uniforms_from(_uniform_words(seeds, positions, -(-count // 2), use_numpy=seeds.device.type == "cpu"), count)


def _uniforms_from(words: list[torch.Tensor], count: int) -> torch.Tensor:
    w0, w1, w2, w3 = words  # [B, blocks] each
    a = (w0 << 21) | (w1 >> 11)  # < 2^53: exact in float64
    b = (w2 << 21) | (w3 >> 11)
    both = torch.stack([a, b], dim=-1).reshape(a.shape[0], -1)[:, :count]  # [B, count]: u_2j, u_2j+1, …
    return both.to(torch.float64) * (1.0 / 9007199254740992.0)


@functools.lru_cache(maxsize=64)
def _ids_on(ids: tuple[int, ...], device: str) -> torch.Tensor:
    """Token ids as an int64 tensor on ``device``, made once (a host-to-device copy per decode step
    would synchronise a CUDA stream)."""
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _check_params(temperature: float, top_p: float) -> None:
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _nucleus_exclusive_mass(z: torch.Tensor) -> torch.Tensor:
    """``z [B, V]`` float64 → ``[B, V]`` probability mass of the tokens ranked before each token
    (descending probability, equal probabilities by lower id)."""
    return _exclusive_from_probs(torch.softmax(z, dim=-1))


def _exclusive_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` float64 probabilities → the same as :func:`_nucleus_exclusive_mass` (one sort per row)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    exclusive = torch.cumsum(sorted_p, dim=-1) - sorted_p
    return torch.empty_like(exclusive).scatter_(-1, order, exclusive)


def _scores(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: float,
    top_p: float,
    eos_ids: Sequence[int] = (),
    eos_floor: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tempered logits ``z``, unmasked perturbed scores ``z + g``, the same with −inf outside the
    nucleus (and on EOS where P(EOS) < ``eos_floor``, a float or ``[B]`` tensor), and the
    exclusive nucleus mass (zeros when ``top_p == 1``), all ``[B, V]`` float64."""
    z = logits.to(torch.float64) / temperature  # [B, V]
    raw = z + gumbel_noise(seeds, positions, z.shape[-1])  # [B, V]
    if top_p < 1.0:
        exclusive = _nucleus_exclusive_mass(z)
        scores = raw.masked_fill(exclusive >= top_p, -math.inf)
    else:
        exclusive, scores = torch.zeros_like(z), raw
    eos = [e for e in eos_ids if 0 <= e < z.shape[-1]]
    if eos:
        idx = _ids_on(tuple(eos), str(z.device))
        p_eos = torch.softmax(z, dim=-1)[:, idx].sum(-1)  # [B]
        gated = p_eos < (eos_floor.to(z.device) if isinstance(eos_floor, torch.Tensor) else float(eos_floor))  # [B]
        scores = scores.clone() if scores is raw else scores
        scores[:, idx] = torch.where(gated[:, None], -math.inf, scores[:, idx])  # no host sync
    return z, raw, scores, exclusive


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown sampling rule {rule!r}; known: {', '.join(RULES)}")


def _icdf_search(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Smallest id ``k`` with ``cum[k] > u · cum[-1]`` for each uniform.

    Args:
        cum: ``[B, V]`` float64 cumulative weights (non-decreasing).
        u: ``[B, K]`` float64 uniforms in ``[0, 1)``.

    Returns:
        ``[B, K]`` int64 token ids; a row whose weights are all 0 yields V − 1.
    """
    last = cum[:, -1:]  # [B, 1]
    target = torch.minimum(u * last, torch.nextafter(last, torch.zeros_like(last)))  # < last: a weighted token exists
    return torch.searchsorted(cum, target, right=True).clamp_max(cum.shape[-1] - 1)


def _kept_mask(e: torch.Tensor, total: torch.Tensor, top_p: float, eos_idx: torch.Tensor | None, gated: torch.Tensor | None) -> torch.Tensor:
    """``[B, V]`` bool kept set of the shared rules: nucleus (``exclusive mass < top_p``) minus gated EOS."""
    keep = _exclusive_from_probs(e / total[:, None]) < top_p if top_p < 1.0 else torch.ones_like(e, dtype=torch.bool)
    if eos_idx is not None and gated is not None:
        keep[:, eos_idx] &= ~gated[:, None]
    return keep


def _icdf_fallback(z: torch.Tensor, e: torch.Tensor, keep: torch.Tensor, u: torch.Tensor, eos_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fallback choice (inverse CDF over the kept set with uniform ``u [B]``; the most probable
    non-EOS token if nothing is kept) and the kept set's cumulative weights ``[B, V]``."""
    cum = torch.cumsum(e.masked_fill(~keep, 0.0), dim=-1, dtype=torch.float64)
    tok = _icdf_search(cum, u[:, None])[:, 0]
    if eos_idx is not None:
        best = z.index_fill(-1, eos_idx, -math.inf).argmax(dim=-1)
        tok = torch.where(cum[:, -1] > 0, tok, best)
    return tok, cum


def _icdf_weights(x: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``icdf-v1`` weights ``w = exp((x − max x) / T)`` in float32 (relative error ~1e-7, far
    inside the replay tolerance) and ``max x / T`` in float64, from ``[B, V]`` float32 logits."""
    mx = x.amax(dim=-1, keepdim=True)  # [B, 1]
    e = torch.sub(x, mx)
    if temperature != 1.0:
        e.mul_(1.0 / temperature)
    return e.exp_(), mx.to(torch.float64) / temperature


def _icdf_rows_per_block(vocab: int) -> int:
    return max(1, min(64, _ICDF_BLOCK_ELEMENTS // max(1, vocab)))


def _icdf_sample(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float, top_p: float,
    eos_ids: Sequence[int], min_eos_prob: float, u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule ``icdf-v1`` for ``[B, V]`` logits; every op stays on the logits' device (no host sync).
    On the CPU, large batches go in row blocks (:data:`_ICDF_BLOCK_ELEMENTS`)."""
    block = _icdf_rows_per_block(logits.shape[-1])
    if logits.device.type == "cpu" and logits.shape[0] > block:
        parts = [_icdf_sample_rows(logits[i : i + block], seeds[i : i + block], positions[i : i + block], temperature, top_p,
                                   eos_ids, min_eos_prob, None if u is None else u[i : i + block]) for i in range(0, logits.shape[0], block)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return _icdf_sample_rows(logits, seeds, positions, temperature, top_p, eos_ids, min_eos_prob, u)


def _icdf_sample_rows(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: float, top_p: float,
    eos_ids: Sequence[int], min_eos_prob: float, u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()  # [B, V] (no copy for float32 logits)
    vocab = x.shape[-1]
    e, m = _icdf_weights(x, temperature)  # [B, V] float32, [B, 1] float64
    cum = torch.cumsum(e, dim=-1, dtype=torch.float64)  # [B, V]
    total = cum[:, -1]  # [B]
    if u is None:
        u = uniforms(seeds, positions)  # [B, K + 1]
    draws = _icdf_search(cum, u[:, :ICDF_DRAWS])  # [B, K]
    eos = [v for v in eos_ids if 0 <= v < vocab]
    eos_idx = _ids_on(tuple(eos), str(x.device)) if eos else None
    gated = e[:, eos_idx].sum(dim=-1) / total < min_eos_prob if eos_idx is not None and min_eos_prob > 0.0 else None
    if top_p >= 1.0 and gated is None:
        tokens = draws[:, 0]
    else:
        keep = None
        if top_p >= 1.0 and eos_idx is not None and gated is not None:  # EOS gate only: no [B, V] mask needed
            kept = ~(torch.isin(draws, eos_idx) & gated[:, None])
        else:
            keep = _kept_mask(e, total, top_p, eos_idx, gated)
            kept = keep.gather(-1, draws)  # [B, K]
        first = kept.to(torch.int8).argmax(dim=-1, keepdim=True)  # first kept draw (0 if none)
        tokens = draws.gather(-1, first)[:, 0]
        any_kept = kept.any(dim=-1)
        # the fallback is rare: on the CPU (where reading a flag costs nothing) it is computed only when needed;
        # on other devices always, so the decode loop never waits for the device
        if x.device.type != "cpu" or not bool(any_kept.all()):
            if keep is None:
                keep = _kept_mask(e, total, top_p, eos_idx, gated)
            fallback, _ = _icdf_fallback(x, e, keep, u[:, ICDF_DRAWS], eos_idx)
            tokens = torch.where(any_kept, tokens, fallback)
    logprobs = x.gather(-1, tokens[:, None])[:, 0].to(torch.float64) / temperature - m[:, 0] - torch.log(total)
    return tokens, logprobs.to(torch.float32)


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    min_eos_prob: float = 0.0,
    rule: str = DEFAULT_RULE,
    *,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by the named rule (module docstring; ``docs/toploc.md`` §5).

    Runs on the logits' device; neither rule synchronises with the host (CUDA decode loops stay
    asynchronous).

    Args:
        logits: ``[B, V]`` float32 (any float dtype) next-token logits.
        seeds: ``[B]`` int64 sequence seeds (:func:`derive_sequence_seed`).
        positions: ``[B]`` int64 completion positions of the tokens being sampled (0-based).
        temperature: > 0.
        top_p: in ``(0, 1]``; 1.0 disables the nucleus filter.
        eos_ids: token ids that end a completion (for the EOS gate).
        min_eos_prob: EOS may be drawn only where P(EOS) ≥ this (0 disables the gate).
        rule: :data:`RULE_ICDF` (default) or :data:`RULE_GUMBEL`, the run spec's ``sampling.rule``.
        u: ``icdf-v1`` only: ``[B, ICDF_DRAWS + 1]`` float64, the rows' :func:`uniforms` of
            ``(seeds, positions)`` when the caller computed them ahead (a decode loop does every
            position of a batch in one call); default: computed here. Other values are another rule.

    Returns:
        ``(tokens, logprobs)``: ``[B]`` int64 token ids and ``[B]`` float32
        ``log_softmax(logits / temperature)[token]`` (unfiltered distribution).

    Raises:
        ValueError: bad temperature/top_p, unknown rule or mismatched shapes.
    """
    _check_params(temperature, top_p)
    _check_rule(rule)
    if logits.dim() != 2 or seeds.shape != (logits.shape[0],) or positions.shape != (logits.shape[0],):
        raise ValueError("need logits [B, V], seeds [B] and positions [B]")
    if u is not None and (rule != RULE_ICDF or u.shape != (logits.shape[0], ICDF_DRAWS + 1)):
        raise ValueError(f"precomputed uniforms are for {RULE_ICDF} only, shape [B, {ICDF_DRAWS + 1}]")
    seeds, positions = seeds.to(logits.device), positions.to(logits.device)
    if rule == RULE_ICDF:
        return _icdf_sample(logits, seeds, positions, temperature, top_p, eos_ids, min_eos_prob, u)
    z, _, scores, _ = _scores(logits, seeds, positions, temperature, top_p, eos_ids, min_eos_prob)
    tokens = torch.argmax(scores, dim=-1)  # [B]
    logprobs = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None])[:, 0]  # [B]
    return tokens, logprobs.to(torch.float32)


# --------------------------------------------------------------------------------------------
# Validator checks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """Outcome of :func:`replay_check` over one completion of T tokens.

    Attributes:
        tokens: ``[T]`` int64 tokens the validator's logits select.
        margins: ``[T]`` float64 closeness to a tie of the validator's own choice: ``gumbel-v1``,
            the gap between the top two perturbed scores (+inf if one candidate); ``icdf-v1``,
            the distance of ``u`` to the nearer end of the chosen token's CDF interval.
        gaps: ``[T]`` float64 distance of the claimed token from being chosen: ``gumbel-v1``,
            ``score(recomputed) − score(claimed)``; ``icdf-v1``, the distance of ``u`` to the
            claimed token's CDF interval (probability units). 0 where they agree, +inf where the
            claimed token is not kept (outside the nucleus beyond the slack, gated EOS, outside
            the vocabulary).
        hard_mismatches: positions whose claimed token differs with a gap > ε.
        near_ties: positions whose claimed token differs with a gap ≤ ε.
        allowed_near_ties: ``ceil(max_near_tie_fraction · T)``.
        ok: no hard mismatch and ``near_ties ≤ allowed_near_ties``.
        reason: why it failed, ``""`` when ok.
        logprobs: ``[T]`` float64 ``log_softmax(logits / temperature)[claimed]`` from the
            validator's logits (NaN for ids outside the vocabulary), for :func:`logprob_check`.
    """

    tokens: torch.Tensor
    margins: torch.Tensor
    gaps: torch.Tensor
    hard_mismatches: int
    near_ties: int
    allowed_near_ties: int
    ok: bool
    reason: str = ""
    logprobs: torch.Tensor | None = None


def _gumbel_replay(
    logits: torch.Tensor, safe: torch.Tensor, in_vocab: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
    temperature: float, top_p: float, nucleus_slack: float, eos_list: list[int], floor: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gumbel-v1`` replay rows: (recomputed, margins, gaps vs the recomputed score, log-probs), each ``[T]``."""
    n_tok, vocab = logits.shape
    rec, margins, gaps, lps = [], [], [], []
    for lo in range(0, n_tok, _ROW_BLOCK):
        hi = min(n_tok, lo + _ROW_BLOCK)
        z, raw, scores, exclusive = _scores(logits[lo:hi], seeds[lo:hi], positions[lo:hi], temperature, top_p, eos_list, floor[lo:hi])
        top2 = torch.topk(scores, k=min(2, vocab), dim=-1).values  # [b, 2]
        best = top2[:, 0]
        margins.append(top2[:, 0] - top2[:, 1] if vocab > 1 else torch.full_like(best, math.inf))
        rec.append(torch.argmax(scores, dim=-1))
        claimed_score = raw.gather(-1, safe[lo:hi, None])[:, 0]
        inside = exclusive.gather(-1, safe[lo:hi, None])[:, 0] < top_p + nucleus_slack
        gaps.append(torch.where(inside & in_vocab[lo:hi], best - claimed_score, torch.full_like(best, math.inf)))
        lps.append(torch.log_softmax(z, dim=-1).gather(-1, safe[lo:hi, None])[:, 0])
    return torch.cat(rec), torch.cat(margins), torch.cat(gaps), torch.cat(lps)


def _interval_gap(u: torch.Tensor, lo: torch.Tensor, mass: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Distance of ``u`` from ``[lo / total, (lo + mass) / total]``; +inf where ``mass`` is 0."""
    total = torch.where(total > 0, total, torch.ones_like(total))
    below, above = lo / total - u, u - (lo + mass) / total
    gap = torch.clamp_min(torch.maximum(below, above), 0.0)
    return torch.where(mass > 0, gap, torch.full_like(gap, math.inf))


def _icdf_replay(
    logits: torch.Tensor, safe: torch.Tensor, in_vocab: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
    temperature: float, top_p: float, nucleus_slack: float, eos_list: list[int], floors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``icdf-v1`` replay rows: (recomputed, margins, gaps, log-probs), each ``[T]``.

    The validator's own choice uses the exact rule. The claimed token ``c`` is judged by draw:
    draw ``j`` can explain it if ``c`` is possibly kept (nucleus within ``nucleus_slack``, EOS
    gate at the loose floor) and every earlier draw ``i`` was possibly rejected by the worker
    (its token not surely kept, or ``u_i`` within ε of its interval's ends, so noise could have
    picked a neighbour); the gap is the smallest distance of such a ``u_j`` to ``c``'s interval
    of the full (unfiltered) CDF. The kept set never shifts the intervals, so nucleus or gate
    noise only matters where the drawn token itself sits on the nucleus boundary or is EOS.
    Cost: one exp and one cumulative sum per row, K binary searches, one Philox block per two
    draws; the kept-set CDF of the fallback only in blocks that reach it.

    Args:
        floors: ``[T]`` float64 EOS floors (exact, strict = floor + slack, loose = floor − slack);
            0 where the claimed token is EOS (no gate).
        eps: the near-tie tolerance (probability units).
    """
    n_tok, vocab = logits.shape
    floor_exact, floor_strict, floor_loose = floors
    eos_idx = torch.tensor(eos_list, dtype=torch.int64, device=logits.device) if eos_list else None
    k = ICDF_DRAWS
    rec, margins, gaps, lps = [], [], [], []
    block = _icdf_rows_per_block(vocab)
    for lo in range(0, n_tok, block):
        hi = min(n_tok, lo + block)
        c = safe[lo:hi, None]  # [b, 1]
        z = logits[lo:hi].float()  # [b, V]
        e, m = _icdf_weights(z, temperature)  # [b, V] float32, [b, 1] float64
        cum = torch.cumsum(e, dim=-1, dtype=torch.float64)
        total = cum[:, -1]  # [b]
        lps.append(z.gather(-1, c)[:, 0].to(torch.float64) / temperature - m[:, 0] - torch.log(total))
        u = uniforms(seeds[lo:hi], positions[lo:hi])  # [b, K + 1]
        draws = _icdf_search(cum, u[:, :k])  # [b, K]
        d_hi = cum.gather(-1, draws) / total[:, None]
        d_lo = d_hi - e.gather(-1, draws) / total[:, None]
        d_margin = torch.minimum(u[:, :k] - d_lo, d_hi - u[:, :k])  # [b, K] distance to the interval's ends
        # kept sets: exact, surely kept (strict nucleus, gate at floor + slack), possibly kept (loose, floor − slack)
        excl = _exclusive_from_probs(e / total[:, None]) if top_p < 1.0 else None

        def kept(ids: torch.Tensor, nucleus_limit: float, floor: torch.Tensor, excl: torch.Tensor | None = excl) -> torch.Tensor:
            out = torch.ones_like(ids, dtype=torch.bool)
            if excl is not None:
                ex = excl.gather(-1, ids)
                out = (ex < nucleus_limit) | (ex <= 0.0)
            if eos_idx is not None:
                p_eos = e[:, eos_idx].sum(dim=-1) / total  # noqa: B023 - kept() runs only within this iteration
                out = out & ~(torch.isin(ids, eos_idx) & (p_eos < floor)[:, None])
            return out

        fe, fs, fl = floor_exact[lo:hi], floor_strict[lo:hi], floor_loose[lo:hi]
        kx = kept(draws, top_p, fe)  # [b, K]
        first = kx.to(torch.int8).argmax(dim=-1, keepdim=True)
        r = draws.gather(-1, first)[:, 0]
        margin = d_margin.gather(-1, first)[:, 0]
        # the claimed token, draw by draw
        c_hi = cum.gather(-1, c)[:, 0] / total
        c_lo = c_hi - e.gather(-1, c)[:, 0] / total
        dist = torch.clamp_min(torch.maximum(c_lo[:, None] - u[:, :k], u[:, :k] - c_hi[:, None]), 0.0)  # [b, K]
        # a surely kept draw can only have been rejected by a noisy worker if a possibly unkept
        # token lies within ε of its uniform (the worker's CDF put u there instead)
        near_unkept = torch.zeros_like(d_margin, dtype=torch.bool)  # [b, K]
        if excl is not None:
            unsure = ~kept(torch.arange(vocab, device=logits.device).expand(hi - lo, -1), top_p - nucleus_slack, fs)  # [b, V]
            count = torch.cumsum(unsure.to(torch.int32), dim=-1)
            a = _icdf_search(cum, (u[:, :k] - eps).clamp(0.0, 1.0 - 2**-53))
            z_hi = _icdf_search(cum, (u[:, :k] + eps).clamp(0.0, 1.0 - 2**-53))
            near_unkept = (count.gather(-1, z_hi) - count.gather(-1, a) + unsure.gather(-1, a).to(torch.int32)) > 0
        elif eos_idx is not None:
            gated_s = (e[:, eos_idx].sum(dim=-1) / total < fs)[:, None, None]  # [b, 1, 1]
            e_hi = cum[:, eos_idx] / total[:, None]  # [b, n_eos]
            e_lo = e_hi - e[:, eos_idx] / total[:, None]
            uu = u[:, :k, None]  # [b, K, 1]
            near_unkept = ((uu >= e_lo[:, None, :] - eps) & (uu <= e_hi[:, None, :] + eps) & gated_s).any(dim=-1)
        may_skip = ~kept(draws, top_p - nucleus_slack, fs) | ((d_margin <= eps) & near_unkept)  # [b, K]
        reach = torch.cumprod(torch.cat([torch.ones_like(may_skip[:, :1]), may_skip], dim=-1).to(torch.int8), dim=-1).bool()  # [b, K+1]
        possible_c = kept(c, top_p + nucleus_slack, fl)[:, 0]  # [b]
        gap = torch.where(reach[:, :k] & possible_c[:, None], dist, math.inf).amin(dim=-1)
        no_kept = ~kx.any(dim=-1)
        if bool((reach[:, k] | no_kept).any()):  # the fallback: inverse CDF over the exact kept set with u_K
            keep = torch.ones_like(e, dtype=torch.bool) if excl is None else excl < top_p
            if eos_idx is not None:
                keep[:, eos_idx] &= ~(e[:, eos_idx].sum(dim=-1) / total < fe)[:, None]
            fb, fcum = _icdf_fallback(z, e, keep, u[:, k], eos_idx)
            r = torch.where(no_kept, fb, r)
            ftot = fcum[:, -1]
            w_c = torch.where(keep.gather(-1, c)[:, 0], e.gather(-1, c)[:, 0], 0.0)
            fgap = _interval_gap(u[:, k], fcum.gather(-1, c)[:, 0] - w_c, w_c, ftot)
            fgap = torch.where((ftot <= 0) & (safe[lo:hi] == fb), 0.0, fgap)
            gap = torch.where(reach[:, k], torch.minimum(gap, fgap), gap)
        rec.append(r)
        margins.append(margin)
        gaps.append(torch.where(in_vocab[lo:hi], gap, math.inf))
    return torch.cat(rec), torch.cat(margins), torch.cat(gaps), torch.cat(lps)


def replay_check(
    logits: torch.Tensor,
    tokens: torch.Tensor | Sequence[int],
    seed: int,
    start_position: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eps: float | None = None,
    max_near_tie_fraction: float = DEFAULT_MAX_NEAR_TIE_FRACTION,
    nucleus_slack: float = DEFAULT_NUCLEUS_SLACK,
    eos_ids: Sequence[int] = (),
    min_eos_prob: float = 0.0,
    eos_prob_slack: float = DEFAULT_EOS_PROB_SLACK,
    rule: str = DEFAULT_RULE,
) -> ReplayResult:
    """Recompute every sampled token from the validator's logits (``docs/toploc.md`` §6).

    Position ``i`` uses completion position ``start_position + i``. A claimed token that differs
    from the recomputed one is a *near tie* if its gap (see :class:`ReplayResult`) is ``≤ eps``
    (numeric noise between the worker's and the validator's forward passes can flip such
    tokens) and a *hard mismatch* otherwise; so is a claimed token outside the validator's
    nucleus by more than ``nucleus_slack`` of probability mass. Work is O(T · V) vectorised
    tensor ops in row blocks; ``icdf-v1`` draws one Philox block per row, not one per token.

    Args:
        logits: ``[T, V]`` the validator's logits at the committed rows (row i produced token i).
        tokens: ``[T]`` the worker's claimed tokens (untrusted; ids ≥ V are hard mismatches).
        seed: the completion's sequence seed.
        start_position: completion position of ``tokens[0]``.
        temperature: > 0, from the run spec.
        top_p: in ``(0, 1]``, from the run spec.
        eps: near-tie tolerance; ``None``: the rule's default (:data:`DEFAULT_ICDF_EPS`
            probability units, :data:`DEFAULT_REPLAY_EPS` score units).
        max_near_tie_fraction: tolerated share of near ties.
        nucleus_slack: probability slack for the nucleus boundary.
        eos_ids: token ids that end a completion.
        min_eos_prob: the sampler's EOS floor (0: no gate). Where the claimed token is not EOS,
            the replay gates EOS below ``min_eos_prob + eos_prob_slack`` (the worker may have seen
            P(EOS) just under the floor; ``icdf-v1`` also tries the floor ``min_eos_prob −
            eos_prob_slack``, since gating EOS shifts later tokens' intervals); where it is EOS,
            the replay does not gate and :func:`termination_check` judges the stop.
        eos_prob_slack: numeric slack on P(EOS) between worker and validator.
        rule: the run's sampling rule (:data:`RULES`).

    Returns:
        A :class:`ReplayResult`.

    Raises:
        ValueError: bad parameters, unknown rule or shapes (the validator's own inputs).
    """
    _check_params(temperature, top_p)
    _check_rule(rule)
    if eps is None:
        eps = DEFAULT_ICDF_EPS if rule == RULE_ICDF else DEFAULT_REPLAY_EPS
    claimed = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).to(logits.device)
    if logits.dim() != 2 or claimed.numel() != logits.shape[0] or logits.shape[0] == 0:
        raise ValueError("need logits [T, V] with T >= 1 and one claimed token per row")
    n_tok, vocab = logits.shape
    in_vocab = (claimed >= 0) & (claimed < vocab)
    safe = torch.where(in_vocab, claimed, torch.zeros_like(claimed))
    seeds = torch.full((n_tok,), seed, dtype=torch.int64, device=logits.device)
    positions = start_position + torch.arange(n_tok, dtype=torch.int64, device=logits.device)
    eos_list = [int(e) for e in eos_ids if 0 <= int(e) < vocab]
    claimed_eos = torch.isin(claimed, torch.tensor(eos_list, dtype=torch.int64, device=logits.device)) if eos_list else torch.zeros_like(claimed, dtype=torch.bool)
    gate_on = min_eos_prob > 0
    def floor_at(value: float) -> torch.Tensor:  # [T]; no gate where the claimed token is EOS
        return torch.where(claimed_eos, 0.0, value if gate_on else 0.0).to(torch.float64)

    floor = floor_at(min_eos_prob + eos_prob_slack)
    if rule == RULE_ICDF:
        floors = (floor_at(min_eos_prob), floor, floor_at(min_eos_prob - eos_prob_slack))
        recomputed, margin, gap, lps = _icdf_replay(logits, safe, in_vocab, seeds, positions, temperature, top_p, nucleus_slack, eos_list, floors, eps)
    else:
        recomputed, margin, gap, lps = _gumbel_replay(logits, safe, in_vocab, seeds, positions, temperature, top_p, nucleus_slack, eos_list, floor)
    gap = torch.where(recomputed == claimed, torch.zeros_like(margin), gap.clamp_min(0.0))
    lps = torch.where(in_vocab, lps, torch.full_like(lps, math.nan))
    differs = recomputed != claimed
    hard = int((differs & (gap > eps)).sum())
    near = int((differs & (gap <= eps)).sum())
    allowed = math.ceil(max_near_tie_fraction * n_tok)
    problems = []
    if hard:
        first = int(torch.nonzero(differs & (gap > eps))[0, 0])
        problems.append(
            f"{hard} sampled tokens differ from the replay beyond eps={eps} (first at position {start_position + first})"
        )
    if near > allowed:
        problems.append(f"{near} near-tie mismatches > {allowed} allowed")
    return ReplayResult(recomputed, margin, gap, hard, near, allowed, ok=not problems, reason="; ".join(problems), logprobs=lps)


@dataclasses.dataclass(frozen=True)
class TerminationResult:
    """Outcome of :func:`termination_check`.

    Attributes:
        ok: the completion ends legitimately.
        p_eos: recomputed probability of the EOS set at the last position (NaN if not computed).
        reason: why it failed, ``""`` when ok.
    """

    ok: bool
    p_eos: float
    reason: str = ""


def termination_check(
    last_logits: torch.Tensor,
    tokens: torch.Tensor | Sequence[int],
    eos_token_ids: Sequence[int],
    max_tokens: int,
    temperature: float = 1.0,
    min_eos_prob: float = DEFAULT_MIN_EOS_PROB,
    eos_prob_slack: float = 0.0,
) -> TerminationResult:
    """Check how a completion ends.

    Rules: a completion has 1 … ``max_tokens`` tokens; an EOS token may only be its last token
    (generation stops at the first EOS); if it ends with EOS, the recomputed probability
    ``Σ_{e ∈ EOS} softmax(last_logits / temperature)[e]`` (unfiltered, before top-p) must be
    ``≥ min_eos_prob``; otherwise it must have exactly ``max_tokens`` tokens.

    Args:
        last_logits: ``[V]`` the validator's logits at the row that produced the last token.
        tokens: ``[n]`` the claimed completion.
        eos_token_ids: ids that end generation.
        max_tokens: the run spec's ``sampling.max_tokens``.
        temperature: > 0.
        min_eos_prob: threshold on P(EOS).
        eos_prob_slack: accept P(EOS) down to ``min_eos_prob − eos_prob_slack`` (numeric noise
            between the worker's and the validator's forward passes).

    Returns:
        A :class:`TerminationResult`.
    """
    toks = [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]
    eos = {int(e) for e in eos_token_ids}
    if not toks:
        return TerminationResult(False, math.nan, "empty completion")
    if len(toks) > max_tokens:
        return TerminationResult(False, math.nan, f"{len(toks)} tokens > max_tokens={max_tokens}")
    early = [i for i, t in enumerate(toks[:-1]) if t in eos]
    if early:
        return TerminationResult(False, math.nan, f"EOS at position {early[0]} before the end")
    if toks[-1] not in eos:
        if len(toks) != max_tokens:
            return TerminationResult(False, math.nan, f"no EOS but {len(toks)} tokens != max_tokens={max_tokens}")
        return TerminationResult(True, math.nan)
    probs = torch.softmax(last_logits.to(torch.float64).reshape(-1) / temperature, dim=-1)
    ids = [e for e in eos if 0 <= e < probs.numel()]
    p_eos = float(probs[ids].sum()) if ids else 0.0
    if p_eos < min_eos_prob - eos_prob_slack:
        return TerminationResult(False, p_eos, f"ends with EOS but recomputed P(EOS)={p_eos:.4f} < {min_eos_prob}")
    return TerminationResult(True, p_eos)


@dataclasses.dataclass(frozen=True)
class LogprobResult:
    """Outcome of :func:`logprob_check`.

    Attributes:
        ok: both tolerances hold.
        max_abs_err: largest per-token |reported − recomputed|, nats (``inf``: counts differ or a
            value is not finite).
        mean_abs_err: mean of the same over the completion, nats.
        position: completion position of the largest difference (the first non-finite one; 0
            when the counts differ).
        reason: why it failed, ``""`` when ok.
    """

    ok: bool
    max_abs_err: float
    mean_abs_err: float
    position: int = 0
    reason: str = ""


def logprob_check(
    reported: torch.Tensor | Sequence[float],
    recomputed: torch.Tensor,
    *,
    max_abs: float,
    mean_abs: float,
) -> LogprobResult:
    """Compare a worker's reported sampling log-probs with the validator's: the one log-prob rule.

    The tolerances are the run's (run spec ``toploc.logprob_max_abs`` / ``logprob_mean_abs``,
    ``docs/toploc.md`` §8); the validator pipeline, and through it the coordinator's re-check,
    call this with them. The comparison is in float64; a difference exactly at a tolerance passes.

    Args:
        reported: ``[T]`` the worker's log-probs (untrusted; float32 on the wire; NaN/inf fail).
        recomputed: ``[T]`` ``log_softmax(logits / temperature)[claimed token]`` from the
            validator's prefill (as :func:`sample` defines it; :attr:`ReplayResult.logprobs`).
        max_abs: per-token tolerance, nats, > 0.
        mean_abs: tolerance on the mean over the ``T`` tokens, nats, > 0.

    Returns:
        A :class:`LogprobResult`; a count mismatch, an empty completion or a non-finite value
        fails with a reason rather than raising.
    """
    rep = torch.as_tensor(reported, dtype=torch.float64).reshape(-1)
    ref = recomputed.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if rep.numel() != ref.numel() or rep.numel() == 0:
        return LogprobResult(False, math.inf, math.inf, 0, f"{rep.numel()} log-probs reported for {ref.numel()} tokens")
    err = (rep - ref).abs()
    finite = torch.isfinite(err)
    if not bool(finite.all()):
        at = int((~finite).nonzero()[0, 0])
        return LogprobResult(False, math.inf, math.inf, at, f"non-finite log-prob at position {at}")
    at = int(err.argmax())
    worst, mean = float(err[at]), float(err.mean())
    problems = []
    if worst > max_abs:
        problems.append(f"max |Δ logprob| {worst:.4g} at position {at} > {max_abs}")
    if mean > mean_abs:
        problems.append(f"mean |Δ logprob| {mean:.4g} > {mean_abs}")
    return LogprobResult(not problems, worst, mean, at, "; ".join(problems))
