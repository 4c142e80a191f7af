"""Model profiles shared by the benchmarks (``--profile``): realistic shapes without hub access.

``qwen2.5-0.5b`` is the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 query / 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings, RoPE θ 10^6) with random weights rounded
to bfloat16 and kept in float32 for CPU compute, and a byte-level BPE tokenizer trained here with
``tokenizers`` (pad 0, eos 1, unk 2; the merges a synthetic corpus yields, then reserved tokens up
to the vocabulary size, as Qwen pads its own embedding matrix beyond its tokenizer).

Random weights give nearly flat next-token distributions (the worst case for any scheme that
prunes the vocabulary); ``peaked`` scales the final norm's weight so the logits (tied head) are
``scale`` times larger: a sharp, LM-like distribution with the same model cost.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import torch

PROFILES = ("qwen2.5-0.5b",)
QWEN25_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151_936}
DEFAULT_PEAK_SCALE = 12.0
"""Logit scale of the ``peaked`` model: top-token probability ≈ 0.4–0.9 on random prompts at 24 layers."""


def qwen_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> Any:
    """A ``Qwen2Config`` with tied embeddings, pad 0, eos 1, no BOS."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )


def build_profile_model(layers: int | None = None, *, peaked: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """The ``qwen2.5-0.5b`` model (``layers`` overrides the 24 decoder layers), bf16-rounded weights in float32.

    Args:
        layers: decoder layers (default 24).
        peaked: if > 0, multiply the final norm's weight by this (logits scale by it).
        seed: weight initialisation seed.
    """
    from protocol.models import build_model

    p = QWEN25_05B
    cfg = qwen_config(p["vocab"], p["hidden"], layers or p["layers"], p["heads"], p["kv_heads"], p["intermediate"])
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        for t in model.parameters():
            t.copy_(t.to(torch.bfloat16).to(torch.float32))  # bf16 checkpoint, upcast for CPU compute
        if peaked > 0:
            model.model.norm.weight.mul_(peaked)
    return model.eval()


def bpe_tokenizer(vocab_size: int = QWEN25_05B["vocab"], cache_dir: Path | None = None) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids, trained locally (≈ 15 s, then cached).

    The corpus is 4,000 lines of words drawn from 60,000 random lower-case strings (seeded), so
    the trainer finds ≈ 100 k merges; the remaining ids are reserved tokens ``<|reserved_N|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cache = (cache_dir or Path(tempfile.gettempdir())) / f"intellect-bench-bpe-{vocab_size}.json"
    if cache.exists():
        tok = Tokenizer.from_file(str(cache))
    else:
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(60_000)]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<unk>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator((" ".join(rng.choice(words) for _ in range(200)) for _ in range(4000)), trainer)
        n = tok.get_vocab_size()
        if n < vocab_size:
            tok.add_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - n)])
        tmp = cache.with_suffix(".tmp")
        tok.save(str(tmp))
        tmp.replace(cache)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")
    if len(out) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(out)} ids, expected {vocab_size}")
    return out
