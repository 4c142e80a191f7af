"""The qwen2.5-0.5b profile across devices: a vLLM worker in bf16 on CUDA against CPU and GPU validators.

Run by ``scripts/gpu_check.sh`` on a CUDA machine with the ``gpu`` extra (vLLM) installed:

    python scripts/gpu_profile_check.py [--layers 24] [--submissions 4] [--data-root ../shared/data]

Builds (or finds cached) the profile's model (``node/devnet/profile.py``: hidden 896, 24 layers,
vocabulary 151,936, bf16 weights), then makes ``--submissions`` signed submissions (one gsm8k task
× group 4 × 32 tokens each, the devnet profile's spec) with two workers:

* **gpu-vllm**: ``VllmEngine`` on CUDA in bfloat16 (what a GPU worker runs);
* **cpu-hf**: the transformers engine on the CPU in float32 (the devnet's worker);

and checks every submission with two validators, each the real ``validator.pipeline.SubmissionChecker``
with the model in float32 (what ``intellect-node validate`` loads):

* **cpu**: prefill on the CPU;
* **gpu**: prefill on CUDA (``validate --device cuda``).

Prints one line per (worker, validator) pair: verdicts by reason and, for rejections, the evidence
(which check, the measured figure against its threshold), so a threshold that must move is named
with the number that would pass. Exit 0 when every honest submission is accepted by both
validators, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the profile's 24)")
    ap.add_argument("--submissions", type=int, default=4, help="submissions per worker (default 4)")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--cpu-only", action="store_true", help="the CPU worker and validator alone (this script's own smoke test without a GPU)")
    args = ap.parse_args()

    import torch

    from node.devnet.config import devnet_spec
    from node.devnet.profile import prepare_profile_model
    from node.engine.base import Engine
    from node.engine.hf import TransformersEngine
    from node.worker.rollouts import build_submission
    from protocol.dataset import resolve_tasks
    from protocol.envelope import open_envelope
    from protocol.identity import NodeKey
    from protocol.messages import Submission
    from protocol.models import load_model, load_tokenizer
    from protocol.runspec import sign_run_spec
    from validator.pipeline import SubmissionChecker

    if not args.cpu_only and not torch.cuda.is_available():
        print("error: no CUDA device (this check compares a GPU worker and validator with CPU ones)", file=sys.stderr)
        return 2
    data_root = Path(args.data_root)
    model_dir = prepare_profile_model("qwen2.5-0.5b", data_root, layers=args.layers)
    coord, validator = NodeKey.generate(), NodeKey.generate()
    spec = devnet_spec(coord, [validator.peer_id], tasks="gsm8k", http_url="http://127.0.0.1:9", seed=1,
                       bootstrap=f"/ip4/127.0.0.1/tcp/9/p2p/{coord.peer_id}", model=model_dir, profile=True)
    signed = sign_run_spec(spec, coord)
    tasks = resolve_tasks(spec.data.tasks, data_root, spec.data.tasks_hash).train
    tokenizer = load_tokenizer(model_dir)
    print(f"model {model_dir} ({args.layers or 24} layers), {'CPU only' if args.cpu_only else torch.cuda.get_device_name()}", flush=True)

    def vllm_engine() -> Engine:
        from node.engine.vllm_engine import VllmEngine

        return VllmEngine.from_dir(model_dir, device="cuda", dtype="bfloat16")

    def hf_engine() -> Engine:
        return TransformersEngine.from_dir(model_dir, device="cpu")

    subs: dict[str, list[bytes]] = {}
    engines: dict[str, Callable[[], Engine]] = {"cpu-hf": hf_engine}
    if not args.cpu_only:
        engines = {"gpu-vllm": vllm_engine, **engines}
    for name, make in engines.items():
        worker = NodeKey.generate()
        t0 = time.monotonic()
        engine = make()
        subs[name] = [build_submission(spec, signed.run_id, worker, engine, tokenizer, tasks, 0, c) for c in range(args.submissions)]
        print(f"worker {name}: {args.submissions} submissions in {time.monotonic() - t0:.1f} s", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    ok = True
    for vname, device in (("cpu", "cpu"),) if args.cpu_only else (("cpu", "cpu"), ("gpu", "cuda")):
        model = load_model(model_dir, torch.float32, device)
        def model_for_step(step: int, m: torch.nn.Module = model) -> torch.nn.Module | None:
            return m if step == 0 else None

        checker = SubmissionChecker(spec, tasks, tokenizer, model_for_step, trainer_step=lambda: 0, counter_seen=lambda *_: False)
        for wname, blobs in subs.items():
            reasons: collections.Counter[str] = collections.Counter()
            evidence = []
            seconds = 0.0
            for blob in blobs:
                res = checker.check(open_envelope(blob, run_id=signed.run_id, expect=Submission))
                reasons[res.reason] += 1
                seconds += res.seconds
                if not res.accepted:
                    evidence.append(res.evidence)
            good = set(reasons) == {"ok"}
            ok &= good
            print(f"{'PASS' if good else 'FAIL'}  worker {wname:<9} → validator {vname}: {dict(reasons)} "
                  f"({seconds / max(1, len(blobs)):.2f} s per submission)", flush=True)
            for e in evidence[:4]:
                print(f"      evidence: {e}", flush=True)
        del model, checker
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
