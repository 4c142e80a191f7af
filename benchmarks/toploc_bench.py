"""Benchmark TOPLOC proof building and verification against the reference ``toploc==0.1.6``.

Times ``protocol.toploc.build_proofs`` / ``verify_proofs`` per chunk at the given shapes
(default ``[32, 5120]`` and ``[32, 896]``, i.e. one chunk of 32 rows) and, for batched use, on
``--batch-chunks`` chunks at once. With ``--reference-python`` (an interpreter where the
reference is installed, built from source against torch 2.13, e.g. ``/work/refenv-toploc/bin/python``)
it times the reference's tensor path (``build_proofs_bytes`` / ``verify_proofs_bytes`` with
``skip_prefill=True``) on the same inputs in a subprocess and prints ours / reference ratios
(< 1.0 means we are faster). Samples of both sides are interleaved (so load from other processes
hits both alike) and measured in process CPU time (``time.process_time``, so time spent
descheduled on a busy machine does not count); the minimum sample is reported, in microseconds
of CPU time per chunk. "equal proofs" counts byte-identical proofs; on Gaussian inputs a few differ because the
reference's ``torch.topk`` breaks ties at the k-th magnitude arbitrarily, ours by lower index.

``--profile qwen2.5-0.5b`` (``benchmarks/profiles.py``; ``--layers`` to shorten it) runs the
worker-overhead part at that shape with 256-token completions; ``--hidden 896 --repeat 3`` keeps
the per-chunk part short.

Usage::

    python benchmarks/toploc_bench.py --reference-python /work/refenv-toploc/bin/python
    python benchmarks/toploc_bench.py --profile qwen2.5-0.5b --layers 4 --hidden 896 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiles import PROFILES, build_profile_model
from protocol import toploc

_REFERENCE_SERVER = r"""
import json, sys, time, timeit, torch
import toploc
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
inputs = {}
for rows, hidden, seed in cfg["shapes"]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    proofs = toploc.build_proofs_bytes(h, 32, 128, skip_prefill=True)
    toploc.verify_proofs_bytes(h, proofs, 32, 128, skip_prefill=True)
    inputs[f"{rows}x{hidden}"] = (h, proofs)
print(json.dumps({k: [p.hex() for p in v[1]] for k, v in inputs.items()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    h, proofs = inputs[req["shape"]]
    if req["op"] == "build":
        fn = lambda: toploc.build_proofs_bytes(h, 32, 128, skip_prefill=True)
    else:
        fn = lambda: toploc.verify_proofs_bytes(h, proofs, 32, 128, skip_prefill=True)
    print(json.dumps(timeit.timeit(fn, number=req["number"], timer=time.process_time) / req["number"]), flush=True)
"""
"""Runs in the reference's interpreter: prints its proofs, then times one request per stdin line."""


def _input(rows: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).to(torch.bfloat16)  # same bits in both processes


def _worker_overhead(batch: int, n_new: int, model: torch.nn.Module | None = None) -> tuple[float, float]:
    """Decode ``batch`` x ``n_new`` tokens (KV cache, seeded sampling with the default rule) and
    build the proofs of every sequence. ``model``: default a tiny Qwen2 (hidden 128, 4 layers,
    vocab 4096).

    Returns:
        ``(decode_s, proofs_s)``: seconds of CPU time for the decode loop and for the proofs.
    """
    import transformers

    from protocol import sampling
    from protocol.models import build_model

    if model is None:
        cfg = transformers.Qwen2Config(
            vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
        )
        model = build_model(cfg, seed=0)
    vocab = int(model.config.vocab_size)
    rows: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: rows.append(out[:, -1].detach()))
    ids = torch.randint(3, vocab, (batch, 16), generator=torch.Generator().manual_seed(0))
    seeds = torch.arange(batch, dtype=torch.int64)
    start = time.process_time()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for i in range(n_new):
            tok, _ = sampling.sample(out.logits[:, -1], seeds, torch.full((batch,), i, dtype=torch.int64))
            if i + 1 < n_new:
                out = model(input_ids=tok[:, None], cache=out.cache, use_cache=True)
    decode_s = time.process_time() - start
    hook.remove()
    hidden = torch.stack(rows[:n_new], dim=1).to(torch.bfloat16)  # [B, N, H]
    start = time.process_time()
    for b in range(batch):
        toploc.build_proofs(hidden[b])
    return decode_s, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[5120, 896], help="hidden sizes H (rows = 32 per chunk)")
    parser.add_argument("--batch-chunks", type=int, default=16, help="also time [32*N, H] inputs of N chunks; 0: skip")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both processes")
    parser.add_argument("--number", type=int, default=20, help="calls per timing sample")
    parser.add_argument("--repeat", type=int, default=15, help="samples per side, interleaved ours/reference (minimum reported)")
    parser.add_argument("--reference-python", default=None, help="interpreter with toploc==0.1.6 installed")
    parser.add_argument("--worker-tokens", type=int, default=None, help="tokens per sequence for the worker-overhead run "
                        "(default 128, 256 with --profile); 0: skip")
    parser.add_argument("--profile", choices=PROFILES, default=None, help="worker-overhead run at this shape (benchmarks/profiles.py)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the --profile model (default 24)")
    parser.add_argument("--worker-batch", type=int, default=8, help="sequences in the worker-overhead run")
    args = parser.parse_args()
    if args.worker_tokens is None:
        args.worker_tokens = 256 if args.profile else 128

    torch.set_num_threads(args.threads)
    shapes = [(32, h, 1000 + i) for i, h in enumerate(args.hidden)]
    if args.batch_chunks > 0:
        shapes += [(32 * args.batch_chunks, h, 2000 + i) for i, h in enumerate(args.hidden)]
    inputs = {f"{r}x{h}": _input(r, h, s) for r, h, s in shapes}
    proofs = {key: toploc.build_proofs(h) for key, h in inputs.items()}
    calls = {(key, "build"): (lambda h=h: toploc.build_proofs(h)) for key, h in inputs.items()} | {
        (key, "verify"): (lambda h=h, p=proofs[key]: toploc.verify_proofs(h, p)) for key, h in inputs.items()
    }

    server = None
    ref_hex: dict[str, list[str]] = {}
    if args.reference_python:
        check = subprocess.run([args.reference_python, "-c", "import importlib.metadata as m, toploc; print(m.version('toploc'))"],
                               capture_output=True, text=True, check=False)
        if check.returncode != 0 or check.stdout.strip() != "0.1.6":
            got = check.stdout.strip() or (check.stderr.strip().splitlines() or ["?"])[-1]
            raise SystemExit(f"--reference-python {args.reference_python} has no toploc 0.1.6 ({got[:120]}): in a venv with torch==2.13.0, "
                             "pip install --no-deps --no-build-isolation --no-binary toploc toploc==0.1.6 (≈ 5 min build)")
        cfg = {"shapes": shapes, "threads": args.threads}
        server = subprocess.Popen(
            [args.reference_python, "-c", _REFERENCE_SERVER, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdin and server.stdout
        ref_hex = json.loads(server.stdout.readline())

    ours = {op: math.inf for op in calls}
    ref = {op: math.inf for op in calls}
    for _ in range(args.repeat):  # interleave so load from other processes hits both sides alike
        for (key, op), fn in calls.items():
            n_chunks = -(-inputs[key].shape[0] // 32)
            ours[(key, op)] = min(
                ours[(key, op)], timeit.timeit(fn, number=args.number, timer=time.process_time) / args.number / n_chunks
            )
            if server:
                assert server.stdin and server.stdout
                server.stdin.write(json.dumps({"shape": key, "op": op, "number": args.number}) + "\n")
                server.stdin.flush()
                ref[(key, op)] = min(ref[(key, op)], json.loads(server.stdout.readline()) / n_chunks)
    if server:
        assert server.stdin
        server.stdin.close()
        server.wait(timeout=60)

    print(
        f"TOPLOC per-chunk CPU time, µs (torch threads={args.threads}; min of {args.repeat} interleaved samples x {args.number} calls)"
    )
    header = f"{'shape':>12} {'op':>7} {'ours':>10}"
    if server:
        header += f" {'toploc 0.1.6':>13} {'ratio':>7} {'equal proofs':>13}"
    print(header)
    for (key, op), mine in ours.items():
        line = f"{key:>12} {op:>7} {mine * 1e6:>10.1f}"
        if server:
            pairs = list(zip([p.hex() for p in proofs[key]], ref_hex[key]))
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            line += f" {ref[(key, op)] * 1e6:>13.1f} {mine / ref[(key, op)]:>6.2f}x {same:>13}"
        print(line)
    if args.worker_tokens > 0:
        model = build_profile_model(args.layers) if args.profile else None
        label = f"{args.profile} shape, {args.layers or 24} layers" if args.profile else "tiny Qwen2"
        decode_s, proofs_s = _worker_overhead(args.worker_batch, args.worker_tokens, model)
        share = proofs_s / (decode_s + proofs_s)
        print(
            f"worker ({label}, {args.worker_batch} x {args.worker_tokens} tokens): decode {decode_s * 1e3:.0f} ms CPU, "
            f"proofs {proofs_s * 1e3:.1f} ms CPU = {100 * share:.2f}% of decode + proofs (goal <= 2%: {'met' if share <= 0.02 else 'missed'})"
        )


if __name__ == "__main__":
    main()
