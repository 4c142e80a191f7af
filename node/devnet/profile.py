"""Real-shape model profiles of the devnet (``intellect-node devnet --profile NAME``; reads and writes files).

A profile is the shape of a published model — ``qwen2.5-0.5b``: hidden 896, 24 decoder layers,
14 query / 2 KV heads, intermediate 4,864, vocabulary 151,936, tied embeddings, RoPE θ 10⁶ —
built here with random weights (no hub is reachable), published in bfloat16, and a byte-level
BPE tokenizer trained locally with ``tokenizers`` on the public task text under the data root
(``math/``, ``code/``; read there, never copied). The BPE trainer finds ≈ 41 k merges in that
text; the remaining ids up to the vocabulary size are reserved entries ``<|reserved_N|>`` of the BPE
vocabulary (no merge produces them), as Qwen pads its own embedding matrix beyond its tokenizer. So the vocabulary — the embedding, the
tied head, every sampled and validated distribution — has the real width.

Untrained weights would emit EOS about once in 150 k tokens: every completion would run to the
length limit, every group's rewards would be equal and GRPO would have nothing to learn from. The
EOS row (also its input embedding, the head being tied) is set along the mean final hidden state
of calibration sequences, scaled so EOS has a chosen mean probability per position
(:data:`EOS_RATE`): completion lengths then vary within a group, as a pretrained model's do.

Both are cached per machine under :func:`node.coordinator.base.base_cache_root` (the tokenizer
keyed by the corpus files' SHA-256 and the vocabulary size, the model by profile, depth, seed,
EOS rate and tokenizer), so only the first run on a machine pays (≈ 10 s tokenizer, ≈ 30–60 s
model at 24 layers on 2 cores).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROFILE_CACHE_VERSION = "2"
"""Part of every cache key here: bump when the tokenizer recipe, the weights or the EOS calibration change."""
EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, "<|im_start|>", "<|im_end|>")
"""Ids 0–3 of the tokenizer. EOS is ``<|endoftext|>`` as in Qwen2.5's base models; prompts are plain
text (no chat template), so EOS never occurs in a prompt and its tied input row stays unused there."""
EOS_RATE = 0.05
"""Mean p(EOS) per position on the calibration sequences. Measured on this profile's gsm8k prompts
(32-token limit, temperature 1): completions of 3–32 tokens, most groups of 4 with different
lengths (hence different length-penalised rewards)."""
CALIBRATION_SEQUENCES = 24
"""Task texts the EOS calibration runs the model on."""
CORPUS_FILES = ("math/gsm8k_train.jsonl", "math/gsm8k_test.jsonl", "math/math500_test.jsonl", "math/deepscaler_train_math.json",
                "code/HumanEval.jsonl.gz", "code/mbpp.jsonl")
"""The public task files the tokenizer is trained on (those present under the data root)."""


@dataclass(frozen=True)
class ModelProfile:
    """The shape of a published Qwen2-architecture model.

    Attributes:
        name: the ``--profile`` name.
        hidden_size, layers, heads, kv_heads, intermediate_size, vocab_size: the architecture.
        rope_theta: RoPE base; rms_norm_eps: RMSNorm epsilon.
    """

    name: str
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def config(self, layers: int | None = None, *, eos_token_id: int = 0, pad_token_id: int = 1) -> Any:
        """The ``Qwen2Config`` (tied embeddings, no BOS), with ``layers`` decoder layers (default: the profile's)."""
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=layers or self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )

    def parameters(self, layers: int | None = None) -> int:
        """Parameter count (the tied head counted once)."""
        h, i, n = self.hidden_size, self.intermediate_size, layers or self.layers
        kv = h // self.heads * self.kv_heads
        attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o
        per_layer = attn + 3 * h * i + 2 * h  # MLP gate/up/down, two RMSNorms
        return self.vocab_size * h + n * per_layer + h

    def bf16_bytes(self, layers: int | None = None) -> int:
        """Bytes of the published weights (bfloat16, tied head stored once), safetensors header aside."""
        return 2 * self.parameters(layers)


PROFILES: dict[str, ModelProfile] = {
    "qwen2.5-0.5b": ModelProfile("qwen2.5-0.5b", hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864,
                                 vocab_size=151_936),
}
"""Profiles by ``--profile`` name (Qwen2.5-0.5B's ``config.json``: 494 M parameters, 0.99 GB in bf16)."""


def corpus_files(data_root: Path) -> list[Path]:
    """The :data:`CORPUS_FILES` present under ``data_root``.

    Raises:
        FileNotFoundError: none of them is there (the tokenizer needs the public task text).
    """
    files = [Path(data_root) / f for f in CORPUS_FILES if (Path(data_root) / f).is_file()]
    if not files:
        raise FileNotFoundError(f"no public task text under {data_root} (expected {', '.join(CORPUS_FILES[:2])}, …): pass --data-root")
    return files


def _corpus(files: list[Path]) -> list[str]:
    """One text per task row: its string values joined (question, worked answer, code, tests)."""
    texts: list[str] = []
    for path in files:
        raw = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        rows = json.loads(raw) if path.suffix == ".json" else [json.loads(line) for line in raw.splitlines() if line.strip()]
        texts += [" ".join(str(v) for v in row.values() if v is not None) for row in rows if isinstance(row, dict)]
    return texts


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256(PROFILE_CACHE_VERSION.encode())
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:16]


def _cache_root(cache_root: Path | None) -> Path:
    from node.coordinator.base import base_cache_root

    return Path(cache_root) if cache_root is not None else base_cache_root()


def _publish_dir(tmp: Path, out: Path) -> None:
    """Rename a finished ``tmp`` into ``out``; if another process made ``out`` first, keep theirs."""
    try:
        tmp.replace(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def profile_tokenizer(vocab_size: int, data_root: Path, *, cache_root: Path | None = None) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids trained on the public task text (cached).

    Ids 0–3 are :data:`SPECIAL_TOKENS`, then the bytes and merges the BPE trainer learns from
    :func:`corpus_files` (``min_frequency`` 1), then vocabulary entries ``<|reserved_N|>`` up to
    ``vocab_size`` that no merge produces (encoding never yields them; sampling may).

    Args:
        vocab_size: ids in the tokenizer (the model's embedding rows).
        data_root: the public task sets (read only).
        cache_root: where trained tokenizers are kept (default :func:`node.coordinator.base.base_cache_root`).

    Returns:
        A ``PreTrainedTokenizerFast`` (EOS ``<|endoftext|>``, pad ``<|pad|>``, left padding, no chat template).

    Raises:
        FileNotFoundError: no task text under ``data_root``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = corpus_files(data_root)
    cache = _cache_root(cache_root) / f"bpe-{vocab_size}-{_digest(files)}.json"
    if cache.is_file():
        tok = Tokenizer.from_file(str(cache))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(_corpus(files), trainer)
        learned = tok.get_vocab_size()
        if learned < vocab_size:
            # reserved ids as entries of the BPE vocabulary (no merge yields them), not as added tokens:
            # transformers loads 110 k added tokens in ≈ 50 s, a vocabulary of any size in ≈ 1 s
            doc = json.loads(tok.to_str())
            vocab = doc["model"]["vocab"]
            for i in range(vocab_size - learned):
                vocab[f"<|reserved_{i}|>"] = learned + i
            tok = Tokenizer.from_str(json.dumps(doc))
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        tok.save(str(tmp))
        tmp.replace(cache)
        logger.info("trained a %d-id byte-level BPE tokenizer (%d learned) on %d task files", vocab_size, learned, len(files))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left")
    if len(out) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(out)} ids, expected {vocab_size}")
    return out


def prepare_profile_model(name: str, data_root: Path, *, layers: int | None = None, seed: int = 0, eos_rate: float = EOS_RATE,
                          cache_root: Path | None = None) -> Path:
    """The cached model directory of profile ``name`` (built on first use): bf16 weights, tokenizer, config.

    Args:
        name: a key of :data:`PROFILES`.
        data_root: the public task sets (the tokenizer's text, the EOS calibration prompts).
        layers: decoder layers (default: the profile's; fewer keep the vocabulary, width and
            tokenizer and make a cheap test model).
        seed: weight-initialisation seed (:func:`protocol.models.build_model`).
        eos_rate: target mean p(EOS) per position (:data:`EOS_RATE`).
        cache_root: default :func:`node.coordinator.base.base_cache_root`.

    Returns:
        The directory: ``config.json`` (bfloat16), ``model.safetensors`` (tied head stored once),
        the tokenizer files. Loadable by :func:`protocol.models.load_model`; pin it with
        ``spec init --model-base`` or ``devnet --model``.

    Raises:
        KeyError: unknown profile.
        FileNotFoundError: no task text under ``data_root``.
    """
    import torch

    from protocol.models import build_model, save_model

    profile = PROFILES[name]
    depth = layers or profile.layers
    tokenizer = profile_tokenizer(profile.vocab_size, data_root, cache_root=cache_root)
    key = hashlib.sha256(f"{PROFILE_CACHE_VERSION}|{profile}|{depth}|{seed}|{eos_rate}|{_digest(corpus_files(data_root))}".encode())
    out = _cache_root(cache_root) / f"profile-{name}-L{depth}-{key.hexdigest()[:16]}"
    if (out / "model.safetensors").is_file():
        return out
    eos, pad = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    model = build_model(profile.config(depth, eos_token_id=eos, pad_token_id=pad), seed=seed)
    with torch.no_grad():
        for t in model.parameters():
            t.copy_(t.to(torch.bfloat16).to(torch.float32))  # what will be published, so the calibration sees it
        _calibrate_eos(model, tokenizer, data_root, eos, eos_rate, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp, dtype=torch.bfloat16)
    del model
    _publish_dir(tmp, out)
    logger.info("built profile %s (%d layers) in %s", name, depth, out)
    return out


def _calibrate_eos(model: Any, tokenizer: Any, data_root: Path, eos: int, rate: float, seed: int) -> None:
    """Set the EOS row of the tied embedding to ``c`` × a mean final hidden direction, ``c`` by
    bisection so that the median over held-out calibration sequences of their mean p(EOS) is ``rate``.

    Calibration sequences: 2 × :data:`CALIBRATION_SEQUENCES` task texts drawn (seeded) from the
    corpus, ≤ 64 tokens each, followed by 8 tokens drawn uniformly from the non-special ids (what
    a near-flat model samples); the 8 positions after each prompt are measured — what the model
    sees while it decodes. The direction is the mean over the first half, ``c`` is fitted on the
    second: a random network's final hidden states share only part of their direction between
    sequences (a direction fitted and measured on the same sequences overstates p(EOS) on new
    prompts ≈ 30×). p(EOS) therefore differs between prompts (a spread of ≈ ±2 nats) but is
    nearly constant within one, so the completions of most groups vary in length.
    """
    import random

    import torch

    texts = random.Random(seed).sample(_corpus(corpus_files(data_root)), 2 * CALIBRATION_SEQUENCES)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for text in texts:  # one sequence at a time: no padding, no attention mask to get wrong
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:64]
        tail = torch.randint(len(SPECIAL_TOKENS), len(tokenizer), (8,), generator=gen).tolist()
        rows.append(model.model(input_ids=torch.tensor([ids + tail])).last_hidden_state[0, -8:])  # [8, H] final-norm rows
    h = torch.stack(rows)  # [2S, 8, H]
    fit, held = h[:CALIBRATION_SEQUENCES], h[CALIBRATION_SEQUENCES:]  # [S, 8, H] each
    direction = fit.mean((0, 1)) / fit.mean((0, 1)).norm()  # [H]
    weight = model.get_output_embeddings().weight  # [V, H], tied to the input embedding
    weight[eos] = 0.0
    logits = held @ weight.T  # [S, 8, V], the EOS logit 0 for now
    logits[..., eos] = float("-inf")
    others = torch.logsumexp(logits, -1)  # [S, 8] log-partition of every token but EOS
    proj = held @ direction  # [S, 8]
    lo, hi = 0.0, 256.0
    for _ in range(50):
        c = (lo + hi) / 2
        p = torch.sigmoid(c * proj - others).mean(1).median().item()  # p(EOS) = e^l / (e^l + Σ others)
        lo, hi = (c, hi) if p < rate else (lo, c)
    weight[eos] = ((lo + hi) / 2 * direction).to(torch.bfloat16).to(torch.float32)
