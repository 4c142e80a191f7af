"""Policy models and tokenizers (reads and writes model files; not pure): Qwen2-architecture
models through transformers, local files only.

Every role loads the policy the same way: from a directory holding ``config.json``,
``*.safetensors`` and the tokenizer files (what Shardcast assembles, or a local base model).
Weights are read with safetensors only; nothing is unpickled and the hub is never contacted.

This module is also the one place that builds a fresh model (:func:`build_model`: the same
tensors for the same config and seed wherever it runs — devnet base, tests, benchmarks) and the
one writer of a model directory (:func:`save_model`: the embedded base, every published policy
step, the weights of a training state; :func:`copy_model`: policy step 0, the base file for file).

The **embedded** model is the one-machine default: a tiny Qwen2 (hidden 128 = TOPLOC's top-k)
with a character-level tokenizer, created deterministically from a seed so a devnet needs no
downloads.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from protocol.durable import atomic_write, fsync_dir
from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# printable ASCII plus newline; anything else maps to <unk>
EMBEDDED_CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TIED_HEAD = "lm_head.weight"


class ModelLoadError(ProtocolError):
    """A model directory that is missing files, has a foreign architecture or bad weights."""


def embedded_tokenizer() -> Any:
    """The character-level tokenizer of the embedded model (a ``PreTrainedTokenizerFast``).

    Vocabulary: ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2, then the 97 printable characters;
    left padding (for batched generation); no chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in EMBEDDED_CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def embedded_config(vocab_size: int, hidden_size: int = 128, layers: int = 2) -> Any:
    """The ``Qwen2Config`` of the embedded model (≈0.4 M parameters at the defaults)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


def build_model(config: Any, seed: int = 0) -> Any:
    """A freshly initialised ``Qwen2ForCausalLM``: the one builder of new weights.

    The weights depend only on ``config`` and ``seed``: torch's CPU generator is seeded with
    ``seed`` inside :func:`torch.random.fork_rng`, so the caller's global RNG state is neither
    read nor changed (building a model never shifts a later random draw, and an earlier draw
    never changes the model). Built on the CPU.

    Args:
        config: a ``Qwen2Config``; not changed (the model gets a copy with the attention
            implementation set to ``sdpa``, the transformers default here, so every role computes
            the same forward).
        seed: the initialisation seed.

    Returns:
        The model: float32 parameters, CPU, sdpa attention, ``eval()`` mode (the trainer
        switches to ``train()`` and turns the KV cache off itself).
    """
    from transformers import Qwen2ForCausalLM

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen2ForCausalLM(config)
    return model.to(torch.float32).eval()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_text(config: Any, dtype: torch.dtype | None, base_dir: Path | None) -> str:
    """``config.json`` of a written model directory (see :func:`save_model`)."""
    if base_dir is not None and (Path(base_dir) / CONFIG_FILE).is_file():
        cfg = json.loads((Path(base_dir) / CONFIG_FILE).read_text())
    else:
        cfg = json.loads(config.to_json_string())
        if cfg.get("use_cache") is False:
            cfg.pop("use_cache")  # the trainer turns the KV cache off; a policy for generation keeps the default
    if dtype is not None:
        for k in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
            cfg[k] = _dtype_name(dtype)
    # the same bytes as transformers' ``to_json_string`` when nothing above changed a field
    return json.dumps(cfg, indent=2) + "\n"


def _base_extras(base_dir: Path) -> list[Path]:
    """Files of a base that a policy directory carries unchanged: all of :func:`model_files` but
    the config and the weights."""
    return [
        p for p in model_files(base_dir)
        if p.name != CONFIG_FILE and not p.name.endswith((".safetensors", ".safetensors.index.json"))
    ]


def _copy_into(files: list[Path], out_dir: Path) -> list[Path]:
    """Copy ``files`` byte-identical into ``out_dir`` under their names, each atomically."""
    out = []
    for src in files:
        dst = out_dir / src.name
        atomic_write(dst, functools.partial(shutil.copyfile, src), sync_dir=False)
        out.append(dst)
    return out


def save_model(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    *,
    state: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    base_dir: Path | None = None,
) -> list[Path]:
    """Write a model directory: the one writer of ``config.json`` + ``model.safetensors`` + the
    tokenizer and other files (``docs/trainer.md`` §7; what :func:`load_model` and Shardcast read).

    Files::

        config.json          base_dir's config.json if given, else the model's config as
                             transformers writes it (a ``use_cache: false`` the trainer set is
                             dropped); with ``dtype``, its ``dtype``/``torch_dtype`` field(s) say it
        model.safetensors    every tensor of ``state`` in ``dtype`` (default: as they are), on the
                             CPU, HF parameter names; a tied ``lm_head.weight`` is omitted
                             (safetensors refuses shared storage; loaders re-tie it)
        …                    with base_dir: every other file of it (tokenizer files, chat
                             template, generation_config.json) byte-identical; else the
                             tokenizer's own files (``save_pretrained``), if one is given

    Each file is written atomically and durably (:mod:`protocol.durable`); files of the same names
    already in ``out_dir`` are replaced.

    Args:
        model: the model whose ``config`` (and, without ``state``, whose weights) are written;
            an FSDP2-sharded model works when ``state`` is its gathered full state dict.
        tokenizer: written only without ``base_dir``; ``None`` writes no tokenizer files.
        out_dir: created if missing.
        state: the full state dict to write, ``name → tensor``; default ``model.state_dict()``.
        dtype: dtype of the written floating-point weights (the run spec's ``model.dtype``);
            ``None`` keeps each tensor's dtype and leaves the config's dtype field as it is.
        base_dir: the run's base model directory (see above).

    Returns:
        The written files, sorted (for a fresh ``out_dir``: what a Shardcast manifest lists).

    Raises:
        OSError: a write failed (files already replaced stay replaced; none is torn).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    source = model.state_dict() if state is None else state
    tensors = {
        k: v.detach().to(device="cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous()
        for k, v in source.items()
        if not (tied and k == TIED_HEAD)
    }
    text = _config_text(model.config, dtype, base_dir)
    cfg_path, weights_path = out_dir / CONFIG_FILE, out_dir / WEIGHTS_FILE
    atomic_write(cfg_path, text.encode(), sync_dir=False)
    atomic_write(weights_path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}), sync_dir=False)
    paths = [cfg_path, weights_path]
    if base_dir is not None:
        paths += _copy_into(_base_extras(Path(base_dir)), out_dir)
    elif tokenizer is not None:
        paths += [Path(p) for p in tokenizer.save_pretrained(str(out_dir)) if Path(p).is_file()]
    fsync_dir(out_dir)
    return sorted(set(paths))


def copy_model(model_dir: Path, out_dir: Path) -> list[Path]:
    """Copy a model directory's files (:func:`model_files`) byte-identical into ``out_dir``, each
    atomically and durably, so :func:`base_hash` of ``out_dir`` equals ``model_dir``'s (policy step 0).

    Returns:
        The written files, sorted.

    Raises:
        OSError: a read or write failed.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = _copy_into(model_files(Path(model_dir)), out_dir)
    fsync_dir(out_dir)
    return sorted(out)


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer saved in ``model_dir`` (local files only), with left padding."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"no usable tokenizer in {model_dir}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """Load a Qwen2 model from ``model_dir`` (``config.json`` + ``*.safetensors``), safetensors only.

    Tensors are read and cast to ``dtype`` one at a time (:func:`iter_weights`), so loading a bf16
    checkpoint as float32 holds the float32 model plus one tensor, not the whole bf16 file as well
    (at the 0.5B profile: 2.0 GB instead of 3.0 GB).

    Raises:
        ModelLoadError: missing config or weights, a non-qwen2 architecture, or tensors that do
            not match the config.
    """
    from transformers import AutoConfig, Qwen2ForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json")
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if config.model_type != "qwen2":
        raise ModelLoadError(f"{model_dir} is a {config.model_type!r} model; only qwen2 is supported")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    load_state_dict(model, dict(iter_weights(model_dir, dtype=dtype, device=device)), strict=True)
    loaded: Any = model
    return loaded.to(device=device, dtype=dtype).eval()


def iter_weights(model_dir: Path, *, dtype: torch.dtype | None = None, device: str = "cpu") -> Any:
    """Yield ``(name, tensor)`` for every tensor of a model directory's ``*.safetensors`` files,
    read one at a time (safetensors only) and cast to ``dtype`` (``None``: as stored).

    Raises:
        ModelLoadError: no ``.safetensors`` file, an unreadable one, or a tensor name in two files.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    seen: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=device) as st:
                names = list(st.keys())
                for name in names:
                    if name in seen:
                        raise ModelLoadError(f"tensor {name!r} appears in more than one file of {model_dir}")
                    seen.add(name)
                    t = st.get_tensor(name)
                    yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt files
            raise ModelLoadError(f"cannot read weights {f}: {e}") from e


def copy_weights(model: Any, model_dir: Path) -> None:
    """Copy the weights of ``model_dir`` into ``model``'s parameters in place, one tensor at a time,
    each cast to the parameter's dtype: a weight swap that holds the model plus one tensor
    (a worker's engine taking the next policy step).

    Raises:
        ModelLoadError: a tensor the model lacks, a shape that differs, or a model tensor the
            directory lacks (a tied ``lm_head.weight`` follows the embedding).
    """
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    targets = dict(model.state_dict(keep_vars=True))
    if tied:
        targets.pop(TIED_HEAD, None)
    done: set[str] = set()
    with torch.no_grad():
        for name, t in iter_weights(model_dir):
            if tied and name == TIED_HEAD:
                continue
            dst = targets.get(name)
            if dst is None:
                raise ModelLoadError(f"weights do not match the model: unexpected {name!r}")
            if tuple(dst.shape) != tuple(t.shape):
                raise ModelLoadError(f"weights do not match the model: {name} is {tuple(t.shape)}, the model has {tuple(dst.shape)}")
            dst.copy_(t)
            done.add(name)
    missing = sorted(set(targets) - done)
    if missing:
        raise ModelLoadError(f"weights do not match the model: missing {missing[:3]}")


def head_weight(model_dir: Path, *, device: str = "cpu") -> torch.Tensor:
    """The LM head of ``model_dir`` as float32 (``lm_head.weight``, or the input embedding where the
    config ties them): read alone from its safetensors file, exactly what :func:`load_model` gives a
    validator's float32 head. A bf16 worker's "fp32 logits" (``node.engine.hf``) use it.

    Returns:
        ``[V, H]`` float32 on ``device``.

    Raises:
        ModelLoadError: no config, no safetensors weights, or neither tensor in them.
    """
    from safetensors import safe_open

    config = read_config(Path(model_dir))
    names = ("model.embed_tokens.weight",) if config.get("tie_word_embeddings") else (TIED_HEAD, "model.embed_tokens.weight")
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    for name in names:
        for f in files:
            try:
                with safe_open(str(f), framework="pt", device=device) as st:
                    if name in st.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                        return st.get_tensor(name).to(torch.float32)
            except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt files
                raise ModelLoadError(f"cannot read weights {f}: {e}") from e
    raise ModelLoadError(f"{model_dir} holds no LM head ({' or '.join(names)})")


def load_state_dict(model: Any, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy ``state`` into ``model`` in place (also onto a meta-device model), re-tying embeddings.

    Raises:
        ModelLoadError: missing or unexpected tensors, or shape mismatches.
    """
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights do not match the model config: {e}") from e
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if strict and (missing or result.unexpected_keys):
        raise ModelLoadError(f"weights do not match the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    if tied:
        model.tie_weights()
    # non-persistent buffers (rotary inv_freq) are not in the file: rebuild those modules on the CPU
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)) and hasattr(child, "config"):
                setattr(parent, child_name, type(child)(child.config))


def config_int(model: Any, name: str) -> int:
    """An integer field of a transformers model's config, e.g. ``vocab_size`` (token IDs the
    embedding has rows for) or ``hidden_size`` (H): the one place the roles read model sizes from.

    Raises:
        ModelLoadError: ``model`` has no ``config`` with an integer ``name`` (not a transformers model).
    """
    value = getattr(getattr(model, "config", None), name, None)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"the model's config has no integer {name!r} (got {type(value).__name__})")
    return value


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` as a dict."""
    try:
        config: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
        return config
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {model_dir}/config.json: {e}") from e


# ---------------------------------------------------------------------------------------------
# The base model's identity: what `spec init --model-base` reads and `model.base_hash` pins

BASE_HASH_DOMAIN = b"intellect-node/base-hash/1\x00"
SUPPORTED_DTYPES = ("float32", "bfloat16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def model_files(model_dir: Path) -> list[Path]:
    """The files that make up a model directory: its non-hidden top-level regular files, sorted by
    name (the same set ``node.shardcast.publish`` publishes for a directory)."""
    return sorted((p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith(".")), key=lambda p: p.name)


def base_hash(model_dir: Path) -> str:
    """``model.base_hash`` of a model directory: a content hash over its files (``docs/protocol.md`` §7).

    SHA-256 of ``BASE_HASH_DOMAIN`` followed, for each file of :func:`model_files` in name order,
    by ``u32 len(name) || name (UTF-8) || u64 size in bytes || SHA-256(content)`` (big-endian
    integers). Reads every byte of every file once (about 1 s per GB).

    Raises:
        ModelLoadError: the directory is missing or holds no files.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    files = model_files(model_dir)
    if not files:
        raise ModelLoadError(f"model directory {model_dir} holds no files")
    h = hashlib.sha256(BASE_HASH_DOMAIN)
    for f in files:
        name = f.name.encode("utf-8")
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            content = hashlib.file_digest(fh, "sha256")
        h.update(len(name).to_bytes(4, "big") + name + size.to_bytes(8, "big") + content.digest())
    return h.hexdigest()


def check_base_hash(model_dir: Path, expected: str) -> None:
    """Refuse a base model whose files differ from the run spec's ``model.base_hash``.

    Args:
        model_dir: the base model directory (or a fetched policy step 0).
        expected: the run spec's ``model.base_hash``; empty skips the check.

    Raises:
        ModelLoadError: one line naming both hashes.
    """
    if not expected:
        return
    got = base_hash(model_dir)
    if got != expected:
        raise ModelLoadError(
            f"base model {model_dir} hashes to {got[:16]}…, the run spec's model.base_hash is {expected[:16]}…: "
            "different model files (every node must hold the exact files the spec was made from)"
        )


@dataclass(frozen=True)
class ModelInfo:
    """What a base model directory declares, as read by :func:`inspect_model_dir`.

    Attributes:
        dtype: the weights' dtype (``float32`` or ``bfloat16``) from the safetensors headers.
        config_dtype: ``torch_dtype``/``dtype`` of ``config.json`` (``None``: absent).
        hidden_size: ``config.hidden_size``.
        layers: ``config.num_hidden_layers``.
        vocab_size: ``config.vocab_size`` (rows of the embedding).
        tokenizer_size: tokens the tokenizer knows (≤ ``vocab_size``).
        eos_token_ids: end-of-sequence token IDs (config, ``generation_config.json`` and tokenizer).
        parameters: number of weights in the safetensors files (a tied head counted once).
        chat_template: whether the tokenizer has a chat template.
    """

    dtype: str
    config_dtype: str | None
    hidden_size: int
    layers: int
    vocab_size: int
    tokenizer_size: int
    eos_token_ids: tuple[int, ...]
    parameters: int
    chat_template: bool


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def inspect_model_dir(model_dir: Path) -> ModelInfo:
    """Read a local Qwen2 directory's config, safetensors headers and tokenizer (no weights loaded).

    Raises:
        ModelLoadError: no config, a foreign architecture, no or unreadable safetensors, mixed or
            unsupported weight dtypes, no tokenizer, no EOS token, or a tokenizer larger than
            the embedding.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    if cfg.get("model_type") != "qwen2":
        raise ModelLoadError(f"{model_dir} is a {cfg.get('model_type')!r} model; only qwen2 is supported")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    dtypes: set[str] = set()
    parameters = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is no dict: it has keys(), no __iter__
                    sl = st.get_slice(name)
                    dtypes.add(_SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    parameters += n
        except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt files
            raise ModelLoadError(f"cannot read weights {f}: {e}") from e
    if len(dtypes) != 1:
        raise ModelLoadError(f"{model_dir} mixes weight dtypes {sorted(dtypes)}; save it in one dtype")
    dtype = dtypes.pop()
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"{model_dir} has {dtype} weights; supported: {', '.join(SUPPORTED_DTYPES)}")
    config_dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    tok = load_tokenizer(model_dir)
    eos = _ids(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            eos += _ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {gen_path}: {e}") from e
    if tok.eos_token_id is not None:
        eos.append(int(tok.eos_token_id))
    if not eos:
        raise ModelLoadError(f"{model_dir} names no EOS token (config, generation_config.json or tokenizer)")
    vocab = int(cfg.get("vocab_size", 0))
    if len(tok) > vocab:
        raise ModelLoadError(f"{model_dir}: the tokenizer has {len(tok)} tokens, the embedding only {vocab} rows")
    return ModelInfo(
        dtype=dtype, config_dtype=str(config_dtype) if config_dtype else None, hidden_size=int(cfg.get("hidden_size", 0)),
        layers=int(cfg.get("num_hidden_layers", 0)), vocab_size=vocab, tokenizer_size=len(tok),
        eos_token_ids=tuple(sorted(set(eos))), parameters=parameters, chat_template=bool(getattr(tok, "chat_template", None)),
    )
