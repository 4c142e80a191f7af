"""Build the shipped embedded base model (node/coordinator/embedded_base/) and report what it is.

The devnet's default base is a file in the package, the same bytes on every machine; this script
is how it was made and how to make it again: the embedded Qwen2 (hidden 128, 2 layers, character
tokenizer, weight seed 0) warm-started for 600 AdamW steps on the 900 training additions' answers
(``node.coordinator.base.EMBEDDED_WARM_START``) on one CPU thread, written as float32 safetensors.

    python scripts/build_embedded_base.py            # build into a temporary folder, compare with the shipped one
    python scripts/build_embedded_base.py --write    # replace node/coordinator/embedded_base/ (then update
                                                     # EMBEDDED_BASE_HASH in node/coordinator/base.py to the printed hash)

It prints the base's hash, whether it equals the shipped one, and the held-out pass rate at the
devnet's sampling settings (16 samples per held-out problem, seed 1), ≈ 30–60 s on 2 cores.
A different CPU (another SIMD width or math library) may round differently and give another hash;
that is why the base is shipped rather than rebuilt on each machine.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace the shipped base with the one built here")
    ap.add_argument("--samples", type=int, default=16, help="samples per held-out problem for the pass rate")
    args = ap.parse_args()

    import torch

    from node.coordinator.base import EMBEDDED_BASE_DIR, EMBEDDED_BASE_HASH, EMBEDDED_HIDDEN_SIZE, EMBEDDED_WARM_START, warm_start_base
    from node.coordinator.evaluate import evaluate
    from node.devnet.config import EMBEDDED_SAMPLING
    from node.engine.hf import TransformersEngine
    from protocol.dataset import resolve_tasks
    from protocol.identity import NodeKey
    from protocol.models import base_hash, load_model, load_tokenizer
    from protocol.runspec import RunInfo, RunSpec

    tasks = resolve_tasks("embedded")
    with tempfile.TemporaryDirectory(prefix="embedded-base-") as tmp:
        out = Path(tmp) / "base"
        t0 = time.monotonic()
        losses = warm_start_base(tasks, out, EMBEDDED_HIDDEN_SIZE, True, EMBEDDED_WARM_START)
        built_s = time.monotonic() - t0
        digest = base_hash(out)
        print(f"warm start: {len(losses)} steps in {built_s:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        print(f"base hash: {digest}")
        print(f"shipped:   {EMBEDDED_BASE_HASH} ({'same' if digest == EMBEDDED_BASE_HASH else 'DIFFERENT'})")
        torch.set_num_threads(1)
        tok = load_tokenizer(out)
        spec = RunSpec(run=RunInfo(coordinator=NodeKey.from_seed(b"c" * 32).peer_id, seed=1), sampling=EMBEDDED_SAMPLING)
        r = evaluate(spec, TransformersEngine(load_model(out), tok), tok, tasks.heldout, samples_per_task=args.samples)
        lo, hi = r.interval()
        print(f"held-out pass rate at the devnet's sampling: {r.pass_rate:.3f} (95% {lo:.3f}-{hi:.3f}, {len(tasks.heldout)} problems x {args.samples})")
        if args.write:
            shutil.rmtree(EMBEDDED_BASE_DIR, ignore_errors=True)
            shutil.copytree(out, EMBEDDED_BASE_DIR)
            print(f"written to {EMBEDDED_BASE_DIR}; set EMBEDDED_BASE_HASH = {digest!r} in node/coordinator/base.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
