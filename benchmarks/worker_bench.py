"""Worker benchmark: decode throughput of the TransformersEngine vs ``model.generate``, and TOPLOC overhead.

Both sides sample (temperature 1, top-p 1) from the same randomly initialised Qwen2 with the
same batch and completion length; EOS is disabled on both sides (the engine's EOS id is set to a
token the gate never allows, ``generate`` gets no EOS id), so every sequence decodes exactly
``--new-tokens`` tokens and the token counts are equal. Time is process CPU time on CPU (damps
machine load; the model is single-threaded unless ``--threads``) and wall time on CUDA.

Prints tokens/s of each, the engine/generate ratio (goal ≥ 1.5×), and the share of
:func:`protocol.toploc.build_proofs` time in generation + proof time (goal ≤ 2 %).

Usage::

    python benchmarks/worker_bench.py [--hidden 256 --layers 4 --vocab 4096 --batch 16 --new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from node.engine.base import SamplingParams
from node.engine.hf import TransformersEngine
from protocol import toploc
from protocol.models import build_model, embedded_config, embedded_tokenizer


def _clock(device: str) -> Callable[[], float]:
    if device == "cuda":

        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return wall
    return time.process_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    ap.add_argument("--batch", type=int, default=16, help="sequences per batch")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (equal for all sequences)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = _clock(args.device)

    model = build_model(embedded_config(args.vocab, hidden_size=args.hidden, layers=args.layers), seed=0).to(args.device)
    tok = embedded_tokenizer()
    engine = TransformersEngine(model, tok, device=args.device, max_batch=args.batch)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    prompt_lists = prompts.tolist()
    seeds = list(range(1, args.batch + 1))
    # eos_id = pad (0) with min_eos_prob 1.0: the gate never admits it, so no sequence stops early.
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, eos_id=0, min_eos_prob=1.0)
    n_tokens = args.batch * args.new_tokens

    def run_engine() -> float:
        t0 = clock()
        gens = engine.generate(prompt_lists, seeds, params)
        dt = clock() - t0
        assert all(len(x.completion_ids) == args.new_tokens for x in gens)
        return dt

    ids = prompts.to(args.device)
    attn = torch.ones_like(ids)

    def run_generate() -> float:
        t0 = clock()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0,
            )
        dt = clock() - t0
        assert out.shape[1] == args.prompt_len + args.new_tokens
        return dt

    gens = engine.generate(prompt_lists, seeds, params)  # warm-up (and rows for the proof timing)
    run_generate()
    t_engine, t_generate = [], []
    for _ in range(args.repeats):  # interleave so drifting machine load hits both alike
        t_engine.append(run_engine())
        t_generate.append(run_generate())
    e_s, g_s = statistics.median(t_engine), statistics.median(t_generate)

    t_proof = []
    for _ in range(args.repeats):
        t0 = time.process_time()
        for x in gens:
            toploc.build_proofs(x.hidden)
        t_proof.append(time.process_time() - t0)
    p_s = statistics.median(t_proof)

    unit = "CPU s" if args.device == "cpu" else "s"
    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; device {args.device}, {args.threads} thread(s)")
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens ({n_tokens} tokens per run), median of {args.repeats}")
    print(f"TransformersEngine.generate : {e_s:7.3f} {unit}  {n_tokens / e_s:9.1f} tok/s")
    print(f"model.generate (sampling)   : {g_s:7.3f} {unit}  {n_tokens / g_s:9.1f} tok/s")
    print(f"ratio engine / generate     : {g_s / e_s:7.2f}x  (goal >= 1.5x)")
    print(f"TOPLOC build_proofs         : {p_s:7.3f} CPU s for {len(gens)} completions "
          f"({-(-args.new_tokens // 32)} proofs each); share of generation+proofs {100 * p_s / (e_s + p_s):.2f}% (goal <= 2%)")


if __name__ == "__main__":
    main()
