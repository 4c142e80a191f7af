"""The model forward pass shared by worker, validator and trainer.

One implementation, so that the rows a worker commits with TOPLOC and the rows a validator
recomputes can never drift (``docs/toploc.md`` §1):

* :func:`forward` — one forward pass returning the **final-norm hidden states** (the LM-head
  input; for Qwen2 that is ``model.model(...).last_hidden_state``) and the logits.
* :func:`pad_left` — left padding with matching attention mask and position IDs, so a padded
  sequence gets exactly the positions it would get alone.
* :func:`prefill_completions` — the validator's batched prefill of prompt + completion,
  returning per sequence the committed rows (positions ``P-1 … P+n-2``) and their logits;
  :func:`completion_rows` and :func:`head_logits` are its two halves, for a caller that scores
  one sequence's logits at a time into a reused buffer (:func:`logits_buffer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _cache_arg() -> str:
    import inspect

    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    return "cache" if "cache" in inspect.signature(Qwen2Model.forward).parameters else "past_key_values"


_CACHE_ARG = _cache_arg()


@dataclass
class ForwardOut:
    """Outputs of :func:`forward`.

    Attributes:
        hidden: ``[B, T, H]`` final-norm hidden states, model dtype.
        logits: ``[B, T, V]`` float32.
        cache: the KV cache to continue decoding from (``None`` if not requested).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    cache: Any


def forward(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    *,
    use_cache: bool = False,
    logits_positions: torch.Tensor | None = None,
    with_logits: bool = True,
) -> ForwardOut:
    """Run the decoder and the LM head.

    Args:
        model: a ``Qwen2ForCausalLM`` (or any causal LM with ``.model`` and ``.lm_head``).
        input_ids: ``[B, T]`` int64 token IDs.
        attention_mask: ``[B, T_past + T]`` int64, 0 on padding.
        position_ids: ``[B, T]`` int64.
        cache: a transformers ``Cache`` from a previous call, or ``None``.
        use_cache: return a cache to continue from.
        logits_positions: optional ``[T']`` indices along T for which to compute logits (saves
            the LM-head matmul on prompt positions); default all.
        with_logits: ``False`` skips the LM head (``logits`` is then an empty tensor).

    Returns:
        :class:`ForwardOut`.
    """
    kwargs = {_CACHE_ARG: cache}  # transformers ≥ 5.20 calls it `cache`, older `past_key_values`
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **kwargs)
    hidden = out.last_hidden_state  # [B, T, H], already through the final RMSNorm
    new_cache = getattr(out, _CACHE_ARG) if use_cache else None
    if not with_logits:
        return ForwardOut(hidden=hidden, logits=hidden.new_empty(0), cache=new_cache)
    h = hidden if logits_positions is None else hidden[:, logits_positions]
    logits = model.lm_head(h).float()  # [B, T', V]
    return ForwardOut(hidden=hidden, logits=logits, cache=new_cache)


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token sequences into a batch.

    Returns:
        ``(input_ids [B, T] int64, attention_mask [B, T] int64, position_ids [B, T] int64)``, where
        each sequence's real tokens get positions ``0 … len-1`` (padding gets 0 and is masked).

    Raises:
        ValueError: an empty batch or an empty sequence.
    """
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad_left needs a non-empty batch of non-empty sequences")
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, t - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@dataclass
class Prefill:
    """Committed rows of one prompt + completion (``docs/toploc.md`` §1).

    Attributes:
        hidden: ``[n, H]`` bfloat16 final-norm rows at positions ``P-1 … P+n-2``.
        logits: ``[n, V]`` float32 logits from those rows (row i predicts completion token i).
    """

    hidden: torch.Tensor
    logits: torch.Tensor


@torch.no_grad()
def completion_rows(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
) -> list[torch.Tensor]:
    """The final-norm rows of ``prompt + completion`` sequences from one batched forward (no LM head).

    Args:
        model: the policy.
        prompts: B prompts of P_b ≥ 1 tokens.
        completions: B completions of n_b ≥ 1 tokens.
        pad_id: padding token ID.

    Returns:
        Per sequence ``[n_b, H]`` rows in the model's dtype at positions ``P-1 … P+n-2`` (row i
        predicts completion token i; views into one batch tensor).

    Raises:
        ValueError: mismatched lengths or an empty prompt/completion.
    """
    if len(prompts) != len(completions):
        raise ValueError("prompts and completions differ in number")
    if any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token")
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device  # the batch goes where the model is (a validator may prefill on a GPU)
    ids, mask, pos = (t.to(device) for t in pad_left(seqs, pad_id))
    out = forward(model, ids, mask, pos, with_logits=False)
    t = ids.shape[1]
    # padded index of position P-1 is t - n - 1
    return [out.hidden[b, t - len(c) - 1 : t - 1] for b, c in enumerate(completions)]


@torch.no_grad()
def head_logits(model: Any, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``lm_head(rows)`` as float32 ``[n, V]`` logits of ``[n, H]`` rows.

    With ``out`` (a float32 ``[≥ n, V]`` buffer) and a float32 ``nn.Linear`` head, the logits are
    written into ``out[:n]`` by the same matrix product (same values), so a caller scoring many
    sequences one after another reuses one buffer instead of touching fresh pages for each
    (``[n, V]`` at vocabulary 151,936 is 78 MB per 128 rows; the fresh pages cost ~10 % of the
    product on a CPU).
    """
    head = model.lm_head
    if out is None or not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32 or rows.dtype != torch.float32:
        logits: torch.Tensor = head(rows).float()
        return logits
    dst = out[: rows.shape[0]]
    if head.bias is None:
        return torch.mm(rows, head.weight.t(), out=dst)
    return torch.addmm(head.bias, rows, head.weight.t(), out=dst)


def logits_buffer(model: Any, rows: int) -> torch.Tensor | None:
    """A float32 ``[rows, V]`` buffer for :func:`head_logits` on the head's device, or ``None`` where
    the head would not use it (not a float32 ``nn.Linear``)."""
    head = model.lm_head
    if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
        return None
    return torch.empty((rows, head.out_features), dtype=torch.float32, device=head.weight.device)


@torch.no_grad()
def prefill_completions(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
) -> list[Prefill]:
    """Batched prefill of ``prompt + completion`` sequences (one forward, no sampling).

    Args:
        model: the policy.
        prompts: B prompts of P_b ≥ 1 tokens.
        completions: B completions of n_b ≥ 1 tokens.
        pad_id: padding token ID.

    Returns:
        One :class:`Prefill` per sequence (:func:`completion_rows`; the LM head only on the
        committed rows: ``[n, V]`` instead of ``[T, V]``).

    Raises:
        ValueError: mismatched lengths or an empty prompt/completion.
    """
    rows = completion_rows(model, prompts, completions, pad_id)
    return [Prefill(hidden=r.to(torch.bfloat16), logits=head_logits(model, r)) for r in rows]
