"""An operator's own base model: `spec init --model-base` reads it and pins `model.base_hash`,
every node refuses other files, and published checkpoints keep the base's format."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from local_model import build_local_model
from safetensors import safe_open

from protocol.models import ModelLoadError, base_hash, check_base_hash, inspect_model_dir, load_model
from protocol.runspec import load_run_spec

pytestmark = pytest.mark.slow  # the module's base model takes ~10 s to build


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from conftest import shared_dir

    data = shared_dir() / "data"
    if not (data / "math").is_dir():
        pytest.skip(f"shared data not found at {data} (set INTELLECT_SHARED)")
    return build_local_model(tmp_path_factory.mktemp("base") / "my-qwen2", data)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=120)


def test_inspect_reads_dtype_hidden_vocab_eos(base):
    info = inspect_model_dir(base)
    assert (info.dtype, info.config_dtype, info.hidden_size, info.vocab_size) == ("bfloat16", "bfloat16", 128, 32768)
    assert info.tokenizer_size == 32768 and info.eos_token_ids == (2,) and info.chat_template


def test_base_hash_covers_every_file_and_name(base, tmp_path):
    h = base_hash(base)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    (copy / ".hidden-note").write_text("not part of the model")
    assert base_hash(copy) == h  # hidden files are not model files
    (copy / "chat_template.jinja").write_text((copy / "chat_template.jinja").read_text() + " ")
    assert base_hash(copy) != h
    with pytest.raises(ModelLoadError, match="model.base_hash") as e:
        check_base_hash(copy, h)
    assert "\n" not in str(e.value)
    renamed = tmp_path / "renamed"
    shutil.copytree(base, renamed)
    (renamed / "generation_config.json").rename(renamed / "generation_config2.json")
    assert base_hash(renamed) != h


def test_spec_init_reads_the_model_directory(base, tmp_path):
    key = tmp_path / "coord.key"
    assert cli("keygen", "--key", str(key)).returncode == 0
    run = tmp_path / "run.toml"
    r = cli("spec", "init", "--coordinator-key", str(key), "--out", str(run), "--model-base", str(base))
    assert r.returncode == 0, r.stderr
    assert "bfloat16" in r.stdout and "vocabulary 32768" in r.stdout and "EOS [2]" in r.stdout
    spec = load_run_spec(run).spec
    assert (spec.model.dtype, spec.model.hidden_size, spec.model.base_hash) == ("bfloat16", 128, base_hash(base))
    bad = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "b.toml"), "--model-base", str(base),
              "--hidden-size", "256")
    assert bad.returncode == 2 and "contradicts" in bad.stderr and "Traceback" not in bad.stderr


def test_coordinator_base_refuses_other_files(base, tmp_path):
    from node.coordinator.base import prepare_base
    from protocol.dataset import resolve_tasks
    from protocol.identity import NodeKey
    from protocol.runspec import ModelSpec, RunInfo, RunSpec

    key = NodeKey.generate()
    spec = RunSpec(run=RunInfo(coordinator=key.peer_id), model=ModelSpec(base=str(base), base_hash=base_hash(base), dtype="bfloat16"))
    tasks = resolve_tasks("embedded")
    assert prepare_base(spec, tasks, tmp_path) == base
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    spec2 = spec.model_copy(update={"model": spec.model.model_copy(update={"base": str(other)})})
    with pytest.raises(ModelLoadError, match="different model files"):
        prepare_base(spec2, tasks, tmp_path)


def test_published_checkpoint_keeps_the_base_format(base, tmp_path):
    from trainer.checkpoint import save_policy, write_base_policy
    from trainer.distributed import DistContext

    step0 = write_base_policy(base, tmp_path / "step-0")
    assert base_hash(tmp_path / "step-0") == base_hash(base)
    assert [p.name for p in step0] == sorted(p.name for p in base.iterdir())
    model = load_model(base)  # float32 masters, as the coordinator hands them to the Trainer
    model.config.use_cache = False  # the trainer's view
    out = tmp_path / "step-1"
    files = save_policy(model, out, DistContext(), dtype=torch.bfloat16, base_dir=base)
    assert sorted(p.name for p in files) == sorted(p.name for p in base.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((base / "config.json").read_text())  # dtype, use_cache kept
    assert (out / "model.safetensors").stat().st_size == (base / "model.safetensors").stat().st_size
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
    reloaded = load_model(out)
    original = load_model(base)
    for (k, a), (_, b) in zip(sorted(reloaded.state_dict().items()), sorted(original.state_dict().items())):
        assert torch.equal(a, b), k
    # a float32 run writes float32 weights and says so
    save_policy(model, tmp_path / "f32", DistContext(), dtype=torch.float32, base_dir=base)
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"


def test_engine_hot_swap_of_a_bf16_checkpoint_computes_in_float32(base):
    """Workers swap weights in place; a bf16 checkpoint must not turn the engine's model bf16 (the
    validator replays in float32, so any other dtype is a false sampling mismatch)."""
    from node.engine.hf import TransformersEngine

    engine = TransformersEngine.from_dir(base)
    engine.load_weights(base)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    fresh = load_model(base)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, fresh(input_ids=ids).logits)


async def test_worker_refuses_a_step_0_that_is_not_the_pinned_base(tmp_path):
    """Workers and validators check a fetched policy step 0 against ``model.base_hash``."""
    from shardcast_fixtures import Run, StaticSources, make_store, serving, write_checkpoint

    from node.errors import FetchError
    from node.policy import PolicyFollower
    from node.shardcast import publish_checkpoint
    from protocol.identity import NodeKey
    from protocol.runspec import ModelSpec, RunInfo, RunSpec, sign_run_spec

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt / "model.safetensors", size_mib=0.1)
    (ckpt / "config.json").write_text('{"model_type": "qwen2"}')
    for pinned, ok in ((base_hash(ckpt), True), ("0" * 64, False)):
        key = NodeKey.generate()
        spec = RunSpec(run=RunInfo(coordinator=key.peer_id), model=ModelSpec(base=str(ckpt), base_hash=pinned))
        run = Run(key, sign_run_spec(spec, key))
        origin = make_store(run, tmp_path / f"origin-{ok}")
        publish_checkpoint(origin, sorted(ckpt.iterdir()), step=0, key=key, piece_size_bytes=spec.shardcast.piece_size_bytes)
        async with serving(origin) as server:
            follower = PolicyFollower(spec, tmp_path / f"fetched-{ok}", StaticSources([server.url]))
            try:
                if ok:
                    assert base_hash(await follower.fetch(0)) == pinned
                else:
                    with pytest.raises(FetchError, match="not the run's base model"):
                        await follower.fetch(0)
                    assert not follower.have(0)
            finally:
                await follower.close()
