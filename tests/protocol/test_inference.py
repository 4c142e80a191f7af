"""Tests of protocol.inference's prefill halves: completion_rows + head_logits into a reused buffer
give exactly what prefill_completions gives (the validator pipeline scores rollout by rollout)."""

from __future__ import annotations

import torch

from protocol.inference import completion_rows, head_logits, logits_buffer, prefill_completions
from protocol.models import build_model, embedded_config


def _batch() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 99, (2 + 3 * i,), generator=g).tolist() for i in range(5)]
    completions = [torch.randint(3, 99, (9 - i,), generator=g).tolist() for i in range(5)]  # different lengths: padded
    return prompts, completions


def test_rows_and_buffered_logits_equal_the_prefill() -> None:
    model = build_model(embedded_config(99), seed=1)
    prompts, completions = _batch()
    ref = prefill_completions(model, prompts, completions, 0)
    rows = completion_rows(model, prompts, completions, 0)
    buf = logits_buffer(model, max(len(c) for c in completions))
    assert buf is not None and buf.shape == (9, 99)
    for r, p, c in zip(rows, ref, completions, strict=True):
        assert r.shape == (len(c), 128) and torch.equal(r.to(torch.bfloat16), p.hidden)
        logits = head_logits(model, r, buf)
        assert logits.data_ptr() == buf.data_ptr() and torch.equal(logits, p.logits)


def test_head_with_bias_and_heads_the_buffer_does_not_fit() -> None:
    model = build_model(embedded_config(99), seed=2)
    model.lm_head.bias = torch.nn.Parameter(torch.randn(99))
    rows = completion_rows(model, *_batch(), 0)
    buf = logits_buffer(model, 9)
    assert buf is not None
    for r in rows:
        assert torch.equal(head_logits(model, r, buf), model.lm_head(r).float())
    half = build_model(embedded_config(99), seed=2).to(torch.bfloat16)
    assert logits_buffer(half, 9) is None  # a bf16 head writes its own float32 logits
    r16 = completion_rows(half, *_batch(), 0)[0]
    out = head_logits(half, r16, None)
    assert out.dtype == torch.float32 and torch.equal(out, half.lm_head(r16).float())
