"""Tests of protocol.toploc: TOPLOC v1 vectors, GF(p) math, strict parsing, fuzzing."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import toploc
from protocol.errors import ProtocolError

P = toploc.FIELD_PRIME


def _shared_dir() -> Path:
    return Path(os.environ.get("INTELLECT_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))


VECTORS = _shared_dir() / "vectors" / "toploc_v1.json"
VECGEN = _shared_dir() / "vectors" / "vecgen.py"
needs_vectors = pytest.mark.skipif(
    not (VECTORS.is_file() and VECGEN.is_file()),
    reason=f"TOPLOC vectors not found at {VECTORS} (set INTELLECT_SHARED to the shared/ directory)",
)


@pytest.fixture(scope="module")
def vectors() -> dict[str, Any]:
    return json.loads(VECTORS.read_text())


@pytest.fixture(scope="module")
def vecgen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("toploc_vecgen", VECGEN)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bits_to_tensor(bits: list[int], shape: list[int]) -> torch.Tensor:
    arr = np.array(bits, dtype=np.uint16).view(np.int16).copy()
    return torch.from_numpy(arr).view(torch.bfloat16).reshape(*shape)


def _named(vectors: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in vectors["vectors"] if v["name"] == name)


def _decode_input(vec: dict[str, Any], vecgen: ModuleType) -> tuple[list[int], torch.Tensor]:
    seed = vec["input"]["seed"]
    rows, hidden = vec["input"]["shape"]
    bits = vecgen.add_tail(vecgen.gen_bits(seed, rows * hidden, 118, 126), seed + 1, 768)
    digest = hashlib.sha256(np.array(bits, dtype="<u2").tobytes()).hexdigest()
    assert digest == vec["input"]["sha256_le_u16"], "input recipe does not reproduce the vector's input"
    return bits, _bits_to_tensor(bits, [rows, hidden])


@needs_vectors
def test_build_proofs_reproduces_reference_bytes(vectors: dict[str, Any], vecgen: ModuleType) -> None:
    vec = _named(vectors, "decode_only_intellect2_shape")
    _, hidden = _decode_input(vec, vecgen)
    proofs = toploc.build_proofs(hidden, chunk_size=vec["params"]["decode_batching_size"], topk=vec["params"]["topk"])
    assert len(proofs) == len(vec["proofs"])
    for mine, ref in zip(proofs, vec["proofs"], strict=True):
        assert mine.hex() == ref["hex"]
        assert base64.b64encode(mine).decode() == ref["base64"]
        parsed = toploc.decode_proof(mine, ref["n_coeffs"])
        assert parsed.modulus == ref["modulus"]


@needs_vectors
def test_verifier_numbers_equal_reference_where_signs_agree(vectors: dict[str, Any], vecgen: ModuleType) -> None:
    vec = _named(vectors, "decode_only_intellect2_shape")
    bits, hidden = _decode_input(vec, vecgen)
    shape = vec["input"]["shape"]
    proofs = [bytes.fromhex(p["hex"]) for p in vec["proofs"]]
    inputs = {
        "identical": bits,
        "jitter2ulp": vecgen.jitter_bits(bits, 2001, 2),  # jitter keeps the sign bit
        "jitter16ulp": vecgen.jitter_bits(bits, 3000, 16),
    }
    for name, variant in inputs.items():
        results = toploc.verify_proofs(_bits_to_tensor(variant, shape), proofs)
        ref = vec["verify"][f"{name}_tensorpath"]  # upper median, indices reduced mod m: our rule
        for mine, theirs in zip(results, ref, strict=True):
            assert mine.mismatches == theirs["exp_mismatches"], name
            assert mine.mant_err_mean == pytest.approx(theirs["mant_err_mean"], rel=1e-12, abs=0.0), name
            assert mine.mant_err_median == theirs["mant_err_median"], name
    assert all(r.ok for r in toploc.verify_proofs(hidden, proofs))


@needs_vectors
def test_unrelated_input_is_rejected_and_signs_count(vectors: dict[str, Any], vecgen: ModuleType) -> None:
    vec = _named(vectors, "decode_only_intellect2_shape")
    rows, hidden_size = vec["input"]["shape"]
    other = vecgen.add_tail(vecgen.gen_bits(500001, rows * hidden_size, 118, 126), 500002, 768)
    results = toploc.verify_proofs(_bits_to_tensor(other, [rows, hidden_size]), [bytes.fromhex(p["hex"]) for p in vec["proofs"]])
    ref = vec["verify"]["unrelated_tensorpath"]
    for mine, theirs in zip(results, ref, strict=True):
        assert not mine.ok and mine.reason
        assert mine.mismatches >= theirs["exp_mismatches"]  # we also compare sign bits
    assert math.isinf(results[0].mant_err_mean) and math.isinf(results[0].mant_err_median)


@needs_vectors
def test_poly_only_vector_through_interpolate(vectors: dict[str, Any]) -> None:
    vec = _named(vectors, "poly_only")
    m = toploc.find_modulus(vec["x"])
    assert m == vec["modulus"]
    xs = [x % m for x in vec["x"]]
    coeffs = toploc.interpolate(xs, vec["y"])
    assert coeffs == vec["coeffs"]
    raw = toploc.encode_proof(m, coeffs)
    assert raw.hex() == vec["bytes_hex"]
    assert base64.b64encode(raw).decode() == vec["base64"]
    assert toploc.evaluate(coeffs, xs) == vec["eval_at_x_mod_m"]
    with pytest.raises(toploc.MalformedProofError):  # the reference's "null proof" is not a proof
        toploc.decode_proof(bytes.fromhex(vec["null_proof_k4_hex"]), topk=4)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_interpolate_then_evaluate_roundtrip(k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    xs = rng.choice(P, size=k, replace=False)
    ys = rng.integers(0, 1 << 16, size=k)
    coeffs = toploc.interpolate(xs, ys)
    assert len(coeffs) == k and all(0 <= c < P for c in coeffs)
    assert toploc.evaluate(coeffs, xs) == [int(y) % P for y in ys]


def test_interpolate_matches_schoolbook_lagrange() -> None:
    xs, ys = [0, 1, 5, 65496, 1234], [7, 65535, 3, 0, 42]

    def mul(a: list[int], b: list[int]) -> list[int]:
        out = [0] * (len(a) + len(b) - 1)
        for i, ai in enumerate(a):
            for j, bj in enumerate(b):
                out[i + j] = (out[i + j] + ai * bj) % P
        return out

    total = [0] * len(xs)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        basis, denom = [1], 1
        for j, xj in enumerate(xs):
            if j != i:
                basis = mul(basis, [(-xj) % P, 1])
                denom = denom * (xi - xj) % P
        scale = yi * pow(denom, P - 2, P) % P
        total = [(t + scale * b) % P for t, b in zip(total, basis)]
    assert toploc.interpolate(xs, ys) == total


def test_find_modulus_searches_downward() -> None:
    assert toploc.find_modulus([1, 2, 3]) == P
    assert toploc.find_modulus([0, P]) == P - 1
    xs = [0, P, P - 1, 2 * (P - 1)]
    brute = next(m for m in range(P, 0, -1) if len({x % m for x in xs}) == len(xs))
    assert toploc.find_modulus(xs) == brute == P - 3
    with pytest.raises(toploc.ToplocError):
        toploc.find_modulus([4, 4])


def test_topk_ties_break_to_lower_index() -> None:
    hidden = torch.zeros(2, 128, dtype=torch.bfloat16)
    hidden[0, :] = 1.0
    hidden[1, :] = -1.0  # 256 equal magnitudes: the first 128 flat indices win
    proof = toploc.build_proofs(hidden, chunk_size=2, topk=128)[0]
    parsed = toploc.decode_proof(proof)
    values = toploc.evaluate(parsed.coeffs, [i % parsed.modulus for i in range(128)])
    assert values == [0x3F80] * 128  # +1.0 at indices 0..127
    flipped = hidden.clone()
    flipped[0, :] = -1.0
    result = toploc.verify_proofs(flipped, [proof], chunk_size=2)[0]
    assert result.mismatches == 128 and not result.ok  # the reference would accept: it ignores signs


def test_chunking_and_short_last_chunk() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(70, 256).to(torch.bfloat16)
    proofs = toploc.build_proofs(hidden)
    assert len(proofs) == 3 and all(len(p) == toploc.proof_size_bytes() == 258 for p in proofs)
    assert proofs[1] == toploc.build_proofs(hidden[32:64])[0]
    assert proofs[2] == toploc.build_proofs(hidden[64:])[0]
    results = toploc.verify_proofs(hidden, proofs)
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.ok and r.mismatches == 0 and r.mant_err_mean == 0.0 and r.reason == "" for r in results)


def test_sign_flip_and_swapped_chunks_rejected() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(64, 256).to(torch.bfloat16)
    proofs = toploc.build_proofs(hidden)
    assert not any(r.ok for r in toploc.verify_proofs(-hidden, proofs))
    assert not any(r.ok for r in toploc.verify_proofs(hidden, proofs[::-1]))


def test_small_noise_within_thresholds() -> None:
    torch.manual_seed(2)
    base = torch.randn(64, 512)
    proofs = toploc.build_proofs(base.to(torch.bfloat16))
    noisy = (base * (1 + 2e-3 * torch.randn_like(base))).to(torch.bfloat16)
    assert all(r.ok for r in toploc.verify_proofs(noisy, proofs))


def test_thresholds_are_parameters() -> None:
    torch.manual_seed(3)
    base = torch.randn(32, 512)
    proofs = toploc.build_proofs(base.to(torch.bfloat16))
    noisy = (base * (1 + 0.03 * torch.randn_like(base))).to(torch.bfloat16)
    loose = toploc.verify_proofs(noisy, proofs)[0]
    strict = toploc.verify_proofs(noisy, proofs, max_mismatches=0, max_mant_err_mean=0.0, max_mant_err_median=0.0)[0]
    assert loose.ok and not strict.ok and ("mismatch" in strict.reason or "mantissa" in strict.reason)


def test_rows_for_completion() -> None:
    assert toploc.rows_for_completion(5, 3) == slice(4, 7)
    seq = list(range(10))
    assert seq[toploc.rows_for_completion(1, 9)] == list(range(9))
    with pytest.raises(ValueError):
        toploc.rows_for_completion(0, 3)


def test_bad_hidden_raises_toploc_error() -> None:
    with pytest.raises(toploc.ToplocError):
        toploc.build_proofs(torch.randn(4, 256))  # float32
    with pytest.raises(toploc.ToplocError):
        toploc.build_proofs(torch.randn(33, 64).to(torch.bfloat16))  # last chunk: 1 row x 64 < 128
    with pytest.raises(toploc.ToplocError):
        toploc.build_proofs(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert issubclass(toploc.ToplocError, ProtocolError)


def test_strict_parser_reasons() -> None:
    good = toploc.build_proofs(torch.randn(32, 256).to(torch.bfloat16))[0]
    cases = {
        b"": "expected exactly 258",
        good[:-1]: "expected exactly 258",
        good + b"\x00": "expected exactly 258",
        b"\x00\x00" + good[2:]: "modulus 0",
        b"\xff\xda" + good[2:]: "modulus 65498",
        good[:2] + b"\xff\xd9" + good[4:]: "coefficient 0 is 65497",
        good[:-2] + b"\xff\xff": "coefficient 127 is 65535",
    }
    for raw, expected in cases.items():
        with pytest.raises(toploc.MalformedProofError) as info:
            toploc.decode_proof(raw)
        assert expected in info.value.reason
    with pytest.raises(toploc.MalformedProofError):
        toploc.decode_proof("00" * 129)  # type: ignore[arg-type]


def test_wrong_proof_count_rejects_every_chunk() -> None:
    hidden = torch.randn(64, 256).to(torch.bfloat16)
    proofs = toploc.build_proofs(hidden)
    for bad in (proofs[:1], proofs + proofs[:1], [], b"".join(proofs), None):
        results = toploc.verify_proofs(hidden, bad)  # type: ignore[arg-type]
        assert len(results) == 2 and all(not r.ok and r.reason for r in results)


def test_fuzz_malformed_and_mutated_proofs_never_crash() -> None:
    """≥ 10,000 random and mutated proofs against one chunk: each rejected with a reason."""
    torch.manual_seed(4)
    hidden = torch.randn(32, 256).to(torch.bfloat16)
    good = toploc.build_proofs(hidden)[0]
    rng = np.random.default_rng(5)
    candidates: list[Any] = []
    for i in range(10_500):
        kind = i % 7
        if kind == 0:  # random bytes of a random length
            candidates.append(rng.integers(0, 256, size=int(rng.integers(0, 600)), dtype=np.uint8).tobytes())
        elif kind == 1:  # random bytes of the exact length
            candidates.append(rng.integers(0, 256, size=258, dtype=np.uint8).tobytes())
        elif kind == 2:  # truncated or extended
            cut = int(rng.integers(0, 258))
            candidates.append(
                good[:cut]
                if rng.random() < 0.5
                else good + bytes(rng.integers(1, 50, dtype=np.uint8, size=int(rng.integers(1, 8))))
            )
        elif kind == 3:  # modulus out of range
            candidates.append(int(rng.choice([0, int(rng.integers(P + 1, 1 << 16))])).to_bytes(2, "big") + good[2:])
        elif kind == 4:  # one coefficient pushed to >= p
            j = int(rng.integers(0, 128))
            candidates.append(good[: 2 + 2 * j] + int(rng.integers(P, 1 << 16)).to_bytes(2, "big") + good[4 + 2 * j :])
        elif kind == 5:  # a valid-looking proof with bits flipped in non-constant coefficients (kept < p)
            # (c_0 is spared: adding a small constant to every decoded value is, by design, within tolerance)
            words = np.frombuffer(good, dtype=">u2").astype(np.int64).copy()
            for j in rng.choice(np.arange(2, 129), size=int(rng.integers(1, 6)), replace=False):
                words[j] = (words[j] ^ (1 << int(rng.integers(0, 15)))) % P
            words[0] = int(rng.integers(1, P + 1)) if rng.random() < 0.3 else words[0]
            candidates.append(words.astype(">u2").tobytes())
        else:  # wrong types
            candidates.append(rng.choice(np.array([None, 5, "proof", 1.5, [1, 2]], dtype=object)))
    assert len(candidates) >= 10_000
    rejected = 0
    for i in range(0, len(candidates), 500):  # one verify call per 500 proofs: 500 chunks of the same rows
        batch = candidates[i : i + 500]
        results = toploc.verify_proofs(hidden.repeat(len(batch), 1), batch)
        assert len(results) == len(batch)
        for res in results:
            assert not res.ok and res.reason, res
            rejected += 1
    assert rejected == len(candidates)


def test_verify_proofs_many_equals_one_call_per_completion() -> None:
    """Batching completions (full chunks and short last chunks of several lengths together) gives
    each completion the results its own call gives: honest, perturbed, malformed, a wrong count,
    wrong types."""
    g = torch.Generator().manual_seed(31)
    hiddens = [torch.randn(n, 128, generator=g).to(torch.bfloat16) for n in (3, 32, 40, 3, 70, 1)]
    proofs: list = [toploc.build_proofs(h) for h in hiddens]
    checked = [h.clone() for h in hiddens]
    checked[1] = (checked[1].float() * 1.5).to(torch.bfloat16)  # a different model: rejected
    proofs[2] = [proofs[2][0], b"\x00" * 5]  # the second chunk malformed
    proofs[3] = proofs[3] + proofs[3]  # one proof too many
    proofs[5] = b"not a list"
    many = toploc.verify_proofs_many(checked, proofs)
    one = [toploc.verify_proofs(h, p) for h, p in zip(checked, proofs, strict=True)]
    assert many == one
    assert [all(r.ok for r in res) for res in many] == [True, False, False, False, True, False]
    assert toploc.verify_proofs_many([], []) == []
    with pytest.raises(toploc.ToplocError):
        toploc.verify_proofs_many(hiddens[:2], proofs[:1])
