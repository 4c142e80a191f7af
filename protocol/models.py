"""Policy models and tokenizers: Qwen2-architecture models through transformers, local files only.

Every role loads the policy the same way: from a directory holding ``config.json``,
``*.safetensors`` and the tokenizer files (what Shardcast assembles, or a local base model).
Weights are read with safetensors only; nothing is unpickled and the hub is never contacted.

The **embedded** model is the one-machine default: a tiny Qwen2 (hidden 128 = TOPLOC's top-k)
with a character-level tokenizer, created deterministically from a seed so a devnet needs no
downloads.
"""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# printable ASCII plus newline; anything else maps to <unk>
EMBEDDED_CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
WEIGHTS_FILE = "model.safetensors"


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
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
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
    """A freshly initialised ``Qwen2ForCausalLM`` (float32, eval mode), deterministic in ``seed``."""
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen2ForCausalLM(config)
    return model.eval()


def save_model(model: Any, tokenizer: Any, out_dir: Path) -> list[Path]:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files into ``out_dir``.

    Returns:
        The written files, sorted by name (what a Shardcast manifest lists).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(out_dir / "config.json")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as safetensors refuses shared storage
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out_dir))
    return sorted(p for p in out_dir.iterdir() if p.is_file())


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
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f), device=device))
        except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt files
            raise ModelLoadError(f"cannot read weights {f}: {e}") from e
    load_state_dict(model, state, strict=True)
    loaded: Any = model
    return loaded.to(device=device, dtype=dtype).eval()


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


def model_summary(model: Any) -> dict[str, Any]:
    """Parameters count and the config fields that matter for TOPLOC and sampling."""
    cfg = model.config
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
    }


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` as a dict."""
    try:
        config: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
        return config
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {model_dir}/config.json: {e}") from e
