"""A Hugging Face-layout Qwen2 directory built locally, as an operator's own model would look.

``save_pretrained`` of a small bf16 ``Qwen2ForCausalLM`` (safetensors, ``config.json``,
``generation_config.json``) next to a byte-level BPE tokenizer trained here with ``tokenizers``
on the public math sets (32,768 tokens), with a ChatML chat template — no hub access.

The untrained model would sample EOS about once in 32k tokens, so every completion would run to
the length limit and GRPO groups would have no reward spread. The EOS row of ``lm_head`` is set
to :data:`EOS_ROW_SCALE` × a random unit vector: the EOS logit then follows the final hidden
state, EOS is likely at a fraction of positions, and completion lengths vary within a group.

The trained tokenizer is kept per vocabulary size and corpus in the machine's cache
(:func:`node.coordinator.base.base_cache_root`, ``$INTELLECT_CACHE``): the suite builds this
model in several tests, and the BPE training (6-8 s on a loaded 2-core machine) is the same each time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

VOCAB_SIZE = 32768
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS_ROW_SCALE = 12.0


CORPUS = ("gsm8k_train.jsonl", "gsm8k_test.jsonl", "math500_test.jsonl", "deepscaler_train_math.json")
"""The tokenizer's training text: these public task sets under ``data_root/math``."""


def _corpus(data_root: Path) -> list[str]:
    texts: list[str] = []
    for name in CORPUS[:3]:
        for line in (data_root / "math" / name).read_text().splitlines():
            texts.append(" ".join(str(v) for v in json.loads(line).values()))
    texts += [" ".join(str(v) for v in row.values()) for row in json.loads((data_root / "math" / CORPUS[3]).read_text())]
    return texts


def trained_tokenizer(data_root: Path, vocab_size: int) -> Any:  # a tokenizers.Tokenizer
    """The byte-level BPE tokenizer of ``vocab_size`` ids trained on :data:`CORPUS`, from the cache
    when an earlier test (or process) trained it; written there by rename, so a reader never sees half a file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from node.coordinator.base import base_cache_root

    digest = hashlib.sha256(json.dumps([vocab_size, SPECIALS]).encode())
    for name in CORPUS:
        digest.update((data_root / "math" / name).read_bytes())
    cached = base_cache_root().parent / "test-tokenizers" / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(Path(data_root)), trainer)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    tok.save(str(tmp))
    tmp.replace(cached)
    return tok


def build_local_model(out: Path, data_root: Path, *, hidden_size: int = 128, layers: int = 2, seed: int = 0,
                      vocab_size: int = VOCAB_SIZE, dtype: str = "bfloat16", eos_rate: float | None = None) -> Path:
    """Write the model directory ``out`` (created) and return it.

    Args:
        out: target directory.
        data_root: the public task sets (``math/…``), the tokenizer's training text.
        hidden_size: ≥ 128 (TOPLOC top-k).
        layers: decoder layers.
        seed: torch seed of the weights.
        vocab_size: BPE vocabulary size (the embedding's rows).
        dtype: ``bfloat16`` or ``float32`` weights.
        eos_rate: when given, the EOS row of ``lm_head`` instead points along the mean final hidden
            state of random token sequences (what the untrained model samples), scaled so that EOS
            has this mean probability on that calibration sample (fresh sequences see about a
            quarter of it): completion lengths then vary within most groups (a model that can stop,
            as a pretrained one would).

    Returns:
        ``out``, holding ``config.json`` (with ``dtype``), ``generation_config.json``,
        ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and
        ``chat_template.jinja``.
    """
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = trained_tokenizer(Path(data_root), vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    eos, pad = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        u = torch.randn(hidden_size)
        with torch.no_grad():
            model.lm_head.weight[eos] = EOS_ROW_SCALE * u / u.norm()
            if eos_rate is not None:
                _calibrate_eos(model, eos, eos_rate)
    model = model.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    out = Path(out)
    model.save_pretrained(str(out))
    fast.save_pretrained(str(out))
    return out


def _calibrate_eos(model, eos: int, rate: float) -> None:  # noqa: ANN001
    """Set ``lm_head[eos]`` = c · mean hidden direction, c found by bisection so mean p(EOS) ≈ ``rate``."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (16, 48))  # [16, 48] uniform tokens
    hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)  # [768, H]
    direction = hidden.mean(0) / hidden.mean(0).norm()
    lm = model.lm_head.weight
    lo, hi = 0.0, 64.0
    for _ in range(40):
        c = (lo + hi) / 2
        lm[eos] = c * direction
        p = torch.softmax(hidden @ lm.T, -1)[:, eos].mean().item()
        lo, hi = (c, hi) if p < rate else (lo, c)
