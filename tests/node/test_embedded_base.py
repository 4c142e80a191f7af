"""The shipped embedded base: the devnet's default step 0 is the package's own file, the same bytes
on every machine, checked before use, with no warm start at run time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import node.coordinator.base as base_mod
from protocol.dataset import resolve_tasks
from protocol.identity import NodeKey
from protocol.models import ModelLoadError, base_hash, embedded_tokenizer, load_model
from protocol.runspec import ModelSpec, RunInfo, RunSpec

SPEC = RunSpec(run=RunInfo(coordinator=NodeKey.from_seed(b"c" * 32).peer_id))


def test_default_spec_uses_the_shipped_base_without_a_warm_start(tmp_path, monkeypatch):
    def no_warm_start(*a, **k):
        raise AssertionError("the shipped base must not be warm-started at run time")

    monkeypatch.setattr(base_mod, "warm_start", no_warm_start)
    monkeypatch.setenv("INTELLECT_CACHE", str(tmp_path / "empty-cache"))
    assert base_mod.uses_shipped_base(SPEC)
    out = base_mod.prepare_base(SPEC, resolve_tasks("embedded"), tmp_path / "run")
    assert base_hash(out) == base_mod.EMBEDDED_BASE_HASH == base_hash(base_mod.EMBEDDED_BASE_DIR)
    assert not (tmp_path / "empty-cache").exists()  # nothing machine-specific was built
    model = load_model(out)
    assert model.config.hidden_size == 128 and model.config.vocab_size == len(embedded_tokenizer())
    assert base_mod.prepare_base(SPEC, resolve_tasks("embedded"), tmp_path / "run") == out  # a second call reuses the copy


def test_changed_shipped_base_is_refused(tmp_path, monkeypatch):
    changed = tmp_path / "embedded_base"
    shutil.copytree(base_mod.EMBEDDED_BASE_DIR, changed)
    blob = bytearray((changed / "model.safetensors").read_bytes())
    blob[-1] ^= 1  # one bit of one weight
    (changed / "model.safetensors").write_bytes(bytes(blob))
    monkeypatch.setattr(base_mod, "EMBEDDED_BASE_DIR", changed)
    with pytest.raises(ModelLoadError, match="shipped embedded base .* scripts/build_embedded_base.py"):
        base_mod.prepare_base(SPEC, resolve_tasks("embedded"), tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_other_shapes_still_warm_start_on_one_thread(tmp_path, monkeypatch):
    import torch

    seen = []
    real = base_mod.warm_start

    def spy(model, examples, config):
        seen.append(torch.get_num_threads())
        return real(model, examples, base_mod.WarmStartConfig(steps=2, batch_size=4, learning_rate=1e-3, seed=0))

    monkeypatch.setattr(base_mod, "warm_start", spy)
    monkeypatch.setenv("INTELLECT_CACHE", str(tmp_path / "cache"))
    spec = SPEC.model_copy(update={"model": ModelSpec(hidden_size=256)})
    assert not base_mod.uses_shipped_base(spec)
    out = base_mod.prepare_base(spec, resolve_tasks("embedded"), tmp_path / "run")
    assert seen == [base_mod.WARM_START_THREADS] and load_model(out).config.hidden_size == 256
    assert base_hash(out) == base_hash(next((tmp_path / "cache" / "bases").iterdir()))


def test_missing_model_directory_is_reported_as_missing(tmp_path):
    spec = SPEC.model_copy(update={"model": ModelSpec(base=str(tmp_path / "my-qwen2"))})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        base_mod.prepare_base(spec, resolve_tasks("embedded"), tmp_path / "run")
