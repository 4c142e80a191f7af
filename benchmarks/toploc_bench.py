"""Benchmark TOPLOC proof building and verification against the reference ``toploc==0.1.6``.

Times ``protocol.toploc.build_proofs`` / ``verify_proofs`` per chunk at the given shapes
(default ``[32, 5120]`` and ``[32, 896]``, i.e. one chunk of 32 rows) and, for batched use, on
``--batch-chunks`` chunks at once. With ``--reference-python`` (an interpreter where the
reference is installed, built from source against torch 2.13, e.g. ``/work/refenv-toploc/bin/python``)
it times the reference's tensor path (``build_proofs_bytes`` / ``verify_proofs_bytes`` with
``skip_prefill=True``) on the same inputs in a subprocess and prints ours / reference ratios
(< 1.0 means we are faster). Timings are the minimum over repeats and over ``--rounds``
alternating rounds (so load from other processes hits both sides alike), in microseconds per
chunk. "equal proofs" counts byte-identical proofs; on Gaussian inputs a few differ because the
reference's ``torch.topk`` breaks ties at the k-th magnitude arbitrarily, ours by lower index.

Usage::

    python benchmarks/toploc_bench.py --reference-python /work/refenv-toploc/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol import toploc  # noqa: E402

_REFERENCE_SCRIPT = r"""
import json, sys, timeit, torch
import toploc
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
out = {}
for rows, hidden, seed in cfg["shapes"]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    n_chunks = (rows + 31) // 32
    build = lambda: toploc.build_proofs_bytes(h, 32, 128, skip_prefill=True)
    proofs = build()
    verify = lambda: toploc.verify_proofs_bytes(h, proofs, 32, 128, skip_prefill=True)
    verify()
    tb = min(timeit.repeat(build, number=cfg["number"], repeat=cfg["repeat"])) / cfg["number"] / n_chunks
    tv = min(timeit.repeat(verify, number=cfg["number"], repeat=cfg["repeat"])) / cfg["number"] / n_chunks
    out[f"{rows}x{hidden}"] = {"build_us": tb * 1e6, "verify_us": tv * 1e6, "proofs_hex": [p.hex() for p in proofs]}
print(json.dumps(out))
"""


def _time_ours(rows: int, hidden: int, seed: int, number: int, repeat: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    n_chunks = (rows + 31) // 32
    proofs = toploc.build_proofs(h)
    toploc.verify_proofs(h, proofs)
    tb = min(timeit.repeat(lambda: toploc.build_proofs(h), number=number, repeat=repeat)) / number / n_chunks
    tv = min(timeit.repeat(lambda: toploc.verify_proofs(h, proofs), number=number, repeat=repeat)) / number / n_chunks
    return {"build_us": tb * 1e6, "verify_us": tv * 1e6, "proofs_hex": [p.hex() for p in proofs]}


def _keep_min(acc: dict[str, dict[str, object]], new: dict[str, dict[str, object]]) -> None:
    """Merge one round's timings into ``acc``, keeping the minimum time per shape and op."""
    for key, row in new.items():
        if key not in acc:
            acc[key] = dict(row)
            continue
        for op in ("build_us", "verify_us"):
            acc[key][op] = min(float(acc[key][op]), float(row[op]))  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[5120, 896], help="hidden sizes H (rows = 32 per chunk)")
    parser.add_argument("--batch-chunks", type=int, default=16, help="also time [32*N, H] inputs of N chunks; 0: skip")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both processes")
    parser.add_argument("--number", type=int, default=20, help="calls per timing repeat")
    parser.add_argument("--repeat", type=int, default=7, help="timing repeats (the minimum is reported)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating ours/reference rounds (min over rounds; evens out machine load)")
    parser.add_argument("--reference-python", default=None, help="interpreter with toploc==0.1.6 installed")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    shapes = [(32, h, 1000 + i) for i, h in enumerate(args.hidden)]
    if args.batch_chunks > 0:
        shapes += [(32 * args.batch_chunks, h, 2000 + i) for i, h in enumerate(args.hidden)]

    ours: dict[str, dict[str, object]] = {}
    ref: dict[str, dict[str, object]] = {}
    cfg = {"shapes": shapes, "threads": args.threads, "number": args.number, "repeat": args.repeat}
    for _ in range(max(1, args.rounds)):
        _keep_min(ours, {f"{r}x{h}": _time_ours(r, h, s, args.number, args.repeat) for r, h, s in shapes})
        if args.reference_python:
            cmd = [args.reference_python, "-c", _REFERENCE_SCRIPT, json.dumps(cfg)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            _keep_min(ref, json.loads(proc.stdout.strip().splitlines()[-1]))

    print(f"TOPLOC per-chunk time, µs (torch threads={args.threads}; min of {args.repeat} x {args.number} calls)")
    header = f"{'shape':>12} {'op':>7} {'ours':>10}"
    if ref:
        header += f" {'toploc 0.1.6':>13} {'ratio':>7} {'equal proofs':>13}"
    print(header)
    for key, mine in ours.items():
        for op in ("build", "verify"):
            line = f"{key:>12} {op:>7} {mine[f'{op}_us']:>10.1f}"
            if ref:
                theirs = ref[key]
                pairs = list(zip(mine["proofs_hex"], theirs["proofs_hex"]))  # type: ignore[call-overload]
                same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
                ratio = float(mine[f"{op}_us"]) / float(theirs[f"{op}_us"])  # type: ignore[arg-type]
                line += f" {theirs[f'{op}_us']:>13.1f} {ratio:>6.2f}x {same:>13}"
            print(line)


if __name__ == "__main__":
    main()
