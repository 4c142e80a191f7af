"""The one model builder and the one writer of a model directory (``protocol.models``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2Config

from protocol.models import (
    ModelLoadError,
    base_hash,
    build_model,
    copy_model,
    copy_weights,
    embedded_config,
    embedded_tokenizer,
    head_weight,
    iter_weights,
    load_model,
    model_files,
    save_model,
)


def _untied_config() -> Qwen2Config:
    return Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("make_config", [lambda: embedded_config(99, hidden_size=32), _untied_config])
def test_same_config_and_seed_build_the_same_tensors_whatever_the_callers_rng(make_config):
    torch.manual_seed(1)
    first = _tensors(build_model(make_config(), seed=7))
    torch.manual_seed(2)
    torch.rand(5)  # a caller that drew before
    second = build_model(make_config(), seed=7)
    assert _equal(first, _tensors(second))
    assert not _equal(first, _tensors(build_model(make_config(), seed=8)))
    assert {p.dtype for p in second.parameters()} == {torch.float32}
    assert not second.training and second.config._attn_implementation == "sdpa"


def test_building_leaves_the_callers_rng_and_config_alone():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    config = _untied_config()
    config._attn_implementation = "eager"  # e.g. a live policy's config, handed to build a cheap copy
    build_model(config, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert config._attn_implementation == "eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_a_written_model_loads_back_equal_to_its_source(tmp_path, dtype, tied):
    tok = embedded_tokenizer()
    config = embedded_config(len(tok), hidden_size=32) if tied else _untied_config()
    model = build_model(config, seed=0)
    files = save_model(model, tok, tmp_path / "m", dtype=dtype)
    assert files == model_files(tmp_path / "m")  # what a Shardcast manifest lists
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as st:
        names = st.keys()
        assert {st.get_slice(k).get_dtype() for k in names} == {"F32" if dtype == torch.float32 else "BF16"}
        assert ("lm_head.weight" in names) is not tied  # a tied head is stored once
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = load_model(tmp_path / "m")
    want = {k: v.to(dtype).to(torch.float32) for k, v in _tensors(model).items()}
    assert _equal(_tensors(loaded), want)


@pytest.mark.parametrize("tied", [True, False])
def test_copy_weights_swaps_a_checkpoint_in_place_tensor_by_tensor(tmp_path, tied):
    """A worker's weight swap: the same parameter tensors (no second model in memory), now holding
    the bf16 checkpoint's values cast to float32; a tied head still follows the embedding."""
    tok = embedded_tokenizer()
    config = embedded_config(len(tok), hidden_size=32) if tied else _untied_config()
    engine_model = build_model(config, seed=0)
    save_model(build_model(config, seed=1), tok, tmp_path / "next", dtype=torch.bfloat16)
    before = {k: v.data_ptr() for k, v in engine_model.state_dict().items()}
    copy_weights(engine_model, tmp_path / "next")
    assert {k: v.data_ptr() for k, v in engine_model.state_dict().items()} == before  # in place
    assert _equal(_tensors(engine_model), _tensors(load_model(tmp_path / "next")))
    assert {p.dtype for p in engine_model.parameters()} == {torch.float32}
    if tied:
        assert engine_model.lm_head.weight.data_ptr() == engine_model.model.embed_tokens.weight.data_ptr()


def test_copy_weights_refuses_a_checkpoint_of_another_shape(tmp_path):
    tok = embedded_tokenizer()
    save_model(build_model(embedded_config(len(tok), hidden_size=32), seed=1), tok, tmp_path / "small", dtype=torch.bfloat16)
    with pytest.raises(ModelLoadError, match="is \\("):
        copy_weights(build_model(embedded_config(len(tok), hidden_size=64), seed=0), tmp_path / "small")
    save_model(build_model(_untied_config(), seed=1), tok, tmp_path / "untied")
    with pytest.raises(ModelLoadError, match="unexpected|is \\("):
        copy_weights(build_model(embedded_config(len(tok), hidden_size=32), seed=0), tmp_path / "untied")


def test_without_dtype_the_config_is_written_as_transformers_writes_it(tmp_path):
    """The embedded base is written this way; its bytes (and so its ``base_hash``) must not move."""
    tok = embedded_tokenizer()
    model = build_model(embedded_config(len(tok), hidden_size=32), seed=0)
    save_model(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").read_text() == model.config.to_json_string()


def test_the_trainers_kv_cache_switch_is_not_published(tmp_path):
    model = build_model(_untied_config(), seed=0)
    model.config.use_cache = False
    state = {k: v * 2 for k, v in model.state_dict().items()}  # a gathered state dict, not the module's own
    save_model(model, None, tmp_path / "m", state=state, dtype=torch.float32)
    assert "use_cache" not in json.loads((tmp_path / "m" / "config.json").read_text())
    assert _equal(_tensors(load_model(tmp_path / "m")), state)


def test_a_policy_written_against_a_base_carries_its_files(tmp_path):
    tok = embedded_tokenizer()
    base = tmp_path / "base"
    save_model(build_model(embedded_config(len(tok), hidden_size=32), seed=0), tok, base)
    (base / "generation_config.json").write_text('{"eos_token_id": 1}\n')
    (base / "chat_template.jinja").write_text("{{ messages }}")
    (base / ".hidden").write_text("not a model file")
    step0 = copy_model(base, tmp_path / "step-0")
    assert [p.name for p in step0] == [p.name for p in model_files(base)]
    assert base_hash(tmp_path / "step-0") == base_hash(base)
    model = build_model(embedded_config(len(tok), hidden_size=32), seed=1)
    files = save_model(model, None, tmp_path / "step-1", dtype=torch.bfloat16, base_dir=base)
    assert [p.name for p in files] == [p.name for p in model_files(base)]
    for name in ("generation_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "step-1" / name).read_bytes() == (base / name).read_bytes()
    cfg, base_cfg = json.loads((tmp_path / "step-1" / "config.json").read_text()), json.loads((base / "config.json").read_text())
    assert cfg.pop("dtype") == "bfloat16"
    base_cfg.pop("dtype", None)
    assert cfg == base_cfg


def test_config_int_reads_model_sizes_and_refuses_what_is_no_transformers_model() -> None:
    from protocol.models import ModelLoadError, build_model, config_int, embedded_config

    model = build_model(embedded_config(99, hidden_size=128))
    assert (config_int(model, "vocab_size"), config_int(model, "hidden_size")) == (99, 128)
    assert model.get_input_embeddings().num_embeddings == 99  # the bound the coordinator's buffer used before
    for bad, name in ((torch.nn.Linear(2, 2), "vocab_size"), (model, "tie_word_embeddings"), (model, "no_such_field")):
        with pytest.raises(ModelLoadError, match=name):
            config_int(bad, name)


def test_the_one_weights_reader_merges_files_and_refuses_bad_ones(tmp_path):
    save_file({"b": torch.ones(2)}, str(tmp_path / "2.safetensors"))
    save_file({"a": torch.zeros(3, dtype=torch.bfloat16)}, str(tmp_path / "1.safetensors"))
    (tmp_path / "model.bin").write_bytes(b"never unpickled")
    state = dict(iter_weights(tmp_path))
    assert list(state) == ["a", "b"] and state["a"].dtype == torch.bfloat16 and torch.equal(state["b"], torch.ones(2))
    save_file({"a": torch.ones(1)}, str(tmp_path / "3.safetensors"))
    with pytest.raises(ModelLoadError, match="more than one"):
        dict(iter_weights(tmp_path))
    (tmp_path / "3.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelLoadError, match="cannot read"):
        dict(iter_weights(tmp_path))
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        dict(iter_weights(tmp_path / "empty"))


def test_head_weight_reads_the_float32_head_tied_or_not(tmp_path) -> None:
    """``head_weight`` gives the head a validator's float32 ``load_model`` uses: the embedding where the
    config ties them (the shipped base), ``lm_head.weight`` otherwise; a directory without one is refused."""
    from node.coordinator.base import EMBEDDED_BASE_DIR
    tied = load_model(EMBEDDED_BASE_DIR)
    assert tied.config.tie_word_embeddings and torch.equal(head_weight(EMBEDDED_BASE_DIR), tied.lm_head.weight)
    cfg = embedded_config(len(embedded_tokenizer()))
    cfg.tie_word_embeddings = False
    model = build_model(cfg, seed=3)
    save_model(model, embedded_tokenizer(), tmp_path / "untied", dtype=torch.bfloat16)
    head = head_weight(tmp_path / "untied")
    assert head.dtype == torch.float32 and torch.equal(head, model.lm_head.weight.detach().to(torch.bfloat16).float())
    assert not torch.equal(head, model.model.embed_tokens.weight.detach().to(torch.bfloat16).float())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError):
        head_weight(tmp_path / "empty")
