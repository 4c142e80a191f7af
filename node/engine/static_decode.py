"""The engine's decode step for Qwen2: a preallocated KV cache and the layers' ops called directly.

``transformers``' own forward costs, per decode step, a growing ``torch.cat`` of every layer's
KV cache (O(length) copies each step), an attention mask rebuilt from the 2-D padding mask, and
a few hundred Python calls of module dispatch, deprecation and config wrappers. At the worker's
small CPU shapes that overhead is about as large as the matmuls (``benchmarks/worker_bench.py``).

:class:`StaticDecoder` computes the decode step of ``Qwen2Model.forward`` with ``sdpa``
attention with the **same floating-point operations in the same order** (RMSNorm, projections,
RoPE from the model's own rotary module, scaled-dot-product attention with the GQA and mask
arguments transformers passes, SiLU MLP, residuals, final norm, LM head), so its hidden rows,
logits, tokens and log-probs are bit-identical to the transformers path
(``tests/node/test_engine.py`` compares them). Rewrites that keep every product and sum:
``rotate_half(q) · sin`` as ``roll(q, D/2) · (−sin | sin)`` (both halves of a RoPE row are equal),
and one query position viewed as ``[B, heads, 1, D]`` without transposes (same memory). What
differs is where the numbers live: keys and values are written into ``[B, KV, L, D]`` buffers
allocated once per batch and attention reads a view of their first ``L`` positions; the padding
mask is built once (on the CPU as the additive 0 / −inf mask SDPA makes of a boolean one) and
sliced.

Only float32 Qwen2 models in eval mode qualify (:func:`supports`): ``sdpa`` attention, full
attention in every layer, SiLU, default RoPE. Anything else decodes through ``transformers``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def supports(model: Any) -> bool:
    """Whether :class:`StaticDecoder` reproduces ``model``'s decode step exactly.

    True for a float32 ``Qwen2ForCausalLM`` in eval mode with ``sdpa`` attention, no sliding-window
    layer, SiLU activation and default RoPE (the configurations this module mirrors op for op).
    """
    try:
        from transformers import Qwen2ForCausalLM
    except ImportError:  # pragma: no cover - transformers is a core dependency
        return False
    if type(model) is not Qwen2ForCausalLM or model.training:
        return False
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return (
        getattr(cfg, "_attn_implementation", None) == "sdpa"
        and all(t == "full_attention" for t in layer_types)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and all(p.dtype == torch.float32 for p in model.parameters())
        and model.lm_head.bias is None
        and getattr(model.model.rotary_emb, "rope_type", None) == "default"  # no dynamic/long-context RoPE updates
    )


class StaticDecoder:
    """Batched decode steps of a Qwen2 model from a prefilled cache, into preallocated KV buffers.

    Args:
        model: a model :func:`supports` accepts.
        prefill_cache: the ``transformers`` cache returned by the prefill of the ``[B, T]``
            left-padded prompts (its keys/values are copied into the buffers).
        attention_mask: ``[B, T]`` int64 padding mask of the prefill (0 on padding).
        max_new: decode steps that may follow (the buffers hold ``T + max_new`` positions).

    Attributes:
        length: positions cached so far (``T`` after construction, +1 per :meth:`step`).
    """

    def __init__(self, model: Any, prefill_cache: Any, attention_mask: torch.Tensor, max_new: int) -> None:
        self.model = model
        inner = model.model
        cfg = model.config
        self.layers = list(inner.layers[: cfg.num_hidden_layers])
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.n_rep = self.n_heads // self.n_kv
        b, t = attention_mask.shape
        self.batch = b
        self.length = t
        capacity = t + max_new
        first = prefill_cache.layers[0].keys  # [B, KV, T, D]
        self.head_dim = int(first.shape[-1])
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in prefill_cache.layers[: len(self.layers)]:
            k = first.new_empty((b, self.n_kv, capacity, self.head_dim))  # [B, KV, L, D]
            v = first.new_empty((b, self.n_kv, capacity, self.head_dim))
            k[:, :, :t].copy_(layer.keys)
            v[:, :, :t].copy_(layer.values)
            self.keys.append(k)
            self.values.append(v)
        # transformers passes no mask when nothing is padded (SDPA then does GQA itself) and the boolean
        # padding mask otherwise, built once here; on the CPU as the additive 0 / −inf mask SDPA would
        # convert it to at every call (other devices get the boolean mask, so SDPA picks the same kernel)
        padded = not bool(attention_mask.bool().all())
        self.mask: torch.Tensor | None = None
        if padded:
            keep = torch.ones((b, 1, 1, capacity), dtype=torch.bool, device=attention_mask.device)
            keep[:, 0, 0, :t] = attention_mask.bool()
            self.mask = keep
            if keep.device.type == "cpu":
                self.mask = torch.zeros((b, 1, 1, capacity), dtype=first.dtype, device=first.device).masked_fill_(~keep, -math.inf)
        self.scaling = float(self.layers[0].self_attn.scaling)
        self.eps = float(self.layers[0].input_layernorm.variance_epsilon)
        # the tensors of each layer, fetched once (module attribute lookups cost more than the small ops)
        self.weights = [
            (layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias,
             a.o_proj.weight, layer.post_attention_layernorm.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight,
             layer.mlp.down_proj.weight)
            for layer in self.layers for a in (layer.self_attn,)
        ]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step.

        Args:
            tokens: ``[B]`` int64 the tokens just sampled.
            position_ids: ``[B, 1]`` int64 their positions.

        Returns:
            ``(hidden [B, H] final-norm rows, logits [B, V] float32)`` of the next position.

        Raises:
            RuntimeError: more steps than ``max_new``.
        """
        pos = self.length
        if pos >= self.keys[0].shape[2]:
            raise RuntimeError("decode past the preallocated cache")
        inner = self.model.model
        b, nh, nkv, d, half = self.batch, self.n_heads, self.n_kv, self.head_dim, self.head_dim // 2
        x = F.embedding(tokens[:, None], inner.embed_tokens.weight)  # [B, 1, H]
        cos, sin = inner.rotary_emb(x, position_ids)  # [B, 1, D] each; both halves of a row are equal
        cos = cos.unsqueeze(1)  # [B, 1, 1, D]
        # rotate_half(q) · sin = roll(q, D/2) · (−sin | sin): the same products, one op fewer per tensor
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        mask = None if self.mask is None else self.mask[..., : pos + 1]
        for li, (ln1, wq, bq, wk, bk, wv, bv, wo, ln2, wg, wu, wd) in enumerate(self.weights):
            h = _rms(x, ln1, self.eps)
            # one query position: [B, 1, NH·D] already has the layout of [B, NH, 1, D] (transformers transposes)
            q = F.linear(h, wq, bq).view(b, nh, 1, d)
            k = F.linear(h, wk, bk).view(b, nkv, 1, d)
            v = F.linear(h, wv, bv).view(b, nkv, 1, d)
            q = (q * cos) + (q.roll(half, -1) * sin)
            kc, vc = self.keys[li], self.values[li]
            torch.add(k * cos, k.roll(half, -1) * sin, out=kc[:, :, pos : pos + 1])
            vc[:, :, pos : pos + 1] = v
            keys, values = kc[:, :, : pos + 1], vc[:, :, : pos + 1]  # [B, KV, pos+1, D] views
            if self.n_rep == 1:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=self.scaling)
            elif mask is None:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=None, dropout_p=0.0, scale=self.scaling, enable_gqa=True)
            else:  # one query token: the query heads of a KV head become its query rows (transformers' pack_gqa)
                out = F.scaled_dot_product_attention(q.reshape(b, nkv, self.n_rep, d), keys, values, attn_mask=mask, dropout_p=0.0,
                                                     scale=self.scaling)
            # [B, NH, 1, D] (or [B, KV, rep, D]) is already the layout of [B, 1, NH·D]
            x = x + F.linear(out.reshape(b, 1, nh * d), wo)
            h = _rms(x, ln2, self.eps)
            x = x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
        hidden = _rms(x, inner.norm.weight, float(inner.norm.variance_epsilon))  # [B, 1, H]
        logits = F.linear(hidden, self.model.lm_head.weight).float()  # [B, 1, V]
        self.length = pos + 1
        return hidden[:, -1], logits[:, -1]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen2RMSNorm.forward`` for float32 ``x``, op for op (its dtype casts are no-ops there)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)))
