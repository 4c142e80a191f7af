"""Shardcast step deltas: byte format round trips, bounds, refusals and the delta manifest."""

from __future__ import annotations

import hashlib
import io
import struct

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save

from protocol.delta import (
    BLOCK_CHANGES,
    MAGIC,
    DeltaFormatError,
    DeltaMismatchError,
    apply_delta,
    check_delta_links,
    encode_delta,
    iter_delta_pieces,
    open_delta_manifest,
    unzigzag16,
    zigzag16,
)
from protocol.envelope import open_envelope, seal
from protocol.errors import ProtocolError, SchemaError, SignatureError
from protocol.identity import NodeKey
from protocol.messages import DeltaManifest, Manifest
from protocol.runspec import RunInfo, RunSpec
from protocol.shardcast import MIN_PIECE_SIZE_BYTES, build_manifest

P = MIN_PIECE_SIZE_BYTES


@pytest.fixture(scope="module")
def run():
    key = NodeKey.generate()
    spec = RunSpec(run=RunInfo(coordinator=key.peer_id))
    return key, spec


def _manifest(step: int, files: dict[str, bytes]) -> Manifest:
    return build_manifest(step, [(n, io.BytesIO(b)) for n, b in files.items()], piece_size_bytes=P)


def _weights(seed: int, n: int = 300_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": (torch.randn(n // 1000, 1000, generator=g) * 0.02).to(torch.bfloat16),
        "b.bias": torch.ones(77, dtype=torch.bfloat16),
        "c.weight": torch.randn(3, 5, generator=g).to(torch.float32),
    }


def _perturb(w: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in w.items():
        bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)
        mask = torch.rand(t.shape, generator=g) < frac
        out[k] = torch.where(mask, bits + 1, bits).view(t.dtype)
    return out


def _roundtrip(base_files: dict[str, bytes], target_files: dict[str, bytes]):
    base, target = _manifest(1, base_files), _manifest(2, target_files)
    comp = io.BytesIO()
    stats = encode_delta(base, target, lambda n: io.BytesIO(base_files[n]), lambda n: io.BytesIO(target_files[n]), comp)
    dm = _delta_manifest(base, target, comp.getvalue(), stats.raw_size_bytes)
    outs: dict[str, io.BytesIO] = {}

    def open_out(f):
        outs[f.name] = io.BytesIO()
        return outs[f.name]

    applied = apply_delta(io.BytesIO(comp.getvalue()), delta=dm, base=base, target=target,
                          open_base=lambda n: io.BytesIO(base_files[n]), open_out=open_out)
    return stats, applied, {k: v.getvalue() for k, v in outs.items()}, comp.getvalue(), dm, base, target


def _delta_manifest(base: Manifest, target: Manifest, data: bytes, raw: int, *, base_id=b"\1" * 32, target_id=b"\2" * 32) -> DeltaManifest:
    pieces = [hashlib.sha256(data[i:i + P]).digest() for i in range(0, len(data), P)]
    return DeltaManifest(step=target.step, base_step=base.step, base_manifest_id=base_id, target_manifest_id=target_id,
                         piece_size_bytes=P, size_bytes=len(data), raw_size_bytes=raw, pieces=pieces,
                         delta_hash=hashlib.sha256(data).digest())


def test_bit_exact_roundtrip_all_kinds():
    w0 = _weights(0)
    w1 = _perturb(w0, 0.01, 1)
    base_files = {"config.json": b'{"a": 1}', "model.safetensors": save(w0), "tok.json": b"x" * 1000}
    target_files = {"config.json": b'{"a": 2}', "model.safetensors": save(w1), "tok.json": b"x" * 1000, "new.txt": b"hello"}
    stats, applied, out, comp, *_ = _roundtrip(base_files, target_files)
    assert out == target_files
    assert stats.files_same == 1 and stats.files_words == 2 and stats.files_literal == 1  # config.json: same even size
    changed = sum(int((w0[k].view(torch.int16 if w0[k].dtype == torch.bfloat16 else torch.int32) !=
                       w1[k].view(torch.int16 if w1[k].dtype == torch.bfloat16 else torch.int32)).sum()) for k in w0)
    assert applied.changed_elements == stats.changed_elements >= changed  # an fp32 change may touch 2 words
    assert len(comp) < len(target_files["model.safetensors"]) / 20


def test_zigzag_codes_every_difference():
    d = np.arange(1 << 16, dtype=np.uint16)
    z = zigzag16(d)
    assert sorted(z.tolist()) == list(range(1 << 16)) and (unzigzag16(z) == d).all()
    assert zigzag16(np.array([1, 0xFFFF, 0], np.uint16)).tolist() == [2, 1, 0]  # +1, -1 ulp, none


def test_many_blocks_and_wrapping_values():
    base = np.random.default_rng(0).integers(0, 1 << 16, 3 * BLOCK_CHANGES + 17, dtype=np.uint16)
    target = base.copy()
    target[::1] += np.uint16(0x8001)  # every word changes; values wrap mod 2^16
    bf, tf = {"w.bin": base.tobytes()}, {"w.bin": target.tobytes()}
    stats, _, out, *_ = _roundtrip(bf, tf)
    assert out == tf and stats.changed_elements == len(base)


def test_identical_and_odd_sized_files():
    bf = {"model.safetensors": save(_weights(3)), "odd.bin": b"abc", "same.jinja": b"{{ x }}"}
    tf = {"model.safetensors": bf["model.safetensors"], "odd.bin": b"abd", "same.jinja": b"{{ x }}"}
    stats, _, out, *_ = _roundtrip(bf, tf)
    assert out == tf and stats.files_same == 2 and stats.files_literal == 1 and stats.changed_elements == 0  # odd size can be SAME


def _body_delta(body: bytes, base_files, target_files):
    base, target = _manifest(1, base_files), _manifest(2, target_files)
    comp = zstandard.ZstdCompressor().compress(body)
    dm = _delta_manifest(base, target, comp, len(body))
    return comp, dm, base, target


def _apply(comp, dm, base, target, base_files):
    return apply_delta(io.BytesIO(comp), delta=dm, base=base, target=target,
                       open_base=lambda n: io.BytesIO(base_files[n]), open_out=lambda f: io.BytesIO())


def test_malformed_bodies_refused_with_reason():
    bf, tf = {"w.bin": bytes(64)}, {"w.bin": bytes(62) + b"\1\0"}
    head = MAGIC + struct.pack("<I", 1) + bytes([5]) + b"w.bin" + struct.pack("<BQ", 2, 64)
    good = head + struct.pack("<I", 1) + struct.pack("<Q", 32) + struct.pack("<I", 1) + struct.pack("<I", 32) + struct.pack("<H", 2) + struct.pack("<I", 0)
    _apply(*_body_delta(good, bf, tf), bf)  # the hand-written body is valid
    cases = {
        "bad magic": b"XXXX" + good[4:],
        "beyond its": good.replace(struct.pack("<I", 32) + struct.pack("<H", 2), struct.pack("<I", 33) + struct.pack("<H", 2)),
        "zero gap": good.replace(struct.pack("<I", 32) + struct.pack("<H", 2), struct.pack("<I", 0) + struct.pack("<H", 2)),
        "at most": good.replace(struct.pack("<Q", 32) + struct.pack("<I", 1), struct.pack("<Q", 32) + struct.pack("<I", BLOCK_CHANGES + 1)),
        "cover": head + struct.pack("<I", 1) + struct.pack("<Q", 16) + struct.pack("<I", 0),
        "past the declared|ends inside": good[:-6],
        "unknown kind": good.replace(struct.pack("<BQ", 2, 64), struct.pack("<BQ", 9, 64)),
        "target manifest has": good.replace(b"w.bin", b"v.bin"),
    }
    for reason, body in cases.items():
        with pytest.raises(DeltaFormatError, match=reason):
            _apply(*_body_delta(body, bf, tf), bf)
    comp, dm, base, target = _body_delta(good, bf, tf)
    with pytest.raises(DeltaFormatError, match="past the declared"):
        _apply(comp, dm.model_copy(update={"raw_size_bytes": len(good) - 3}), base, target, bf)
    with pytest.raises(DeltaFormatError, match="the manifest says"):
        _apply(comp, dm.model_copy(update={"raw_size_bytes": len(good) + 3}), base, target, bf)
    with pytest.raises(DeltaFormatError, match="zstd"):
        _apply(b"not a zstd frame at all", dm, base, target, bf)


def test_result_not_matching_full_manifest_is_refused():
    w0 = _weights(5)
    bf, tf = {"model.safetensors": save(w0)}, {"model.safetensors": save(_perturb(w0, 0.01, 6))}
    _, _, _, comp, dm, base, target = _roundtrip(bf, tf)
    other = _manifest(2, {"model.safetensors": save(_perturb(w0, 0.01, 7))})
    with pytest.raises(DeltaMismatchError) as e:
        _apply(comp, dm, base, other, bf)
    assert e.value.file_name == "model.safetensors"
    wrong_base = {"model.safetensors": save(_perturb(w0, 0.001, 8))}
    with pytest.raises(DeltaMismatchError):
        _apply(comp, dm, base, target, wrong_base)
    with pytest.raises(DeltaMismatchError, match="shorter"):
        _apply(comp, dm, base, target, {"model.safetensors": bf["model.safetensors"][:1000]})


def test_random_corruption_never_escapes_protocol_errors():
    w0 = _weights(9, 20_000)
    bf, tf = {"model.safetensors": save(w0)}, {"model.safetensors": save(_perturb(w0, 0.05, 10))}
    base, target = _manifest(1, bf), _manifest(2, tf)
    comp = io.BytesIO()
    stats = encode_delta(base, target, lambda n: io.BytesIO(bf[n]), lambda n: io.BytesIO(tf[n]), comp)
    body = zstandard.ZstdDecompressor().decompressobj().decompress(comp.getvalue())
    assert len(body) == stats.raw_size_bytes
    rng = np.random.default_rng(0)
    for _ in range(200):
        b = bytearray(body)
        for i in rng.integers(0, len(b), 3):
            b[i] ^= int(rng.integers(1, 256))
        c, dm, _, _ = _body_delta(bytes(b), bf, tf)
        try:
            _apply(c, dm, base, target, bf)
        except ProtocolError:
            continue
        raise AssertionError("a corrupted body was accepted")


def test_delta_manifest_signed_and_linked(run):
    key, spec = run
    bf, tf = {"w.bin": bytes(64)}, {"w.bin": bytes(62) + b"\1\0"}
    base_m, target_m = _manifest(1, bf), _manifest(2, tf)
    base_env = open_envelope(seal(key, spec.run_id, base_m), run_id=spec.run_id, authorities=spec.authorities, expect=Manifest)
    target_env = open_envelope(seal(key, spec.run_id, target_m), run_id=spec.run_id, authorities=spec.authorities, expect=Manifest)
    data = b"z" * (P + 10)
    dm = _delta_manifest(base_m, target_m, data, 100, base_id=hashlib.sha256(base_env.raw).digest(),
                         target_id=hashlib.sha256(target_env.raw).digest())
    env = open_delta_manifest(seal(key, spec.run_id, dm), run_id=spec.run_id, authorities=spec.authorities)
    check_delta_links(env.body, base_env, target_env)
    assert [p.size_bytes for p in iter_delta_pieces(env.body)] == [P, 10]
    with pytest.raises(SchemaError, match="not based"):
        check_delta_links(env.body, target_env, target_env)
    with pytest.raises(SchemaError, match="does not lead"):
        check_delta_links(env.body, base_env, base_env)
    with pytest.raises(SignatureError):
        open_delta_manifest(seal(NodeKey.generate(), spec.run_id, dm), run_id=spec.run_id, authorities=spec.authorities)
    with pytest.raises(SchemaError, match="needs 2 pieces"):
        open_delta_manifest(seal(key, spec.run_id, dm.model_copy(update={"pieces": dm.pieces[:1]})), run_id=spec.run_id,
                            authorities=spec.authorities)
    with pytest.raises(SchemaError, match="not before"):
        open_delta_manifest(seal(key, spec.run_id, dm.model_copy(update={"base_step": 2})), run_id=spec.run_id,
                            authorities=spec.authorities)
