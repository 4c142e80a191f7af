"""Engine fit benchmark: the worker's memory plan (``node/engine/fit.py``) beside the memory a CPU worker's
engine really takes, for the Qwen2.5-0.5B shape at a few depths and batches.

Each configuration runs in its own process (a fresh peak): build the model (random weights, fp32
as the transformers engine computes), generate ``--batch`` completions of ``--new-tokens`` tokens from
prompts of ``--prompt-len`` tokens with the TransformersEngine (TOPLOC rows captured, as a worker
does), and report the process's peak resident memory (``ru_maxrss``). Beside it, the plan for the
same shape and workload: what it says the engine uses (weights + KV cache + other, the 1 GiB reserve
for the interpreter and libraries included). The plan is meant as an upper estimate: the ratio
plan / measured should be ≥ 1 and not far above it.

Usage::

    python benchmarks/fit_bench.py [--layers 4 8] [--batch 8 32] [--prompt-len 256] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(layers: int, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    import torch

    from benchmarks.profiles import QWEN25_05B, build_profile_model
    from node.engine.base import SamplingParams
    from node.engine.hf import TransformersEngine
    from protocol.models import embedded_tokenizer

    torch.set_num_threads(1)
    model = build_profile_model(layers)
    engine = TransformersEngine(model, embedded_tokenizer(), max_batch=batch)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, QWEN25_05B["vocab"], (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, eos_id=0, min_eos_prob=1.0)  # EOS never admitted
    engine.generate(prompts, list(range(1, batch + 1)), params)
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--child", type=int, nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    from benchmarks.profiles import QWEN25_05B
    from node.engine.fit import GiB, Machine, ModelShape, Workload, plan_engine

    print(f"{'layers':>6} {'batch':>5} {'plan GiB':>9} {'measured GiB':>13} {'plan / measured':>16}")
    for layers in args.layers:
        p = QWEN25_05B
        shape = ModelShape("qwen2.5-0.5b", layers=layers, hidden=p["hidden"], heads=p["heads"], kv_heads=p["kv_heads"],
                           head_dim=p["hidden"] // p["heads"], intermediate=p["intermediate"], vocab=p["vocab"])
        for batch in args.batch:
            work = Workload(batch, args.prompt_len, args.new_tokens)
            plan = plan_engine(shape, Machine(host_available_bytes=1 << 50), work, max_batch=batch)
            planned = plan.weights_bytes + plan.kv_bytes + plan.other_bytes
            out = subprocess.run([sys.executable, __file__, "--child", str(layers), str(batch), str(args.prompt_len), str(args.new_tokens)],
                                 capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
            measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
            print(f"{layers:>6} {batch:>5} {planned / GiB:>9.2f} {measured / GiB:>13.2f} {planned / measured:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
