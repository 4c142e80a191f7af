"""Tests of node.engine.hf.TransformersEngine on a tiny Qwen2 (protocol.models, no hub).

Covers: identical outputs across batch sizes and padding, committed rows that line up with the
validator's prefill (TOPLOC accepts them), finish reasons and the EOS gate, and live weight swaps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.engine import SamplingParams, create_engine
from node.engine.hf import TransformersEngine
from protocol import sampling, toploc
from protocol.inference import prefill_completions
from protocol.models import build_model, embedded_config, embedded_tokenizer, save_model

EOS, PAD = 1, 0
VOCAB = len(embedded_tokenizer())  # 99: <pad>, <eos>, <unk> and 96 characters
N_PROMPTS = 12
EOS_SCALE = 4.0  # norm of the EOS output row: P(EOS) spans ≈ 0.001 … 0.9 over positions


def _model(seed: int, eos_row: bool = False) -> torch.nn.Module:
    """The embedded-size Qwen2 (hidden 128, 2 layers, vocab 99), untied so the EOS row can be set."""
    cfg = embedded_config(VOCAB)
    cfg.tie_word_embeddings = False
    model = build_model(cfg, seed=seed)
    if eos_row:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(cfg.hidden_size, generator=g)
        with torch.no_grad():
            model.lm_head.weight[EOS] = EOS_SCALE * w / w.norm()  # logit_EOS = h·w ~ N(0, EOS_SCALE²) for RMS-normed h
    return model


def _prompts(n: int = N_PROMPTS) -> list[list[int]]:
    """Prompts of 3 … 3+2(n-1) tokens (different lengths, so batches are padded)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def _seeds(n: int = N_PROMPTS) -> list[int]:
    return [sampling.derive_sequence_seed(5, 0, "12D3KooWEngineTest", f"t{i}", i % 4) for i in range(n)]


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return TransformersEngine(_model(0), embedded_tokenizer(), max_batch=64)


def test_outputs_equal_across_batch_sizes(engine: TransformersEngine) -> None:
    prompts, seeds = _prompts(), _seeds()
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, eos_id=EOS)
    runs = []
    for max_batch in (1, 8, 64):
        engine.max_batch = max_batch
        runs.append(engine.generate(prompts, seeds, params))
    engine.max_batch = 64
    ref = runs[0]
    assert len({tuple(g.completion_ids.tolist()) for g in ref}) == N_PROMPTS  # the seeds really differ
    for other in runs[1:]:
        for a, b in zip(ref, other, strict=True):
            assert torch.equal(a.completion_ids, b.completion_ids)
            assert a.finish == b.finish
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
            torch.testing.assert_close(a.hidden.float(), b.hidden.float(), atol=0.05, rtol=0.02)
    # a prompt's output does not depend on its neighbours either: reordering changes nothing
    rev = engine.generate(prompts[::-1], seeds[::-1], params)[::-1]
    assert all(torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(ref, rev, strict=True))


def test_shapes_and_logprobs_match_the_sampling_rule(engine: TransformersEngine) -> None:
    prompts, seeds = _prompts(4), _seeds(4)
    params = SamplingParams(max_tokens=10, temperature=0.7, eos_id=EOS)
    gens = engine.generate(prompts, seeds, params)
    pre = prefill_completions(engine.model, prompts, [g.completion_ids.tolist() for g in gens], PAD)
    for g, p, seed in zip(gens, pre, seeds, strict=True):
        n = len(g.completion_ids)
        assert g.completion_ids.dtype == torch.int64 and g.logprobs.dtype == torch.float32
        assert g.hidden.dtype == torch.bfloat16 and g.hidden.shape == (n, 128)
        replay = sampling.replay_check(p.logits, g.completion_ids, seed, sampling.ReplayParams(temperature=0.7, eos_ids=(EOS,)))
        assert replay.ok and replay.hard_mismatches == 0 and replay.near_ties == 0
        expected = torch.log_softmax(p.logits.double() / 0.7, -1).gather(-1, g.completion_ids[:, None])[:, 0]
        torch.testing.assert_close(g.logprobs.double(), expected, atol=1e-4, rtol=0)


def test_hidden_rows_line_up_with_toploc_positions(engine: TransformersEngine) -> None:
    prompts, seeds = _prompts(), _seeds()
    params = SamplingParams(max_tokens=40, eos_id=EOS, min_eos_prob=1.0)  # 40 rows: a full chunk of 32 and one of 8
    gens = engine.generate(prompts, seeds, params)
    completions = [g.completion_ids.tolist() for g in gens]
    pre = prefill_completions(engine.model, prompts, completions, PAD)
    for g, p in zip(gens, pre, strict=True):
        assert g.hidden.shape == p.hidden.shape == (40, 128)
        torch.testing.assert_close(g.hidden.float(), p.hidden.float(), atol=0.05, rtol=0.02)
        results = toploc.verify_proofs(p.hidden, toploc.build_proofs(g.hidden))
        assert len(results) == 2 and all(r.ok for r in results), [r.reason for r in results]
    # one row off (what a decode-only capture would commit) is rejected
    shifted = prefill_completions(engine.model, [p + c[:1] for p, c in zip(prompts, completions)], [c[1:] + [5] for c in completions], PAD)
    bad = toploc.verify_proofs(shifted[0].hidden, toploc.build_proofs(gens[0].hidden))
    assert not all(r.ok for r in bad)


def test_finish_reasons_and_eos_gate() -> None:
    model = _model(3, eos_row=True)
    eng = TransformersEngine(model, embedded_tokenizer(), max_batch=64)
    prompts = _prompts(16) * 4
    seeds = [sampling.derive_sequence_seed(9, 0, "12D3KooWEosGate", "eos", i) for i in range(len(prompts))]
    floor, max_tokens = 0.3, 20

    def final_p_eos(gens: list) -> list[float]:
        pre = prefill_completions(model, prompts, [g.completion_ids.tolist() for g in gens], PAD)
        return [float(torch.softmax(p.logits[-1].double(), -1)[EOS]) for p in pre]

    ungated = eng.generate(prompts, seeds, SamplingParams(max_tokens=max_tokens, eos_id=EOS, min_eos_prob=0.0))
    gated = eng.generate(prompts, seeds, SamplingParams(max_tokens=max_tokens, eos_id=EOS, min_eos_prob=floor))
    for gens in (ungated, gated):
        for g in gens:
            ids = g.completion_ids.tolist()
            assert EOS not in ids[:-1]  # generation stops at the first EOS
            if g.finish == "eos":
                assert ids[-1] == EOS and 1 <= len(ids) <= max_tokens
            else:
                assert g.finish == "length" and len(ids) == max_tokens and ids[-1] != EOS
        assert {g.finish for g in gens} == {"eos", "length"}
    # without the gate some completions stop where P(EOS) < floor; with it none does
    p_ungated = [p for p, g in zip(final_p_eos(ungated), ungated, strict=True) if g.finish == "eos"]
    p_gated = [p for p, g in zip(final_p_eos(gated), gated, strict=True) if g.finish == "eos"]
    assert min(p_ungated) < floor
    assert p_gated and min(p_gated) >= floor - 1e-4
    for g, p in zip(gated, prefill_completions(model, prompts, [g.completion_ids.tolist() for g in gated], PAD), strict=True):
        term = sampling.termination_check(p.logits[-1], g.completion_ids, (EOS,), max_tokens, min_eos_prob=floor, eos_prob_slack=1e-3)
        assert term.ok, term.reason


def test_load_weights_hot_swap_equals_fresh_engine(tmp_path: Path) -> None:
    tok = embedded_tokenizer()
    save_model(_model(0), tok, tmp_path / "a")
    save_model(_model(1), tok, tmp_path / "b")
    prompts, seeds = _prompts(6), _seeds(6)
    params = SamplingParams(max_tokens=16, eos_id=EOS)
    eng = create_engine("transformers", tmp_path / "a", max_batch=4)
    before = eng.generate(prompts, seeds, params)
    eng.load_weights(tmp_path / "b")
    after = eng.generate(prompts, seeds, params)
    fresh = create_engine("transformers", tmp_path / "b", max_batch=4).generate(prompts, seeds, params)
    assert any(not torch.equal(x.completion_ids, y.completion_ids) for x, y in zip(before, after, strict=True))
    for x, y in zip(after, fresh, strict=True):
        assert torch.equal(x.completion_ids, y.completion_ids)
        assert torch.equal(x.logprobs, y.logprobs)
        assert torch.equal(x.hidden, y.hidden)
    eng.load_weights(tmp_path / "a")  # and back
    again = eng.generate(prompts, seeds, params)
    assert all(torch.equal(x.completion_ids, y.completion_ids) for x, y in zip(before, again, strict=True))


def test_generate_rejects_mismatched_seeds(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError):
        engine.generate(_prompts(2), _seeds(3), SamplingParams(max_tokens=2))


# --- the default sampling rule (icdf-v1) at a real vocabulary size ---------------------------------

BIG_VOCAB = 32_768


def _no_cache_generate(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[list[int]]:
    """An honest worker without a KV cache: a full forward over prompt + tokens so far at every step."""
    out = []
    for prompt, seed in zip(prompts, seeds, strict=True):
        ids: list[int] = []
        for i in range(params.max_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + ids])).logits[:, -1]
            tok, _ = sampling.sample(logits, torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed]), torch.tensor([i]),
                                     params.temperature, params.top_p, (params.eos_id,), params.min_eos_prob, params.rule)
            ids.append(int(tok))
            if ids[-1] == params.eos_id:
                break
        out.append(ids)
    return out


@pytest.mark.slow
def test_honest_rollouts_replay_at_large_vocabulary() -> None:
    """0 false rejections over 208 rollouts at vocabulary 32,768 under the default rule (EOS gate 0.1;
    top-p is replayed at vocabulary 500 in tests/protocol/test_sampling.py): engines batching 1, 8 or 64 sequences on 1 or 2 threads with the KV cache, and a
    worker without a KV cache, all replayed against batched prefills of 64 rollouts (other shapes,
    other reduction orders: the logits differ in the last bits)."""
    model = build_model(embedded_config(BIG_VOCAB, hidden_size=64, layers=1), seed=4)
    with torch.no_grad():  # a sharper head than random init, so completions hit both flat and peaked rows
        model.lm_head.weight.mul_(torch.linspace(1.0, 40.0, BIG_VOCAB)[:, None] ** 0.5)
    eng = TransformersEngine(model, embedded_tokenizer(), max_batch=64)
    g = torch.Generator().manual_seed(1)
    temperature, top_p, n = 0.8, 1.0, 64
    prompts = [torch.randint(3, BIG_VOCAB, (2 + i % 7,), generator=g).tolist() for i in range(n)]
    seeds = [sampling.derive_sequence_seed(3, 0, "12D3KooWBigVocab", f"t{i}", i % 8) for i in range(n)]
    params = SamplingParams(max_tokens=8, temperature=temperature, top_p=top_p, eos_id=EOS, min_eos_prob=0.1)
    assert params.rule == sampling.RULE_ICDF
    threads = torch.get_num_threads()
    runs: list[tuple[str, list[list[int]], list[float] | None]] = []
    try:
        for max_batch, n_threads in [(1, 1), (8, 2), (64, 1)]:
            torch.set_num_threads(n_threads)
            eng.max_batch = max_batch
            for gen in eng.generate(prompts, seeds, params):
                runs.append((f"batch {max_batch}, {n_threads} threads", gen.completion_ids.tolist(), gen.logprobs.tolist()))
        torch.set_num_threads(1)
        runs += [("no KV cache", ids, None) for ids in _no_cache_generate(model, prompts[:16], seeds[:16], params)]
        torch.set_num_threads(1)  # the validator: one batched prefill per 64 rollouts
        near = tokens = 0
        for lo in range(0, len(runs), 64):
            chunk = runs[lo : lo + 64]
            pre = prefill_completions(model, [prompts[i % n] for i in range(lo, lo + len(chunk))], [r[1] for r in chunk], PAD)
            for i, ((label, ids, lps), p) in enumerate(zip(chunk, pre, strict=True), start=lo):
                replay = sampling.replay_check(p.logits, ids, seeds[i % n], sampling.ReplayParams(temperature=temperature, top_p=top_p, eos_ids=(EOS,), min_eos_prob=0.1))
                assert replay.ok, f"{label}, prompt {i % n}: {replay.reason}"
                near, tokens = near + replay.near_ties, tokens + len(ids)
                if lps is not None:
                    assert replay.logprobs is not None
                    assert float((replay.logprobs - torch.tensor(lps, dtype=torch.float64)).abs().max()) <= 1e-2
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 208 and near <= 0.01 * tokens  # near ties are rare at float32 noise


# --- the preallocated-cache decode step (node/engine/static_decode.py) ------------------------------


@pytest.mark.parametrize(
    ("heads", "kv_heads", "padded"),
    [(4, 2, True), (4, 2, False), (4, 4, True), (4, 4, False), (8, 1, True)],
    ids=["gqa-padded", "gqa-unpadded", "mha-padded", "mha-unpadded", "mqa-padded"],
)
def test_static_decode_is_bit_identical_to_transformers_decode(heads: int, kv_heads: int, padded: bool) -> None:
    """Tokens, log-probs, committed rows and finish reasons of the preallocated-cache decode equal the
    transformers decode bit for bit (same ops in the same order), with and without padding, for
    grouped, multi- and single-KV-head attention, top-p, temperature and the EOS gate."""
    from benchmarks.profiles import qwen_config
    from node.engine.static_decode import supports

    model = build_model(qwen_config(VOCAB, 128, 2, heads, kv_heads, 256), seed=heads + kv_heads)
    with torch.no_grad():  # an EOS row strong enough that some completions stop early
        model.lm_head.weight[EOS] = EOS_SCALE * model.lm_head.weight[EOS] / model.lm_head.weight[EOS].norm()
    assert supports(model)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, ((3 + 2 * i) if padded else 9,), generator=g).tolist() for i in range(10)]
    seeds = _seeds(10)
    eng = TransformersEngine(model, embedded_tokenizer(), max_batch=64)
    finishes = []
    for params in (SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, eos_id=EOS, min_eos_prob=0.05),
                   SamplingParams(max_tokens=30, eos_id=EOS),  # no gate: rows stop early, at different steps
                   SamplingParams(max_tokens=30, eos_id=EOS, min_eos_prob=1.0)):  # EOS gated off: all run to max_tokens
        eng.static_decode = False
        ref = eng.generate(prompts, seeds, params)
        eng.static_decode = True
        new = eng.generate(prompts, seeds, params)
        for a, b in zip(ref, new, strict=True):
            assert torch.equal(a.completion_ids, b.completion_ids)
            assert torch.equal(a.logprobs, b.logprobs)
            assert torch.equal(a.hidden, b.hidden)
            assert a.finish == b.finish
        finishes.append({x.finish for x in ref})
    assert "eos" in finishes[1] and finishes[2] == {"length"}


def test_models_the_static_decode_does_not_mirror_decode_through_transformers() -> None:
    """An eager-attention model is not mirrored by the static decode step; the engine decodes it the
    transformers way, and its tokens replay under the validator's prefill."""
    from node.engine.static_decode import supports

    model = _model(0)
    model.config._attn_implementation = "eager"
    assert not supports(model)
    eng = TransformersEngine(model, embedded_tokenizer(), max_batch=64)
    prompts, seeds = _prompts(4), _seeds(4)
    gens = eng.generate(prompts, seeds, SamplingParams(max_tokens=12, eos_id=EOS, min_eos_prob=1.0))
    pre = prefill_completions(model, prompts, [x.completion_ids.tolist() for x in gens], PAD)
    for x, p, seed in zip(gens, pre, seeds, strict=True):
        assert sampling.replay_check(p.logits, x.completion_ids, seed, sampling.ReplayParams(eos_ids=(EOS,), min_eos_prob=1.0)).ok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_decode_on_cuda_is_accepted_by_a_cpu_validator() -> None:
    """On CUDA the static decode step runs without host synchronisation, and what it generates
    (padded batch, GQA, EOS gate) replays and passes TOPLOC against the validator's CPU prefill."""
    from benchmarks.profiles import qwen_config
    from node.engine.static_decode import StaticDecoder

    cpu_model = build_model(qwen_config(VOCAB, 128, 2, 4, 2, 256), seed=5)
    eng = TransformersEngine(build_model(qwen_config(VOCAB, 128, 2, 4, 2, 256), seed=5), embedded_tokenizer(), device="cuda")
    inner_step = StaticDecoder.step
    calls = [0]

    def no_sync_step(self: StaticDecoder, tokens: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner_step(self, tokens, position_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    prompts, seeds = _prompts(8), _seeds(8)
    params = SamplingParams(max_tokens=40, temperature=0.9, eos_id=EOS, min_eos_prob=0.05)
    StaticDecoder.step = no_sync_step  # type: ignore[method-assign]
    try:
        gens = eng.generate(prompts, seeds, params)
    finally:
        StaticDecoder.step = inner_step  # type: ignore[method-assign]
    assert calls[0] > 0
    pre = prefill_completions(cpu_model, prompts, [g.completion_ids.tolist() for g in gens], PAD)
    for g, p, seed in zip(gens, pre, seeds, strict=True):
        replay = sampling.replay_check(p.logits, g.completion_ids, seed, sampling.ReplayParams(temperature=0.9, eos_ids=(EOS,), min_eos_prob=0.05))
        assert replay.ok and replay.hard_mismatches == 0, replay.reason
        assert all(r.ok for r in toploc.verify_proofs(p.hidden, toploc.build_proofs(g.hidden)))


# --- compute dtype: bf16 workers (issue 33) -------------------------------------------------------


def _reported_logprob_error(gens: list, model: torch.nn.Module, prompts: list[list[int]], temperature: float) -> list[float]:
    """Per completion, the largest |reported − float32-recomputed| sampling log-prob, nats."""
    pre = prefill_completions(model, prompts, [g.completion_ids.tolist() for g in gens], PAD)
    out = []
    for g, p in zip(gens, pre, strict=True):
        ref = torch.log_softmax(p.logits.double() / temperature, -1).gather(-1, g.completion_ids[:, None])[:, 0]
        out.append(float((g.logprobs.double() - ref).abs().max()))
    return out


def test_bf16_engine_generates_with_bf16_noise_and_fp32_default_is_unchanged() -> None:
    """A bf16 engine (weights, forward and KV cache in bf16, sampler fed float32 logits) generates
    completions of the right shapes and dtypes; its log-probs differ from the float32 policy's by
    bf16 noise (not bit-identical, far below the bf16 spec's 2-nat bound) and its tokens replay
    under ``logit-bound-v1``; the default engine stays float32 and exact."""
    import copy

    model = _model(0, eos_row=True)
    prompts, seeds = _prompts(), _seeds()
    params = SamplingParams(max_tokens=24, temperature=0.9, eos_id=EOS, min_eos_prob=0.05)
    fp32 = TransformersEngine(copy.deepcopy(model), embedded_tokenizer())
    bf16 = TransformersEngine(copy.deepcopy(model), embedded_tokenizer(), compute_dtype=torch.bfloat16)
    head = TransformersEngine(copy.deepcopy(model), embedded_tokenizer(), compute_dtype=torch.bfloat16, fp32_head=True)
    assert fp32.compute_dtype == torch.float32 and all(p.dtype == torch.float32 for p in fp32.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert head.head_fp32 is not None and head.head_fp32.dtype == torch.float32
    runs = {name: eng.generate(prompts, seeds, params) for name, eng in (("fp32", fp32), ("bf16", bf16), ("bf16 fp32 head", head))}
    errors = {name: _reported_logprob_error(gens, model, prompts, 0.9) for name, gens in runs.items()}
    assert max(errors["fp32"]) < 1e-4  # the default: the validator's arithmetic
    for name in ("bf16", "bf16 fp32 head"):
        assert 1e-4 < max(errors[name]) < 0.5, (name, errors[name])  # bf16 noise, not bit-identical, far inside δ
        pre = prefill_completions(model, prompts, [g.completion_ids.tolist() for g in runs[name]], PAD)
        for g, p, seed in zip(runs[name], pre, seeds, strict=True):
            n = len(g.completion_ids)
            assert g.completion_ids.dtype == torch.int64 and g.logprobs.dtype == torch.float32 and g.logprobs.shape == (n,)
            assert g.hidden.dtype == torch.bfloat16 and g.hidden.shape == (n, 128)
            assert g.finish == ("eos" if g.completion_ids[-1] == EOS else "length")
            replay = sampling.replay_check(p.logits, g.completion_ids, seed, sampling.ReplayParams(
                temperature=0.9, eos_ids=(EOS,), min_eos_prob=0.05, max_near_tie_fraction=0.5, replay_rule="logit-bound-v1", logit_bound=1.0))
            assert replay.ok, (name, replay.reason)
    # the head's rounding is part of the noise: the two bf16 variants do not report the same log-probs
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(runs["bf16"], runs["bf16 fp32 head"], strict=True))


def test_bf16_engine_from_dir_keeps_its_dtype_across_weight_swaps(tmp_path: Path) -> None:
    """``create_engine(dtype="bfloat16", fp32_head=True)`` loads a float32 checkpoint into bf16 with a
    float32 head, and a hot swap gives what a fresh engine on the new weights gives."""
    tok = embedded_tokenizer()
    save_model(_model(0), tok, tmp_path / "a")
    save_model(_model(1), tok, tmp_path / "b")
    prompts, seeds = _prompts(6), _seeds(6)
    params = SamplingParams(max_tokens=12, eos_id=EOS)
    eng = create_engine("transformers", tmp_path / "a", dtype="bfloat16", fp32_head=True)
    assert isinstance(eng, TransformersEngine) and eng.head_fp32 is not None
    eng.load_weights(tmp_path / "b")
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    assert torch.equal(eng.head_fp32, _model(1).lm_head.weight.detach())  # the checkpoint's float32 head, not a bf16 one
    fresh = create_engine("transformers", tmp_path / "b", dtype="bfloat16", fp32_head=True)
    for x, y in zip(eng.generate(prompts, seeds, params), fresh.generate(prompts, seeds, params), strict=True):
        assert torch.equal(x.completion_ids, y.completion_ids) and torch.equal(x.logprobs, y.logprobs) and torch.equal(x.hidden, y.hidden)
    with pytest.raises(ValueError, match="fp32_head"):
        create_engine("transformers", tmp_path / "a", fp32_head=True)
    with pytest.raises(ValueError, match="compute dtype"):
        create_engine("transformers", tmp_path / "a", dtype="float16")


def test_engines_sample_by_gumbel_v2_when_the_run_names_it() -> None:
    """Under ``sampling.rule = "gumbel-v2"`` the engine decodes by that rule: its float32 tokens are what the
    rule gives for the prefill's logits (gap 0 at every position), a bf16 engine's tokens replay within the
    bound, and the completions differ from ``icdf-v1``'s for the same seeds (the rule is applied)."""
    import copy

    model = _model(0, eos_row=True)
    prompts, seeds = _prompts(), _seeds()
    params = SamplingParams(max_tokens=24, temperature=0.9, eos_id=EOS, min_eos_prob=0.05, rule=sampling.RULE_GUMBEL)
    replay = sampling.ReplayParams(temperature=0.9, eos_ids=(EOS,), min_eos_prob=0.05, max_near_tie_fraction=0.5, rule=sampling.RULE_GUMBEL,
                                   replay_rule="logit-bound-v1", logit_bound=1.0)
    fp32 = TransformersEngine(copy.deepcopy(model), embedded_tokenizer())
    bf16 = TransformersEngine(copy.deepcopy(model), embedded_tokenizer(), compute_dtype=torch.bfloat16, fp32_head=True)
    runs = {"fp32": fp32.generate(prompts, seeds, params), "bf16": bf16.generate(prompts, seeds, params)}
    for name, gens in runs.items():
        pre = prefill_completions(model, prompts, [g.completion_ids.tolist() for g in gens], PAD)
        for g, p, seed in zip(gens, pre, seeds, strict=True):
            res = sampling.replay_check(p.logits, g.completion_ids, seed, replay)
            assert res.ok, (name, res.reason)
            if name == "fp32":
                assert float(res.gaps.max()) == 0.0 and not bool(res.differs.any())
    icdf = fp32.generate(prompts, seeds, SamplingParams(max_tokens=24, temperature=0.9, eos_id=EOS, min_eos_prob=0.05))
    assert any(a.completion_ids.tolist() != b.completion_ids.tolist() for a, b in zip(icdf, runs["fp32"], strict=True))
