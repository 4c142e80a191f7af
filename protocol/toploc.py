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

All GF(p) arithmetic is vectorised over points and chunks: powers through discrete log/exp
tables, the master polynomial ``∏(z − x_i)`` by a tree of batched convolutions, evaluation and
power sums by baby-step/giant-step matrix products, and every O(k²) sum as a float64 matrix
product, exact because each sum stays below 2^53 (k · (p+1)² < 2^46 for k ≤ 4096).

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
    "verify_proofs_many",
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


FloatArray = npt.NDArray[np.float64]
_P_FLOAT = float(FIELD_PRIME)
_INV_P = 1.0 / FIELD_PRIME
_ORDER = FIELD_PRIME - 1  # order of GF(p)*: 2^3 * 3 * 2729


@functools.cache
def _log_tables() -> tuple[IntArray, FloatArray, IntArray]:
    """Discrete log/exp tables of GF(p)* for its smallest generator g (built once, a few ms).

    Returns:
        ``(log, exp, exp_int)``: ``log [p]`` int64 with ``g^log[x] = x`` (``log[0] = 0``, unused);
        ``exp [p]`` float64 with ``exp[e] = g^(e mod (p-1))`` (so ``exp[p-1] = 1``); ``exp_int``
        the same as int64.
    """
    gen = next(g for g in range(2, FIELD_PRIME) if all(pow(g, _ORDER // q, FIELD_PRIME) != 1 for q in (2, 3, 2729)))
    block = np.ones(1, dtype=np.int64)
    step = gen
    while block.size < _ORDER:  # g^[0:2n] = concat(g^[0:n], g^[0:n] * g^n)
        block = np.concatenate([block, block * step % FIELD_PRIME])
        step = step * step % FIELD_PRIME
    exp_int = np.concatenate([block[:_ORDER], np.ones(1, dtype=np.int64)])
    log = np.zeros(FIELD_PRIME, dtype=np.int64)
    log[exp_int[:_ORDER]] = np.arange(_ORDER, dtype=np.int64)
    return log, exp_int.astype(np.float64), exp_int


def _reduce(t: FloatArray) -> FloatArray:
    """Residues of exact non-negative integers ``t < 2^52`` held in float64, in ``[0, p]``.

    The result may be ``p`` itself (≡ 0) when the quotient rounds down at an exact multiple; every
    consumer accepts any representative in ``[0, p]`` and the final outputs go through :func:`_exact`.
    """
    q = np.floor(t * _INV_P)
    return t - q * _P_FLOAT


def _exact(t: FloatArray) -> IntArray:
    """Float64 representatives (exact integers) → int64 residues in ``[0, p)``."""
    return t.astype(np.int64) % FIELD_PRIME


def _powers(x: IntArray, exps: FloatArray) -> FloatArray:
    """``x [..., n]`` residues in ``[0, p)`` → ``[..., n, len(exps)]`` float64 entries ``x^e mod p``.

    ``x^e = g^(log(x)·e mod (p-1))``; the exponent reduction uses the float quotient trick
    (``log(x)·e < 2^40``, so the only rounding case is an exact multiple, which maps to index
    p-1, where the table also holds ``g^0 = 1``).
    """
    log, exp, _ = _log_tables()
    t = log[x].astype(np.float64)[..., None] * exps  # [..., n, len(exps)]
    r = t - np.floor(t * (1.0 / _ORDER)) * _ORDER
    pw: FloatArray = exp[r.astype(np.intp)]
    zero = x == 0
    if zero.any():  # 0^0 = 1, 0^e = 0
        pw[zero] = np.where(exps == 0, 1.0, 0.0)
    return pw


def _split(k: int) -> tuple[int, int]:
    """Baby-step/giant-step sizes ``(b, g)`` with ``b·g ≥ k``, ``b`` a power of two near √k."""
    b = 1 << ((max(k - 1, 1).bit_length() + 1) // 2)
    return b, -(-k // b)


def _bsgs_powers(x: IntArray, k: int) -> tuple[FloatArray, FloatArray]:
    """``x [..., n]`` → baby powers ``x^0 … x^(b-1)`` ``[..., n, b]`` and giant powers
    ``x^0, x^b, …, x^(b(g-1))`` ``[..., n, g]`` for :func:`_split` ``(b, g)`` of ``k``."""
    b, g = _split(k)
    both = _powers(x, np.concatenate([np.arange(b, dtype=np.float64), np.arange(g, dtype=np.float64) * b]))
    return both[..., :b], both[..., b:]


def _matvec(mat: FloatArray, vec: FloatArray) -> FloatArray:
    """``mat [..., a, b] @ vec [..., b]`` reduced to ``[0, p]``; exact while ``b·(p+1)² < 2^52``."""
    return _reduce(np.matmul(mat, vec[..., None])[..., 0])


def _master_poly_tree(x: IntArray) -> FloatArray:
    """``x [C, k]`` residues → ``[C, k+1]`` coefficients (ascending, representatives in ``[0, p]``)
    of ∏(z − x_i) mod p (used once per k to build :func:`_vandermonde_inverse`).

    A balanced tree: the first level forms ``(z − r0)(z − r1)`` directly; each further level
    multiplies neighbouring polynomials as a batched product of a sliding-window (Toeplitz) view
    with the reversed left factor (exact: at most k/2+1 products ≤ (p+1)² per sum).
    """
    c, k = x.shape
    width = 1 << max(1, (k - 1).bit_length())
    roots = np.zeros((c, width), dtype=np.float64)
    roots[:, :k] = x
    r0, r1 = roots[:, 0::2], roots[:, 1::2]  # [C, width/2]
    polys = np.empty((c, width // 2, 3), dtype=np.float64)
    polys[..., 0] = _reduce(r0 * r1)
    polys[..., 1] = 2 * _P_FLOAT - (r0 + r1)
    polys[..., 2] = 1.0
    n_pairs_full, odd = divmod(k, 2)
    if odd:  # (z - r0) * 1
        polys[:, n_pairs_full] = (_P_FLOAT - r0[:, n_pairs_full, None]) * np.array([1.0, 0.0, 0.0]) + np.array([0.0, 1.0, 0.0])
    polys[:, n_pairs_full + odd :] = np.array([1.0, 0.0, 0.0])  # padding factors are the constant 1
    while polys.shape[1] > 1:
        d = polys.shape[2]
        left, right = polys[:, 0::2, :], polys[:, 1::2, :]  # [C, L, d] each
        padded = np.zeros(right.shape[:2] + (3 * d - 2,), dtype=np.float64)
        padded[..., d - 1 : 2 * d - 1] = right
        s0, s1, s2 = padded.strides
        windows = np.ndarray(padded.shape[:2] + (2 * d - 1, d), np.float64, padded, 0, (s0, s1, s2, s2))  # [C, L, 2d-1, d] view
        # conv(left, right)[n] = Σ_i left[i] right[n-i] = windows[n] · reversed(left)
        polys = _matvec(windows, left[..., ::-1])  # [C, L, 2d-1]
    return polys[:, 0, : k + 1]


@functools.cache
def _vandermonde_inverse(k: int) -> FloatArray:
    """``[k+1, k+1]`` float64 inverse mod p of the Vandermonde matrix of the points ``0 … k``:
    row ``e``, column ``j`` is the coefficient of ``z^e`` in the Lagrange basis polynomial of point j."""
    pts = np.tile(np.arange(k + 1, dtype=np.int64), (k + 1, 1))  # [k+1, k+1]
    master = _master_poly_tree(pts)  # [k+1, k+2], all rows equal
    basis = np.eye(k + 1, dtype=np.int64)
    coeffs = _interpolate_with_master(pts, basis, master)  # [k+1 (basis j), k+1 (degree e)]
    return np.ascontiguousarray(coeffs.T).astype(np.float64)


@functools.cache
def _log_diff_table() -> npt.NDArray[np.int32]:
    """``[2p]`` int32 with entry ``d + p`` = log of ``d mod p`` for ``d ≠ 0`` (entry p unused, 0)."""
    log = _log_tables()[0].astype(np.int32)
    return np.concatenate([log, np.zeros(1, dtype=np.int32), log[1:]])


def _master_poly(x: IntArray) -> FloatArray:
    """``x [C, k]`` residues → ``[C, k+1]`` coefficients (representatives in ``[0, p]``) of
    ``M(z) = ∏(z − x_i)`` mod p.

    Evaluates ``M`` at the fixed points ``j = 0 … k`` through discrete logs
    (``M(j) = g^(Σ_i log(j − x_i))``, zero where ``j`` is one of the ``x_i``) and maps the values
    to coefficients with the precomputed inverse Vandermonde matrix of those points.
    """
    k = x.shape[1]
    _, exp, _ = _log_tables()
    pts = np.arange(k + 1, dtype=np.int64)
    logs = _log_diff_table()[pts[None, :, None] - x[:, None, :] + FIELD_PRIME].sum(axis=-1, dtype=np.int64)  # [C, k+1]
    values = exp[logs % _ORDER]  # M(j), [C, k+1]
    hit_rows, hit_cols = np.nonzero(x <= k)
    values[hit_rows, x[hit_rows, hit_cols]] = 0.0  # j = x_i is a root
    return _reduce(np.matmul(values, _vandermonde_inverse(k).T))


def _interpolate_batch(x: IntArray, y: IntArray) -> IntArray:
    """Lagrange interpolation over GF(p), batched.

    Args:
        x: ``[C, k]`` int64 residues in ``[0, p)``, distinct within each row.
        y: ``[C, k]`` int64 values (any non-negative ints; reduced mod p here).

    Returns:
        ``[C, k]`` int64 coefficients, ascending degree, each in ``[0, p)``.

    With ``M(z) = ∏(z − x_i) = Σ a_l z^l`` and weights ``w_i = 1 / M'(x_i)``, the coefficient of
    ``z^j`` is ``Σ_e a_{j+e+1} v_e`` where ``v_e = Σ_i y_i w_i x_i^e`` (synthetic division of ``M``
    by ``z − x_i``, summed over i): baby-step/giant-step products for ``M'(x_i)`` and ``v``, and one
    mat-vec with a Hankel view of ``a``.
    """
    return _interpolate_with_master(x, y, _master_poly(x))


def _interpolate_with_master(x: IntArray, y: IntArray, a: FloatArray) -> IntArray:
    """:func:`_interpolate_batch` given the coefficients ``a [C, k+1]`` of ``∏(z − x_i)``."""
    c, k = x.shape
    log, _, exp_int = _log_tables()
    baby, giant = _bsgs_powers(x, k)  # [C, k, b], [C, k, g]
    d_master = _reduce(a[:, 1:] * np.arange(1, k + 1, dtype=np.float64))  # M' coefficients, [C, k]
    m_prime = _exact(_evaluate_float(d_master, baby, giant))  # M'(x_i) ≠ 0 for distinct x, [C, k]
    weights = exp_int[(-log[m_prime]) % _ORDER]  # 1 / M'(x_i), [C, k]
    yw = ((y % FIELD_PRIME) * weights % FIELD_PRIME).astype(np.float64)  # [C, k]
    v = _power_sums(yw, baby, giant, k)  # Σ_i y_i w_i x_i^e, [C, k]
    a_pad = np.zeros((c, 2 * k + 1), dtype=np.float64)
    a_pad[:, : k + 1] = a
    s0, s1 = a_pad.strides
    hankel = np.ndarray((c, k, k), np.float64, a_pad, s1, (s0, s1, s1))  # view: hankel[:, j, e] = a[j+e+1]
    return _exact(_matvec(hankel, v))


def _evaluate_batch(coeffs: IntArray, x: IntArray) -> IntArray:
    """``coeffs [C, k]``, residues ``x [C, n]`` → ``[C, n]`` values of the polynomials mod p.

    Baby-step/giant-step: ``P(x) = Σ_a x^(ab) Σ_j c_(ab+j) x^j``, one batched matmul and one
    row-wise dot product, never forming the ``[n, k]`` power matrix.
    """
    return _exact(_evaluate_float(coeffs.astype(np.float64), *_bsgs_powers(x, coeffs.shape[-1])))


def _evaluate_float(coeffs: FloatArray, baby: FloatArray, giant: FloatArray) -> FloatArray:
    """``coeffs [C, k]`` (representatives in ``[0, p]``) at the points whose powers are
    ``baby [C, n, b]`` / ``giant [C, n, g]`` → ``[C, n]`` representatives in ``[0, p]``."""
    c, k = coeffs.shape
    b, g = baby.shape[-1], giant.shape[-1]
    cm = np.zeros((c, g * b), dtype=np.float64)
    cm[:, :k] = coeffs
    inner = _reduce(np.matmul(baby, np.swapaxes(cm.reshape(c, g, b), 1, 2)))  # [C, n, g]
    return _reduce(np.einsum("cng,cng->cn", inner, giant))


def _power_sums(weights: FloatArray, baby: FloatArray, giant: FloatArray, k: int) -> FloatArray:
    """``v_e = Σ_i weights_i x_i^e`` for ``e < k`` → ``[C, k]``, from the points' powers
    (``baby [C, n, b]``, ``giant [C, n, g]``): ``v[ab + j] = Σ_i (w_i x_i^j) x_i^(ab)``."""
    c = weights.shape[0]
    scaled = _reduce(baby * weights[..., None])  # [C, n, b]
    table = _reduce(np.matmul(np.swapaxes(scaled, 1, 2), giant))  # [C, b, g]
    return np.swapaxes(table, 1, 2).reshape(c, -1)[:, :k]


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
        raise ToplocError(
            f"a chunk of {last_rows} rows x {h} holds fewer than topk={topk} entries (run spec: hidden_size >= topk)"
        )


def _chunk_groups(hidden: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    """Split ``[T, H]`` into ``[C, chunk_size*H]`` int16 bit views of full chunks (+ the short one)."""
    t, h = hidden.shape
    bits = hidden.detach().contiguous().view(torch.int16)
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
        # Sort key: level (0 above the threshold, 1 tied, 2 below) * 2^40 + flat index.
        level = (vals <= thresh).astype(np.int64) + (vals < thresh)
        chosen = np.sort((level << 40) | idx, axis=1)[:, :k] & ((1 << 40) - 1)  # [C, k]
    if bits.device.type == "cpu":
        y = bits.numpy()[np.arange(chosen.shape[0])[:, None], chosen].astype(np.int64) & 0xFFFF
    else:
        y = torch.gather(bits, 1, torch.from_numpy(chosen).to(bits.device)).cpu().numpy().astype(np.int64) & 0xFFFF
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
    return verify_proofs_many([hidden], [proofs], chunk_size, topk, max_mismatches, max_mant_err_mean, max_mant_err_median)[0]


def verify_proofs_many(
    hiddens: Sequence[torch.Tensor],
    proofs: Sequence[Sequence[bytes]],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    topk: int = DEFAULT_TOPK,
    max_mismatches: int = DEFAULT_MAX_MISMATCHES,
    max_mant_err_mean: float = DEFAULT_MAX_MANT_ERR_MEAN,
    max_mant_err_median: float = DEFAULT_MAX_MANT_ERR_MEDIAN,
) -> list[list[ChunkResult]]:
    """:func:`verify_proofs` of several completions at once: the same results, with the chunks of
    every completion that have the same number of rows verified in one batch (one top-k, one
    polynomial evaluation), so many short completions cost one call's overhead, not one each.

    Args:
        hiddens: per completion ``[T_i, H]`` bfloat16 rows (same ``H``).
        proofs: per completion its proofs, untrusted.
        The others: as :func:`verify_proofs`.

    Returns:
        Per completion its :class:`ChunkResult` list.

    Raises:
        ToplocError: only for the verifier's own inputs.
    """
    if len(hiddens) != len(proofs):
        raise ToplocError("one proof list per completion")

    def rejected(i: int, reason: str) -> ChunkResult:
        return ChunkResult(index=i, mismatches=topk, mant_err_mean=math.inf, mant_err_median=math.inf, ok=False, reason=reason)

    out: list[list[ChunkResult | None]] = []
    parsed: list[list[Proof | str]] = []
    by_width: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # chunk width -> (completion, first chunk, [C, width] bits)
    for i, (hidden, given) in enumerate(zip(hiddens, proofs, strict=True)):
        _check_hidden(hidden, chunk_size, topk)
        n_chunks = math.ceil(hidden.shape[0] / chunk_size)
        if isinstance(given, (bytes, bytearray, str)) or not isinstance(given, Sequence):
            out.append([rejected(r, "proofs must be a list of byte strings") for r in range(n_chunks)])
            parsed.append([])
            continue
        if len(given) != n_chunks:
            reason = f"expected exactly one proof per chunk ({n_chunks}), got {len(given)}"
            out.append([rejected(r, reason) for r in range(n_chunks)])
            parsed.append([])
            continue
        items: list[Proof | str] = []
        for raw in given:
            try:
                items.append(decode_proof(raw, topk))
            except MalformedProofError as exc:
                items.append(f"malformed proof: {exc.reason}")
        parsed.append(items)
        out.append([None] * n_chunks)
        chunk = 0
        for group in _chunk_groups(hidden, chunk_size):
            by_width.setdefault(group.shape[1], []).append((i, chunk, group))
            chunk += group.shape[0]
    for blocks in by_width.values():
        bits = blocks[0][2] if len(blocks) == 1 else torch.cat([g for _, _, g in blocks])  # [C, width]
        x, actual = _select_topk(bits, topk)  # [C, k] each
        owners = [(i, first + j) for i, first, g in blocks for j in range(g.shape[0])]  # (completion, chunk) per row of x
        good = [row for row, (i, r) in enumerate(owners) if isinstance(parsed[i][r], Proof)]
        decoded: dict[int, IntArray] = {}
        if good:
            sel = np.array(good)
            moduli = np.array([parsed[owners[row][0]][owners[row][1]].modulus for row in good], dtype=np.int64)  # type: ignore[union-attr]
            coeffs = np.stack([parsed[owners[row][0]][owners[row][1]].coeffs for row in good])  # type: ignore[union-attr]
            values = _evaluate_batch(coeffs, x[sel] % moduli[:, None])  # [G, k]
            decoded = {row: values[j] for j, row in enumerate(good)}
        for row, (i, r) in enumerate(owners):
            item = parsed[i][r]
            if isinstance(item, str):
                out[i][r] = rejected(r, item)
                continue
            mism, mean, median = _compare(decoded[row], actual[row])
            problems = []
            if mism > max_mismatches:
                problems.append(f"{mism} sign/exponent mismatches > {max_mismatches}")
            if not mean <= max_mant_err_mean:
                problems.append(f"mean mantissa error {mean:.3g} > {max_mant_err_mean}")
            if not median <= max_mant_err_median:
                problems.append(f"median mantissa error {median:.3g} > {max_mant_err_median}")
            out[i][r] = ChunkResult(r, mism, mean, median, ok=not problems, reason="; ".join(problems))
    results = [[res for res in per if res is not None] for per in out]
    bad = sum(not res.ok for per in results for res in per)
    if bad:
        logger.debug("toploc: %d of %d chunks rejected", bad, sum(len(per) for per in results))
    return results
