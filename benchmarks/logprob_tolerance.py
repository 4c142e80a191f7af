"""How far reported sampling log-probs lie from the validator's, for honest and not-quite-honest workers.

The measurement behind the run spec's default ``toploc.logprob_max_abs`` / ``logprob_mean_abs``
(``docs/toploc.md`` §8). The policy is the embedded base of ``tests/validator/test_pipeline.py``
(a tiny Qwen2 warm-started on the embedded tasks; built once per machine and cached). Workers run
the honest code (:func:`node.worker.rollouts.build_submission`) with:

* the policy in fp32, engines batching 1, 8 or 64 sequences on 1 or 2 threads (honest);
* copies of the policy with Gaussian noise of 0.3 %, 1 % and 3 % of each tensor's std on every
  weight (a slightly different model);
* a bf16 copy of the policy (an honest worker on bf16 kernels; on this CPU).

For every rollout the validator's recomputed log-probs come from one fp32 batched prefill
(:func:`protocol.inference.prefill_completions`) as in the pipeline; it prints, per worker
kind, the largest per-token difference and the largest / median per-rollout mean difference
(nats). Accuracy numbers, not timings: machine load does not change them.

Example::

    OMP_NUM_THREADS=1 python benchmarks/logprob_tolerance.py
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.coordinator.base import prepare_base
from node.engine.hf import TransformersEngine
from node.worker.adversary import perturbed_model
from node.worker.rollouts import build_submission
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.inference import prefill_completions
from protocol.messages import Submission
from protocol.models import load_model, load_tokenizer
from protocol.rollout import unpack_f32, unpack_u32
from protocol.runspec import DataSpec, RLSpec, RunInfo, RunSpec, SamplingSpec

COORD = NodeKey.from_seed(b"c" * 32)
WORKER = NodeKey.from_seed(b"w" * 32)
# the run of tests/validator/test_pipeline.py
SPEC = RunSpec(
    run=RunInfo(coordinator=COORD.peer_id, seed=7),
    data=DataSpec(tasks_per_submission=4),
    sampling=SamplingSpec(max_tokens=8, temperature=2.0),
    rl=RLSpec(group_size=4, async_level=2),
)


def main() -> None:
    tasks = resolve_tasks("embedded")
    base = prepare_base(SPEC, tasks, Path(tempfile.mkdtemp(prefix="logprob-tol-")))
    tok = load_tokenizer(base)
    policy = load_model(base)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def diffs(worker_model: torch.nn.Module, configs: list[tuple[int, int]], per_config: int) -> list[tuple[float, float]]:
        """(max, mean) |reported − recomputed| per rollout, nats."""
        out: list[tuple[float, float]] = []
        for i, (max_batch, threads) in enumerate(configs):
            engine = TransformersEngine(worker_model, tok, max_batch=max_batch)
            for counter in range(per_config * i, per_config * (i + 1)):
                torch.set_num_threads(threads)
                blob = build_submission(SPEC, SPEC.run_id, WORKER, engine, tok, tasks.train, 0, counter)
                sub = open_envelope(blob, run_id=SPEC.run_id, expect=Submission).body
                seqs = [(unpack_u32(r.prompt_ids), unpack_u32(r.completion_ids), unpack_f32(r.logprobs)) for r in sub.rollouts]
                torch.set_num_threads(2)  # the validator's own setting
                for (_, completion, reported), pre in zip(seqs, prefill_completions(policy, [s[0] for s in seqs], [s[1] for s in seqs], pad)):
                    z = torch.log_softmax(pre.logits.to(torch.float64) / SPEC.sampling.temperature, dim=-1)
                    recomputed = z.gather(-1, torch.tensor(completion)[:, None])[:, 0]
                    d = (recomputed - torch.tensor(reported, dtype=torch.float64)).abs()
                    out.append((float(d.max()), float(d.mean())))
        return out

    kinds: list[tuple[str, torch.nn.Module, list[tuple[int, int]], int]] = [
        ("honest fp32 (batch 1/8/64, 1-2 threads)", policy, [(1, 1), (8, 2), (64, 1), (64, 2)], 4),
        ("0.3 % perturbed copy", perturbed_model(policy, 0.003), [(64, 2)], 2),
        ("1 % perturbed copy", perturbed_model(policy, 0.01), [(64, 2)], 2),
        ("3 % perturbed copy", perturbed_model(policy, 0.03), [(64, 2)], 2),
        ("honest bf16 copy", copy.deepcopy(policy).to(torch.bfloat16), [(8, 1), (64, 2)], 4),
    ]
    print(f"{'worker':42} {'rollouts':>8} {'max |d|':>10} {'max mean|d|':>12} {'median mean|d|':>15}")
    for name, model, configs, per_config in kinds:
        rows = diffs(model, configs, per_config)
        means = [m for _, m in rows]
        print(f"{name:42} {len(rows):8d} {max(x for x, _ in rows):10.3g} {max(means):12.3g} {statistics.median(means):15.3g}")
    print(f"run spec defaults: logprob_max_abs {SPEC.toploc.logprob_max_abs}, logprob_mean_abs {SPEC.toploc.logprob_mean_abs}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # --help
    main()
