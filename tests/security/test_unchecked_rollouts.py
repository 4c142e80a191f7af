"""A submission accepted without a full check cannot wreck the coordinator's training.

A spot-checking validator accepts most submissions after a light check, without the model
work (``docs/validator.md`` §5), and a coordinator must not depend on any validator's checks: the trainer may get whatever a schema-valid
envelope may carry. One such submission used to NaN the policy's weights (log-probs NaN or −1e30
with ``rl.old_logprobs = "behavior"``, or rewards of 1e308, whose mean overflows) or stop the
training step (a token ID past the embedding). Here each goes through the real buffer and one
real training step of a tiny model: the weights stay finite, and the submissions that cannot be
trained on are retired untrained.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from protocol.envelope import open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask
from protocol.models import build_model
from protocol.rollout import pack_f32, pack_u32
from protocol.runspec import RLSpec, RunInfo, RunSpec
from trainer.buffer import RolloutBuffer
from trainer.ledger import BanBook, State, SubmissionLedger
from trainer.loss import LossConfig
from trainer.model import tiny_qwen2_config
from trainer.train import Trainer, TrainerConfig

COORD = NodeKey.from_seed(b"c" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=1))
RUN = SPEC.run_id
VOCAB = 32


def _accept(ledger: SubmissionLedger, worker: NodeKey, counter: int, tasks: int, *, logprob: float = -1.0, reward: float = 1.0,
            token: int = 9) -> str:
    """Store and accept (as a validator's sampled-out verdict does) ``tasks`` groups of 2 rollouts;
    each group's second rollout carries ``logprob``, ``reward`` and completion token ``token``."""
    rollouts = [Rollout(task=t, sample=k, seed=k, prompt_ids=pack_u32([5, 6, 7]), completion_ids=pack_u32([8, token if k else 9]),
                        logprobs=pack_f32([-1.0, logprob if k else -1.0]), finish="length", task_reward=float(k),
                        reward=reward if k else 0.0, proofs=[])
                for t in range(tasks) for k in range(2)]
    body = Submission(worker=worker.peer_id, policy_step=0, counter=counter,
                      tasks=[SubmissionTask(task_index=t, problem_id=f"p{counter}-{t}", target_length=0) for t in range(tasks)],
                      rollouts=rollouts)
    env = open_envelope(seal(worker, RUN, body), run_id=RUN, expect=Submission)
    sid = env.id.hex()
    assert ledger.store.add(env)
    assert ledger.store.record_verdict(f"v-{sid}", sid, "validator", True, "ok")  # a sampled-out verdict accepts with reason ok
    return sid


# (what the hostile rollout carries, whether the buffer retires it untrained)
CASES = {
    "nan_logprob": ({"logprob": math.nan}, True),
    "absurd_logprob": ({"logprob": -1e30}, False),
    "overflowing_reward": ({"reward": 1e308}, False),
    "token_past_vocab": ({"token": 10**6}, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_unchecked_submission_does_not_wreck_a_training_step(tmp_path: Path, case: str) -> None:
    torch.set_num_threads(1)
    poison, retired = CASES[case]
    ledger = SubmissionLedger(tmp_path / "ingest", SPEC, BanBook(tmp_path / "bans.msgpack", COORD, RUN), trainer_step=lambda: 0,
                              latest_policy_step=lambda: 0)
    try:
        honest = _accept(ledger, NodeKey.from_seed(b"h" * 32), 0, tasks=2)
        hostile = _accept(ledger, NodeKey.from_seed(b"x" * 32), 0, tasks=1, **poison)
        rl = RLSpec(group_size=2, batch_groups=2 if retired else 3, async_level=2)
        buffer = RolloutBuffer(ledger, rl)
        model = build_model(tiny_qwen2_config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=96), seed=0)
        buffer.vocab_size = int(model.get_input_embeddings().num_embeddings)  # as the coordinator sets it
        batch = buffer.next_batch(0)
        in_batch = {s.record.submission_id for s in batch.sequences}
        assert honest in in_batch and (hostile in in_batch) is not retired
        assert (ledger.get(hostile).state == State.RETIRED) is retired
        trainer = Trainer(model, TrainerConfig(learning_rate=1e-3, warmup_steps=1, max_grad_norm=0.1, loss=LossConfig(norm_tokens=64.0, old_logprobs="behavior"),
                                               micro_batch_tokens=24, optimizer_steps_per_batch=1))
        m = trainer.train_step(batch)
        assert math.isfinite(m.loss)
        assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    finally:
        ledger.close()
