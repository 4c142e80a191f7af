"""End-to-end TOPLOC + sampling checks with a tiny Qwen2 built from a config (no hub).

The helpers below are a minimal stand-in for the worker's engine (left-padded batched KV-cache
decode with :func:`protocol.sampling.sample`, final-norm rows captured by a forward hook on
``model.model.norm``) and the validator's prefill (one forward over prompt + completion, rows
:func:`protocol.toploc.rows_for_completion`). The model runs in float32; rows are committed in
bfloat16.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from protocol import sampling, toploc
from protocol.models import build_model
from protocol.runspec import ToplocSpec

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, N_NEW, PAD = 512, 128, 36, 0  # 36 tokens: a full chunk of 32 and a short one of 4
N_HONEST, BATCH = 200, 8
RUN_SEED, STEP, PEER = 1234, 7, "12D3KooWTestWorker"
# Thresholds for a deterministic fp32 engine (what a run could set in its spec when workers and
# validators both run fp32); the defaults are calibrated for bf16 GPU kernels.
FP32_PROFILE = {"max_mismatches": 4, "max_mant_err_mean": 0.1, "max_mant_err_median": 0.0}
LOGPROB = ToplocSpec()  # the run spec's default log-prob tolerances (fp32 on both sides, as here)


def _model(seed: int, layers: int = 3) -> torch.nn.Module:
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,  # spread-out logits, so a different model samples differently
        tie_word_embeddings=False,
        pad_token_id=PAD,
    )
    return build_model(cfg, seed=seed)


@contextmanager
def _capture(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the final-norm outputs ``[B, L, H]`` of every forward call."""
    seen: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@dataclasses.dataclass
class Rollout:
    prompt: list[int]
    seed: int
    tokens: list[int]
    logprobs: list[float]
    proofs: list[bytes]


def _left_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s) :] = torch.tensor(s)
        mask[b, width - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, pos


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], flip_sign: bool = False) -> list[Rollout]:
    """Worker side: batched KV-cache decode of ``N_NEW`` tokens, proofs over the committed rows."""
    ids, mask, pos = _left_pad(prompts)
    seed_t = torch.tensor(seeds, dtype=torch.int64)
    toks, lps, rows = [], [], []
    with _capture(model) as seen:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        for i in range(N_NEW):
            rows.append(seen[-1][:, -1])  # [B, H]: the row whose logits produce token i (position P-1+i)
            tok, lp = sampling.sample(out.logits[:, -1], seed_t, torch.full((len(prompts),), i, dtype=torch.int64))
            toks.append(tok)
            lps.append(lp)
            if i + 1 == N_NEW:
                break
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=out.cache, use_cache=True)
    hidden = torch.stack(rows, dim=1).to(torch.bfloat16)  # [B, N, H]
    if flip_sign:
        hidden = -hidden
    tokens, logprobs = torch.stack(toks, dim=1), torch.stack(lps, dim=1)  # [B, N]
    return [
        Rollout(prompts[b], seeds[b], tokens[b].tolist(), logprobs[b].tolist(), toploc.build_proofs(hidden[b]))
        for b in range(len(prompts))
    ]


@torch.no_grad()
def prefill(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validator side: one (left-padded, batched) forward over prompt + completion.

    Returns per pair the committed rows ``[n, H]`` bfloat16 and their logits ``[n, V]``.
    """
    seqs = [p + c for p, c in pairs]
    ids, mask, pos = _left_pad(seqs)
    with _capture(model) as seen:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    result = []
    for b, (p, c) in enumerate(pairs):
        offset = ids.shape[1] - len(seqs[b])
        rows = toploc.rows_for_completion(len(p), len(c))
        sel = slice(offset + rows.start, offset + rows.stop)
        result.append((seen[-1][b, sel].to(torch.bfloat16), out.logits[b, sel].float()))
    return result


Verdict = tuple[bool, bool, list[toploc.ChunkResult]]


def check_profiles(
    model: torch.nn.Module, rollouts: list[Rollout], profiles: dict[str, dict[str, float]], batch: int = 1
) -> dict[str, list[Verdict]]:
    """Validator: per threshold profile, (TOPLOC ok, replay + log-prob ok, chunk results) per rollout."""
    out: dict[str, list[Verdict]] = {name: [] for name in profiles}
    for i in range(0, len(rollouts), batch):
        group = rollouts[i : i + batch]
        for ro, (hidden, logits) in zip(group, prefill(model, [(r.prompt, r.tokens) for r in group])):
            replay = sampling.replay_check(logits, ro.tokens, ro.seed)
            recomputed = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ro.tokens)[:, None])[:, 0]
            sampling_ok = replay.ok and sampling.logprob_check(ro.logprobs, recomputed, max_abs=LOGPROB.logprob_max_abs,
                                                               mean_abs=LOGPROB.logprob_mean_abs).ok
            for name, thresholds in profiles.items():
                results = toploc.verify_proofs(hidden, ro.proofs, **thresholds)  # type: ignore[arg-type]
                out[name].append((all(r.ok for r in results), sampling_ok, results))
    return out


def check(model: torch.nn.Module, rollouts: list[Rollout], batch: int = 1, **thresholds: float) -> list[Verdict]:
    return check_profiles(model, rollouts, {"only": thresholds}, batch)["only"]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _seeds(n: int, offset: int = 0) -> list[int]:
    return [sampling.derive_sequence_seed(RUN_SEED, STEP, PEER, f"task-{(i + offset) // 4}", (i + offset) % 4) for i in range(n)]


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return _model(0)


@pytest.fixture(scope="module")
def honest(policy: torch.nn.Module) -> list[Rollout]:
    with _threads(1):
        prompts, seeds = _prompts(N_HONEST, 1), _seeds(N_HONEST)
        return [ro for i in range(0, N_HONEST, BATCH) for ro in generate(policy, prompts[i : i + BATCH], seeds[i : i + BATCH])]


def test_honest_rollouts_verify_no_false_rejections(policy: torch.nn.Module, honest: list[Rollout]) -> None:
    """Worker: batch 8, left padding, KV-cache decode, 1 thread. Validator: full prefill, batch 1
    with 1 thread and batch 8 with padding and 2 threads; default and fp32-profile thresholds."""
    assert len(honest) >= 200
    with _threads(1):
        single = check_profiles(policy, honest, {"batch1": {}, "batch1-fp32": FP32_PROFILE}, batch=1)
    with _threads(2):
        batched = check(policy, honest, batch=BATCH, **FP32_PROFILE)
    for name, res in {**single, "batch8-2threads-fp32": batched}.items():
        bad = [(i, r) for i, r in enumerate(res) if not (r[0] and r[1])]
        assert not bad, f"{name}: {len(bad)} false rejections, first {bad[0]}"
    worst = max(c.mant_err_mean for _, _, chunks in batched for c in chunks)
    assert worst <= FP32_PROFILE["max_mant_err_mean"]


def test_batch_size_does_not_change_the_worker_output(policy: torch.nn.Module, honest: list[Rollout]) -> None:
    with _threads(2):
        alone = generate(policy, [honest[3].prompt], [honest[3].seed])[0]
    assert alone.tokens == honest[3].tokens
    results = check(policy, [alone], **FP32_PROFILE)[0]
    assert results[0] and results[1]


def _assert_all_rejected(res: list[Verdict], *, by_toploc: bool = False, by_replay: bool = False) -> None:
    assert res
    for toploc_ok, replay_ok, chunks in res:
        assert not (toploc_ok and replay_ok), chunks
        if by_toploc:
            assert not toploc_ok, chunks
        if by_replay:
            assert not replay_ok


def test_perturbed_weights_rejected(policy: torch.nn.Module) -> None:
    """Relative noise 1e-3 in one layer's weights: below bf16 resolution for most entries, so
    only thresholds calibrated to a deterministic fp32 engine catch it (mean mantissa error
    ≈ 0.3 vs ≤ 0.02 for honest runs); the bf16-calibrated defaults do not (docs/toploc.md)."""
    cheat = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in cheat.model.layers[1].parameters():
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=g))
    with _threads(1):
        rollouts = generate(cheat, _prompts(BATCH, 2), _seeds(BATCH, 500))
        _assert_all_rejected(check(policy, rollouts, **FP32_PROFILE), by_toploc=True)


def test_different_model_rejected(policy: torch.nn.Module) -> None:
    with _threads(1):
        rollouts = generate(_model(1), _prompts(BATCH, 3), _seeds(BATCH, 600))
        _assert_all_rejected(check(policy, rollouts), by_toploc=True, by_replay=True)


def test_changed_prompt_token_rejected(policy: torch.nn.Module, honest: list[Rollout]) -> None:
    forged = []
    for ro in honest[:BATCH]:
        prompt = list(ro.prompt)
        prompt[0] = (prompt[0] % (VOCAB - 1)) + 1  # a different, non-pad token
        forged.append(dataclasses.replace(ro, prompt=prompt))
    with _threads(1):
        _assert_all_rejected(check(policy, forged), by_toploc=True)


def test_changed_completion_token_rejected(policy: torch.nn.Module, honest: list[Rollout]) -> None:
    forged = []
    for k, ro in enumerate(honest[:BATCH]):
        tokens = list(ro.tokens)
        j = 5 + 3 * k
        tokens[j] = (tokens[j] % (VOCAB - 1)) + 1
        forged.append(dataclasses.replace(ro, tokens=tokens))
    with _threads(1):
        _assert_all_rejected(check(policy, forged), by_toploc=True, by_replay=True)


def test_sign_flipped_activations_rejected(policy: torch.nn.Module) -> None:
    with _threads(1):
        rollouts = generate(policy, _prompts(BATCH, 4), _seeds(BATCH, 700), flip_sign=True)
        _assert_all_rejected(check(policy, rollouts), by_toploc=True)


def test_cheap_model_with_honest_prefill_proofs_caught_by_replay(policy: torch.nn.Module) -> None:
    """A cheaper model generates; the worker then prefills the policy to make valid proofs."""
    with _threads(1):
        cheap = generate(_model(2, layers=1), _prompts(BATCH, 5), _seeds(BATCH, 800))
        forged = []
        for ro, (hidden, _) in zip(cheap, prefill(policy, [(r.prompt, r.tokens) for r in cheap])):
            forged.append(dataclasses.replace(ro, proofs=toploc.build_proofs(hidden)))
        res = check(policy, forged)
    assert all(toploc_ok for toploc_ok, _, _ in res)  # TOPLOC alone is fooled
    _assert_all_rejected(res, by_replay=True)
