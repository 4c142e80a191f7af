"""TOPLOC v1 inference proofs: byte-compatible encoding, strict parsing and verification.

A worker commits to the final-norm hidden states (the LM-head input) of its completion, 32
generated tokens at a time, in 258 bytes per chunk; a validator recomputes the same hidden states
with one prefill pass and compares (arXiv 2501.16007, §3 "TOPLOC", §4.1 proof generation and
§4.2 validation). The proof bytes are those of the reference ``toploc==0.1.6``; the verifier is
stricter than the reference (it compares sign bits and parses untrusted bytes without crashing).

Per chunk of ``chunk_size`` rows of a ``[T, H]`` bfloat16 tensor (normative, ``docs/toploc.md``):

1. Flatten the chunk row-major; take the ``topk`` entries of largest absolute value, ties broken
   by the lower flat index. ``x_i`` = flat index, ``y_i`` = raw 16-bit bf16 pattern.
2. ``m`` = the largest integer ≤ 65497 such that all ``x_i mod m`` are distinct.
3. The unique polynomial ``P`` of degree < k over GF(65497) with ``P(x_i mod m) ≡ y_i``.
4. Bytes: ``u16be(m) || u16be(c_0) || … || u16be(c_{k-1})`` (ascending degree), 2 + 2k bytes.

All GF(p) arithmetic is vectorised over points and chunks: powers by doubling, the master
polynomial ``∏(x − x_i)`` by a tree of batched convolutions, and every O(k²) sum as a float64
matrix product, which is exact because each sum stays below 2^53 (k · p² < 2^46 for k ≤ 4096).

Which rows a completion commits is fixed by :func:`rows_for_completion`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

__all__ = [
    "FIELD_PRIME",
    "MAX_MODULUS",
    "ChunkResult",
    "MalformedProofError",
    "Proof",
    "ToplocError",
    "build_proofs",
    "decode_proof",
    "encode_proof",
    "evaluate",
    "find_modulus",
    "interpolate",
    "proof_size_bytes",
    "rows_for_completion",
    "verify_proofs",
]

FIELD_PRIME = 65497
"""p: the prime field of the proof polynomial (largest prime below 2^16 − 38; TOPLOC v1)."""
MAX_MODULUS = FIELD_PRIME
"""Largest allowed index modulus ``m``; the search starts here and goes down."""
DEFAULT_CHUNK_SIZE = 32
"""Generated tokens (rows) per proof."""
DEFAULT_TOPK = 128
"""Activations committed per proof."""
DEFAULT_MAX_MISMATCHES = 38
"""Verifier threshold: sign/exponent mismatches allowed per chunk (of ``topk``)."""
DEFAULT_MAX_MANT_ERR_MEAN = 10.0
"""Verifier threshold: mean absolute mantissa difference over matches, in units of the 7-bit mantissa."""
DEFAULT_MAX_MANT_ERR_MEDIAN = 8.0
"""Verifier threshold: upper median (``sorted[n // 2]``) absolute mantissa difference over matches."""
_MAX_TOPK = 4096  # keeps every float64 dot product exact: k * p^2 < 2^53

IntArray = npt.NDArray[np.int64]


class ToplocError(ProtocolError):
    """A TOPLOC input that cannot be proven or checked as configured (wrong dtype or shape, a
    chunk with fewer than ``topk`` entries, invalid parameters). Fix the caller or the run spec."""


class MalformedProofError(ToplocError):
    """Proof bytes that do not parse (wrong length, modulus out of range, coefficient ≥ p).

    Attributes:
        reason: what was wrong, for the verdict.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Proof:
    """A parsed proof.

    Attributes:
        modulus: ``m``, 1 ≤ m ≤ 65497; indices are reduced mod ``m`` before evaluation.
        coeffs: ``[k]`` int64, each in ``[0, p)``, ascending degree.
    """

    modulus: int
    coeffs: IntArray


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """The verifier's finding for one chunk.

    Attributes:
        index: chunk number (rows ``[index * chunk_size, …)``).
        mismatches: entries of the verifier's top-k whose decoded sign or exponent differs (0…k).
        mant_err_mean: mean |mantissa difference| over matching entries (7-bit units); +inf if none.
        mant_err_median: upper median ``sorted[n // 2]`` of the same; +inf if none.
        ok: all three within the thresholds and the proof parsed.
        reason: why the chunk was rejected, ``""`` when ``ok``.
    """

    index: int
    mismatches: int
    mant_err_mean: float
    mant_err_median: float
    ok: bool
    reason: str = ""


def proof_size_bytes(topk: int = DEFAULT_TOPK) -> int:
    """Size of one proof: 2 bytes of modulus + 2 bytes per coefficient (258 for k = 128)."""
    return 2 + 2 * topk


def rows_for_completion(prompt_len: int, n_completion: int) -> slice:
    """Positions whose final-norm hidden states a completion commits to.

    For a prompt of ``P`` tokens and a completion ``t_1 … t_n`` the committed rows are positions
    ``P-1 … P+n-2`` of the prompt+completion sequence: row ``P-1+i`` is the state whose logits
    produced ``t_{i+1}``. The worker gets them as the last prefill row plus the first ``n-1``
    decode steps (the state of the final token is never needed); the validator gets them from one
    prefill of prompt+completion as ``hidden[rows_for_completion(P, n)]``. (The reference's
    decode-only capture starts one row later; see ``docs/toploc.md``.)

    Args:
        prompt_len: P ≥ 1, tokens in the prompt (no padding).
        n_completion: n ≥ 1, generated tokens (EOS included if sampled).

    Returns:
        ``slice(P - 1, P + n - 1)``, of length ``n``.

    Raises:
        ValueError: if ``prompt_len < 1`` or ``n_completion < 1``.
    """
    if prompt_len < 1 or n_completion < 1:
        raise ValueError(f"need prompt_len >= 1 and n_completion >= 1, got {prompt_len}, {n_completion}")
    return slice(prompt_len - 1, prompt_len + n_completion - 1)


# --------------------------------------------------------------------------------------------
# GF(p) arithmetic, vectorised over a leading batch dimension
# --------------------------------------------------------------------------------------------


@functools.cache
def _log_tables() -> tuple[IntArray, IntArray, IntArray]:
    """Discrete log/exp tables of GF(p)* for a generator g (found once, ~10 ms).

    Returns:
        ``(log, exp, log_diff)``: ``log [p]`` with ``g^log[x] = x`` (``log[0] = 0``, unused);
        ``exp [p-1]`` with ``exp[e] = g^e``; ``log_diff [2p]`` with ``log_diff[d + p] = log[d mod p]``
        for ``d ≠ 0`` and ``log_diff[p] = 0`` (so a zero difference on a diagonal contributes 1).
    """
    order = FIELD_PRIME - 1  # 2^3 * 3 * 2729
    gen = next(g for g in range(2, FIELD_PRIME) if all(pow(g, order // q, FIELD_PRIME) != 1 for q in (2, 3, 2729)))
    exp = np.empty(order, dtype=np.int64)
    block = np.ones(1, dtype=np.int64)
    step = gen
    while block.size < order:  # exp[0:2n] = concat(exp[0:n], exp[0:n] * g^n)
        block = np.concatenate([block, block * step % FIELD_PRIME])
        step = step * step % FIELD_PRIME
    exp[:] = block[:order]
    log = np.zeros(FIELD_PRIME, dtype=np.int64)
    log[exp] = np.arange(order, dtype=np.int64)
    log_diff = np.concatenate([log, np.zeros(1, dtype=np.int64), log[1:]])
    return log, exp, log_diff


def _power_matrix(x: IntArray, k: int) -> npt.NDArray[np.float64]:
    """``x [..., n]`` residues in ``[0, p)`` → ``[..., n, k]`` float64 with entry ``x^e mod p``."""
    log, exp, _ = _log_tables()
    e = (log[x][..., None] * np.arange(k, dtype=np.int64)) % (FIELD_PRIME - 1)  # [..., n, k]
    pw = exp[e]
    zero = x == 0
    if zero.any():  # 0^0 = 1, 0^e = 0
        pw[zero] = 0
        pw[zero, 0] = 1
    return pw.astype(np.float64)


def _matvec_mod(mat: npt.NDArray[np.float64], vec: IntArray) -> IntArray:
    """``mat [..., a, b] @ vec [..., b] mod p``, exact in float64 (all terms < p, b ≤ 4096)."""
    out = np.matmul(mat, vec.astype(np.float64)[..., None])[..., 0]
    return out.astype(np.int64) % FIELD_PRIME


def _lagrange_weights(x: IntArray) -> IntArray:
    """``x [C, k]`` distinct residues → ``[C, k]`` weights ``1 / ∏_{j≠i} (x_i − x_j)`` mod p (via logs)."""
    log, exp, log_diff = _log_tables()
    logs = log_diff[x[..., :, None] - x[..., None, :] + FIELD_PRIME].sum(axis=-1)  # [C, k]
    return exp[(-logs) % (FIELD_PRIME - 1)]


@functools.cache
def _toeplitz_index(d: int) -> IntArray:
    """``[2d-1, d]`` gather index: ``n - i`` where ``0 ≤ n - i < d``, else ``d`` (a zero pad)."""
    n = np.arange(2 * d - 1)[:, None]
    i = np.arange(d)[None, :]
    diff = n - i
    return np.where((diff >= 0) & (diff < d), diff, d).astype(np.int64)


def _master_poly(x: IntArray) -> IntArray:
    """``x [C, k]`` residues → ``[C, k+1]`` coefficients (ascending) of ∏(z − x_i) mod p.

    A balanced tree: the first level forms quadratics directly, each further level multiplies
    neighbouring polynomials through a gathered Toeplitz matrix and one batched float64 product
    (exact: at most k/2+1 products < p² per sum).
    """
    c, k = x.shape
    width = 1 << max(1, (k - 1).bit_length())
    roots = np.zeros((c, width), dtype=np.int64)
    roots[:, :k] = x
    live = np.zeros(width, dtype=np.int64)
    live[:k] = 1  # padding factors are the constant 1
    r0, r1, l0, l1 = roots[:, 0::2], roots[:, 1::2], live[0::2], live[1::2]
    # (l0 z - r0)(l1 z - r1) with padding (l = 0, r = -1): [C, width/2, 3]
    polys = np.stack([r0 * r1 % FIELD_PRIME, (-(r0 * l1 + r1 * l0)) % FIELD_PRIME, np.broadcast_to(l0 * l1, r0.shape)], axis=-1)
    pad_a = live[0::2] == 0
    pad_b = live[1::2] == 0
    polys[:, pad_a & pad_b, :] = np.array([1, 0, 0])
    only_a = ~pad_a & pad_b  # (z - r0) * 1
    polys[:, only_a, 0] = (-r0[:, only_a]) % FIELD_PRIME
    polys[:, only_a, 1] = 1
    polys[:, only_a, 2] = 0
    while polys.shape[1] > 1:
        d = polys.shape[2]
        left, right = polys[:, 0::2, :], polys[:, 1::2, :]  # [C, L, d] each
        right_pad = np.concatenate([right, np.zeros(right.shape[:2] + (1,), dtype=np.int64)], axis=-1)
        toeplitz = right_pad[..., _toeplitz_index(d)].astype(np.float64)  # [C, L, 2d-1, d]
        polys = _matvec_mod(toeplitz, left)  # [C, L, 2d-1]
    return polys[:, 0, : k + 1]


@functools.cache
def _hankel_index(k: int) -> IntArray:
    """``[k, k]`` gather index ``j + e + 1`` (clamped to ``k + 1``, a zero pad)."""
    j = np.arange(k)[:, None]
    e = np.arange(k)[None, :]
    return np.minimum(j + e + 1, k + 1).astype(np.int64)


def _interpolate_batch(x: IntArray, y: IntArray) -> IntArray:
    """Lagrange interpolation over GF(p), batched.

    Args:
        x: ``[C, k]`` int64 residues in ``[0, p)``, distinct within each row.
        y: ``[C, k]`` int64 values (any non-negative ints; reduced mod p here).

    Returns:
        ``[C, k]`` int64 coefficients, ascending degree, each in ``[0, p)``.

    With ``M(z) = ∏(z − x_i) = Σ a_l z^l`` and weights ``w_i = 1 / ∏_{j≠i}(x_i − x_j)``, the
    coefficient of ``z^j`` is ``Σ_e a_{j+e+1} v_e`` where ``v_e = Σ_i y_i w_i x_i^e`` (synthetic
    division of ``M`` by ``z − x_i``, summed over i): one mat-vec and one Hankel mat-vec.
    """
    k = x.shape[-1]
    yw = (y % FIELD_PRIME) * _lagrange_weights(x) % FIELD_PRIME  # [C, k]
    powers = _power_matrix(x, k)  # [C, k, k]
    v = _matvec_mod(np.swapaxes(powers, -1, -2), yw)  # power sums, [C, k]
    a = _master_poly(x)  # [C, k+1]
    a_pad = np.concatenate([a, np.zeros((a.shape[0], 1), dtype=np.int64)], axis=-1)  # [C, k+2]
    hankel = a_pad[:, _hankel_index(k)].astype(np.float64)  # [C, k, k]
    return _matvec_mod(hankel, v)


def _evaluate_batch(coeffs: IntArray, x: IntArray) -> IntArray:
    """``coeffs [C, k]``, residues ``x [C, n]`` → ``[C, n]`` values of the polynomials mod p."""
    return _matvec_mod(_power_matrix(x, coeffs.shape[-1]), coeffs)


def _find_moduli(x: IntArray) -> IntArray:
    """``x [C, k]`` distinct non-negative ints → ``[C]`` largest m ≤ 65497 with distinct x mod m.

    Tries m = 65497 for all rows at once, then blocks of 64 candidates per remaining row.

    Raises:
        ToplocError: if no m ≥ k works (never seen for indices below 2^31).
    """
    c, k = x.shape
    out = np.zeros(c, dtype=np.int64)
    srt = np.sort(x % MAX_MODULUS, axis=-1)
    first_ok = np.all(srt[:, 1:] != srt[:, :-1], axis=-1)
    out[first_ok] = MAX_MODULUS
    for row in np.flatnonzero(~first_ok):
        top = MAX_MODULUS - 1
        while out[row] == 0:
            if top < max(k, 1):
                raise ToplocError(f"no modulus <= {MAX_MODULUS} makes the {k} indices distinct")
            cands = np.arange(top, max(top - 64, k - 1), -1, dtype=np.int64)  # descending
            res = np.sort(x[row][None, :] % cands[:, None], axis=-1)
            good = np.all(res[:, 1:] != res[:, :-1], axis=-1)
            if good.any():
                out[row] = cands[int(np.argmax(good))]
            top = int(cands[-1]) - 1
    return out


# --------------------------------------------------------------------------------------------
# Public point-level API
# --------------------------------------------------------------------------------------------


def _as_int_array(values: Sequence[int] | npt.ArrayLike, name: str) -> IntArray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ToplocError(f"{name} must be a non-empty 1-D sequence of integers")
    if np.any(arr < 0) or np.any(arr >= 1 << 62):
        raise ToplocError(f"{name} must be non-negative and below 2^62")
    return arr.astype(np.int64)


def find_modulus(xs: Sequence[int] | npt.ArrayLike) -> int:
    """The largest ``m ≤ 65497`` such that all ``xs mod m`` are distinct.

    Args:
        xs: distinct non-negative flat indices (k ≤ 4096 of them).

    Returns:
        m, with k ≤ m ≤ 65497.

    Raises:
        ToplocError: if ``xs`` is empty, negative, has repeats, or no such m exists.
    """
    x = _as_int_array(xs, "xs")
    if np.unique(x).size != x.size:
        raise ToplocError("xs must be distinct")
    return int(_find_moduli(x[None, :])[0])


def interpolate(xs: Sequence[int] | npt.ArrayLike, ys: Sequence[int] | npt.ArrayLike) -> list[int]:
    """Coefficients of the unique polynomial of degree < k over GF(65497) through ``(xs, ys)``.

    ``xs`` are used as given (already reduced by the caller, e.g. ``x mod m``), and must be
    distinct modulo p; ``ys`` are reduced mod p (so the bf16 pattern 0xFFFF becomes 38).

    Args:
        xs: k points, integers in ``[0, p)``, distinct.
        ys: k values, non-negative integers (16-bit bf16 patterns in a proof).

    Returns:
        k coefficients, ascending degree, each in ``[0, p)``.

    Raises:
        ToplocError: on lengths that differ, points ≥ p, repeated points, or k > 4096.
    """
    x = _as_int_array(xs, "xs")
    y = _as_int_array(ys, "ys")
    if x.size != y.size:
        raise ToplocError(f"xs and ys differ in length: {x.size} != {y.size}")
    if x.size > _MAX_TOPK:
        raise ToplocError(f"at most {_MAX_TOPK} points, got {x.size}")
    if np.any(x >= FIELD_PRIME) or np.unique(x).size != x.size:
        raise ToplocError("xs must be distinct residues below p = 65497")
    return [int(c) for c in _interpolate_batch(x[None, :], y[None, :])[0]]


def evaluate(coeffs: Sequence[int] | npt.ArrayLike, xs: Sequence[int] | npt.ArrayLike) -> list[int]:
    """Evaluate the polynomial ``Σ coeffs[j] z^j`` over GF(65497) at each of ``xs`` (reduced mod p).

    Args:
        coeffs: ascending coefficients, each in ``[0, p)``.
        xs: non-negative integer points.

    Returns:
        One value in ``[0, p)`` per point.

    Raises:
        ToplocError: on empty or negative inputs, or coefficients ≥ p.
    """
    c = _as_int_array(coeffs, "coeffs")
    x = _as_int_array(xs, "xs")
    if np.any(c >= FIELD_PRIME):
        raise ToplocError("coefficients must be below p = 65497")
    return [int(v) for v in _evaluate_batch(c[None, :], (x % FIELD_PRIME)[None, :])[0]]


def encode_proof(modulus: int, coeffs: Sequence[int] | npt.ArrayLike) -> bytes:
    """``u16be(modulus) || u16be(c_0) || … || u16be(c_{k-1})``.

    Raises:
        ToplocError: if the modulus is not in ``[1, 65497]`` or a coefficient is not in ``[0, p)``.
    """
    c = _as_int_array(coeffs, "coeffs")
    if not 1 <= modulus <= MAX_MODULUS or np.any(c >= FIELD_PRIME):
        raise ToplocError("modulus must be in [1, 65497] and coefficients in [0, 65497)")
    return int(modulus).to_bytes(2, "big") + c.astype(">u2").tobytes()


def decode_proof(data: bytes, topk: int = DEFAULT_TOPK) -> Proof:
    """Parse one proof strictly.

    Args:
        data: untrusted bytes.
        topk: expected k; the length must be exactly ``2 + 2k``.

    Returns:
        The parsed :class:`Proof`.

    Raises:
        MalformedProofError: not bytes, wrong length, modulus 0 or > 65497, or a coefficient ≥ p.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedProofError(f"proof must be bytes, got {type(data).__name__}")
    raw = bytes(data)
    if len(raw) != proof_size_bytes(topk):
        raise MalformedProofError(f"proof is {len(raw)} bytes, expected exactly {proof_size_bytes(topk)}")
    words = np.frombuffer(raw, dtype=">u2").astype(np.int64)
    modulus = int(words[0])
    if not 1 <= modulus <= MAX_MODULUS:
        raise MalformedProofError(f"modulus {modulus} outside [1, {MAX_MODULUS}]")
    coeffs = words[1:]
    bad = np.flatnonzero(coeffs >= FIELD_PRIME)
    if bad.size:
        raise MalformedProofError(f"coefficient {int(bad[0])} is {int(coeffs[bad[0]])} >= p = {FIELD_PRIME}")
    return Proof(modulus=modulus, coeffs=coeffs)


# --------------------------------------------------------------------------------------------
# Tensor-level API
# --------------------------------------------------------------------------------------------


def _check_hidden(hidden: torch.Tensor, chunk_size: int, topk: int) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.dtype != torch.bfloat16:
        raise ToplocError("hidden must be a 2-D torch.bfloat16 tensor [T, H]")
    if not 1 <= topk <= _MAX_TOPK or chunk_size < 1:
        raise ToplocError(f"need 1 <= topk <= {_MAX_TOPK} and chunk_size >= 1, got {topk}, {chunk_size}")
    t, h = hidden.shape
    if t == 0:
        raise ToplocError("hidden has no rows: a completion has at least one token")
    last_rows = t - (math.ceil(t / chunk_size) - 1) * chunk_size
    if last_rows * h < topk:
        raise ToplocError(f"a chunk of {last_rows} rows x {h} holds fewer than topk={topk} entries (run spec: hidden_size >= topk)")


def _chunk_groups(hidden: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    """Split ``[T, H]`` into ``[C, chunk_size*H]`` int16 bit views of full chunks (+ the short one)."""
    t, h = hidden.shape
    bits = hidden.contiguous().view(torch.int16)
    n_full = t // chunk_size
    groups = []
    if n_full:
        groups.append(bits[: n_full * chunk_size].reshape(n_full, chunk_size * h))
    if t % chunk_size:
        groups.append(bits[n_full * chunk_size :].reshape(1, -1))
    return groups


_TIE_SLACK = 64
"""Extra candidates fetched by top-k so that a tie group at the k-th value is usually complete."""


def _select_topk(bits: torch.Tensor, k: int) -> tuple[IntArray, IntArray]:
    """Top-k by |value| per row with ties to the lower flat index.

    Args:
        bits: ``[C, N]`` int16 bf16 bit patterns (any device).
        k: entries to select, ≤ N.

    Returns:
        ``(idx, y)``: ``[C, k]`` int64 flat indices (in no particular order) and their 16-bit
        patterns in ``[0, 65536)``, as numpy on the CPU.
    """
    n = bits.shape[1]
    mag = bits & 0x7FFF  # |value| orders like its magnitude bits (finite values); [C, N] int16
    n_cand = min(n, k + _TIE_SLACK)
    vals_t, idx_t = mag.topk(n_cand, dim=1, largest=True, sorted=True)  # [C, n_cand]
    vals, idx = vals_t.cpu().numpy(), idx_t.cpu().numpy().astype(np.int64)
    thresh = vals[:, k - 1 : k]  # the k-th largest magnitude, [C, 1]
    if n_cand < n and np.any(vals[:, -1] == thresh[:, 0]):
        # The tie group at the threshold may continue past the candidates: gather it exhaustively.
        rows_t, cols_t = torch.nonzero(mag == vals_t[:, k - 1 : k], as_tuple=True)  # row-major: cols ascending
        rows, cols = rows_t.cpu().numpy(), cols_t.cpu().numpy().astype(np.int64)
        picks = []
        for r in range(vals.shape[0]):
            above = idx[r][vals[r] > thresh[r, 0]]
            picks.append(np.concatenate([above, cols[rows == r][: k - above.size]]))
        chosen = np.stack(picks)
    else:
        big = np.int64(1) << 62
        key = np.where(vals > thresh, -1, np.where(vals == thresh, idx, big))  # above, then ties by index
        order = np.argsort(key, axis=1, kind="stable")[:, :k]
        chosen = np.take_along_axis(idx, order, axis=1)  # [C, k]
    picked = torch.from_numpy(chosen).to(bits.device)
    y = torch.gather(bits, 1, picked).cpu().numpy().astype(np.int64) & 0xFFFF
    return chosen, y


def build_proofs(hidden: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE, topk: int = DEFAULT_TOPK) -> list[bytes]:
    """TOPLOC proofs for the committed rows of one completion.

    Args:
        hidden: ``[T, H]`` bfloat16, the final-norm hidden states of the committed rows
            (:func:`rows_for_completion`), any device; rows ``[0:chunk_size]``,
            ``[chunk_size:2*chunk_size]``, … form the chunks, the last may be shorter.
        chunk_size: rows per proof (run spec ``toploc.chunk_size``).
        topk: activations per proof (run spec ``toploc.topk``).

    Returns:
        ``ceil(T / chunk_size)`` proofs of ``2 + 2*topk`` bytes each.

    Raises:
        ToplocError: wrong dtype/rank, no rows, or a chunk with fewer than ``topk`` entries.
    """
    _check_hidden(hidden, chunk_size, topk)
    proofs: list[bytes] = []
    for group in _chunk_groups(hidden, chunk_size):
        x, y = _select_topk(group, topk)  # [C, k] each
        moduli = _find_moduli(x)  # [C]
        coeffs = _interpolate_batch(x % moduli[:, None], y)  # [C, k]
        raw = np.concatenate([moduli[:, None], coeffs], axis=1).astype(">u2")  # [C, 1 + k] big-endian u16
        proofs.extend(row.tobytes() for row in raw)
    return proofs


def _compare(decoded: IntArray, actual: IntArray) -> tuple[int, float, float]:
    """Per-chunk statistics of decoded vs actual bf16 patterns (``[k]`` ints each)."""
    sign_exp_match = (decoded >> 7) == (actual >> 7)  # sign bit and 8 exponent bits
    mismatches = int(decoded.size - np.count_nonzero(sign_exp_match))
    errs = np.sort(np.abs((decoded & 0x7F) - (actual & 0x7F))[sign_exp_match])
    if errs.size == 0:
        return mismatches, math.inf, math.inf
    return mismatches, float(errs.mean()), float(errs[errs.size // 2])


def verify_proofs(
    hidden: torch.Tensor,
    proofs: Sequence[bytes],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    topk: int = DEFAULT_TOPK,
    max_mismatches: int = DEFAULT_MAX_MISMATCHES,
    max_mant_err_mean: float = DEFAULT_MAX_MANT_ERR_MEAN,
    max_mant_err_median: float = DEFAULT_MAX_MANT_ERR_MEDIAN,
) -> list[ChunkResult]:
    """Check untrusted proofs against the verifier's own hidden states (arXiv 2501.16007 §4.2).

    For each chunk: parse the proof strictly; take the verifier's top-k (same rule as
    :func:`build_proofs`); evaluate the proof polynomial at ``index mod m``; an entry matches if
    the decoded 16-bit pattern has the same sign and exponent as the verifier's value; report
    mismatches and the mean and upper median of |mantissa difference| over matches. A chunk is
    ok iff ``mismatches ≤ max_mismatches``, ``mean ≤ max_mant_err_mean`` and
    ``median ≤ max_mant_err_median``; a submission fails if any chunk fails.

    Args:
        hidden: ``[T, H]`` bfloat16, the verifier's recomputed committed rows.
        proofs: the worker's proofs, one per chunk, untrusted.
        chunk_size: rows per proof.
        topk: activations per proof.
        max_mismatches: allowed sign/exponent mismatches per chunk.
        max_mant_err_mean: allowed mean mantissa error (7-bit mantissa units).
        max_mant_err_median: allowed upper-median mantissa error.

    Returns:
        One :class:`ChunkResult` per chunk of ``hidden``; unparseable proofs and a wrong proof
        count give rejections with a ``reason`` (statistics ``topk``, +inf, +inf), never exceptions.

    Raises:
        ToplocError: only for the verifier's own inputs (``hidden`` dtype/shape, parameters).
    """
    _check_hidden(hidden, chunk_size, topk)
    n_chunks = math.ceil(hidden.shape[0] / chunk_size)

    def rejected(i: int, reason: str) -> ChunkResult:
        return ChunkResult(index=i, mismatches=topk, mant_err_mean=math.inf, mant_err_median=math.inf, ok=False, reason=reason)

    if isinstance(proofs, (bytes, bytearray, str)) or not isinstance(proofs, Sequence):
        return [rejected(i, "proofs must be a list of byte strings") for i in range(n_chunks)]
    if len(proofs) != n_chunks:
        reason = f"expected exactly one proof per chunk ({n_chunks}), got {len(proofs)}"
        return [rejected(i, reason) for i in range(n_chunks)]
    parsed: list[Proof | str] = []
    for raw in proofs:
        try:
            parsed.append(decode_proof(raw, topk))
        except MalformedProofError as exc:
            parsed.append(f"malformed proof: {exc.reason}")

    results: list[ChunkResult] = []
    chunk = 0
    for group in _chunk_groups(hidden, chunk_size):
        x, actual = _select_topk(group, topk)  # [C, k] each
        rows = range(chunk, chunk + x.shape[0])
        good = [r for r in rows if isinstance(parsed[r], Proof)]
        decoded: dict[int, IntArray] = {}
        if good:
            sel = np.array([r - chunk for r in good])
            moduli = np.array([parsed[r].modulus for r in good], dtype=np.int64)  # type: ignore[union-attr]
            coeffs = np.stack([parsed[r].coeffs for r in good])  # type: ignore[union-attr]
            values = _evaluate_batch(coeffs, x[sel] % moduli[:, None])  # [G, k]
            decoded = {r: values[j] for j, r in enumerate(good)}
        for r in rows:
            item = parsed[r]
            if isinstance(item, str):
                results.append(rejected(r, item))
                continue
            mism, mean, median = _compare(decoded[r], actual[r - chunk])
            problems = []
            if mism > max_mismatches:
                problems.append(f"{mism} sign/exponent mismatches > {max_mismatches}")
            if not mean <= max_mant_err_mean:
                problems.append(f"mean mantissa error {mean:.3g} > {max_mant_err_mean}")
            if not median <= max_mant_err_median:
                problems.append(f"median mantissa error {median:.3g} > {max_mant_err_median}")
            results.append(ChunkResult(r, mism, mean, median, ok=not problems, reason="; ".join(problems)))
        chunk += x.shape[0]
    if not all(res.ok for res in results):
        logger.debug("toploc: %d of %d chunks rejected", sum(not res.ok for res in results), len(results))
    return results
