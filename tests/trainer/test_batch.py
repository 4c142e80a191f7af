"""Batch assembly: whole groups, records from submissions, sharding, and packing that equals the
unpacked forward (the async window is the ledger's: ``test_buffer.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trainer_toy as toy

from protocol.messages import Rollout, Submission, SubmissionTask
from trainer.batch import (
    MicroBatch,
    RolloutRecord,
    TrainSequence,
    assemble_batch,
    group_seed_of,
    pack_sequences,
    records_from_submission,
    shard_sequences,
)
from trainer.errors import BatchError, NotEnoughRolloutsError
from trainer.model import token_logprobs

PEER = "12D3KooW" + "A" * 44


def _group(task: str, policy_step: int, rewards=(1.0, 0.0)) -> list[RolloutRecord]:
    return [
        RolloutRecord(
            submission_id=f"s{task}",
            worker=PEER,
            policy_step=policy_step,
            task_key=task,
            group_seed=policy_step,
            sample=i,
            prompt_ids=np.array([3, 4]),
            completion_ids=np.array([5, 6, 7]),
            logprobs=np.zeros(3, np.float32),
            reward=r,
            task_reward=r,
        )
        for i, r in enumerate(rewards)
    ]


def test_groups_of_the_wrong_size_are_skipped_and_staleness_is_counted() -> None:
    """Assembly takes the records it is given as fresh (the ledger's trainable view applied the
    async window: ``tests/trainer/test_buffer.py``): it keeps whole groups of ``group_size``, skips
    others for later, and reports how stale the trained rollouts are."""
    n, k = 5, 2
    short = _group("short", n, rewards=(1.0,))
    recs = _group("oldest-ok", n - k) + short + _group("fresh", n)
    batch = assemble_batch(recs, step=n, group_size=2, num_groups=3, adv_eps=1e-4, allow_partial=True)
    assert [key[0] for key in batch.group_keys] == ["oldest-ok", "fresh"]
    assert [key[0] for key in batch.incomplete_groups] == ["short"]
    assert batch.consumed_groups == batch.group_keys  # a short group is not consumed: it may fill up
    assert batch.staleness_histogram() == {0: 2, k: 2}
    with pytest.raises(NotEnoughRolloutsError) as e:
        assemble_batch(short, step=n, group_size=2, num_groups=1, adv_eps=1e-4, allow_partial=True)
    assert e.value.incomplete_groups == 1 and e.value.usable_groups == 0


def test_records_from_submission() -> None:
    def u32(xs):
        return np.asarray(xs, dtype="<u4").tobytes()

    tasks = [SubmissionTask(task_index=7, problem_id="a", target_length=0), SubmissionTask(task_index=9, problem_id="b", target_length=0)]
    rollouts = [
        Rollout(task=t, sample=s, seed=100 + 10 * t + s, prompt_ids=u32([1, 2, 3]), completion_ids=u32([4, 5]),
                logprobs=np.asarray([-0.5, -1.0], dtype="<f4").tobytes(), finish="eos", task_reward=float(s), reward=float(s), proofs=[])
        for s in range(2)
        for t in range(2)
    ]
    sub = Submission(worker=PEER, policy_step=3, counter=4, tasks=tasks, rollouts=rollouts)
    recs = records_from_submission(sub, "ab" * 32)
    assert len(recs) == 4
    assert {r.task_key for r in recs} == {"7:a", "9:b"}
    g0 = [r for r in recs if r.task_key == "7:a"]
    assert {r.group_seed for r in g0} == {group_seed_of(PEER, 3, 4, 0)}
    assert group_seed_of(PEER, 3, 4, 0) != group_seed_of(PEER, 3, 4, 1) != group_seed_of(PEER, 3, 5, 1)
    r = recs[0]
    assert r.prompt_ids.tolist() == [1, 2, 3] and r.completion_ids.tolist() == [4, 5] and r.prompt_ids.dtype == np.int64
    np.testing.assert_array_equal(r.logprobs, np.array([-0.5, -1.0], np.float32))
    assert r.policy_step == 3 and r.worker == PEER and r.submission_id == "ab" * 32
    batch = assemble_batch(recs, step=3, group_size=2, num_groups=2, adv_eps=1e-4)
    assert len(batch.group_keys) == 2

    bad = Submission(worker=PEER, policy_step=3, counter=4, tasks=tasks[:1], rollouts=rollouts)
    with pytest.raises(BatchError, match="task 1"):
        records_from_submission(bad, "cd" * 32)


def test_record_validation() -> None:
    with pytest.raises(BatchError, match="prompt"):
        RolloutRecord("s", "w", 0, "t", 0, 0, np.zeros(0, np.int64), np.array([1]), np.zeros(1, np.float32), 0.0, 0.0)
    with pytest.raises(BatchError, match="log-probs"):
        RolloutRecord("s", "w", 0, "t", 0, 0, np.array([1]), np.array([1, 2]), np.zeros(1, np.float32), 0.0, 0.0)


def test_shard_and_slices_partition_the_batch() -> None:
    batch = toy.toy_batch(seed=1, step=0)
    shares = [shard_sequences(batch.sequences, 3, r) for r in range(3)]
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in batch.sequences)
    loads = [sum(s.num_tokens for s in share) for share in shares]
    assert max(loads) - min(loads) <= max(s.num_tokens for s in batch.sequences)
    slices = batch.slices(3)
    assert [len({s.record.group_key for s in sl}) for sl in slices] == [2, 1, 1]  # whole groups, 4 over 3
    with pytest.raises(ValueError):
        batch.slices(5)


def _sequences() -> list[TrainSequence]:
    batch = toy.toy_batch(seed=2, step=0)
    return batch.sequences


def test_packing_layout() -> None:
    seqs = _sequences()
    rows = pack_sequences(seqs, micro_batch_tokens=30)
    assert all(r.num_tokens <= 30 for r in rows)
    assert len(rows) < len(seqs)  # several sequences per row
    seen = torch.cat([r.sequence_index[0] for r in rows]).unique().tolist()
    assert seen == list(range(len(seqs)))
    assert sum(r.num_loss_tokens for r in rows) == sum(s.record.completion_ids.size for s in seqs)
    for r in rows:
        for i in r.sequence_index[0].unique().tolist():
            sel = r.sequence_index[0] == i
            s = seqs[i]
            assert r.position_ids[0][sel].tolist() == list(range(s.num_tokens))
            assert r.input_ids[0][sel].tolist() == s.input_ids.tolist()
            # the loss covers exactly the completion: positions whose next token is a completion token
            assert r.targets[0][sel][r.loss_mask[0][sel]].tolist() == s.record.completion_ids.tolist()
            assert torch.all(r.advantages[0][sel] == np.float32(s.advantage))
    pad = MicroBatch.padding()
    assert pad.num_tokens == 1 and pad.num_loss_tokens == 0


def test_packed_forward_equals_unpacked_forward() -> None:
    torch.set_num_threads(1)
    model = toy.toy_model(seed=0)
    seqs = _sequences()
    rows = pack_sequences(seqs, micro_batch_tokens=40)
    assert max(len(r.sequence_index[0].unique()) for r in rows) >= 3
    with torch.no_grad():
        for row in rows:
            lp, ent = token_logprobs(model, row, temperature=0.7)
            for i in row.sequence_index[0].unique().tolist():
                sel = row.sequence_index[0] == i
                (alone,) = pack_sequences([seqs[i]], micro_batch_tokens=40)
                lp1, ent1 = token_logprobs(model, alone, temperature=0.7)
                m = alone.loss_mask[0]
                torch.testing.assert_close(lp[0][sel][m], lp1[0][m], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ent[0][sel][m], ent1[0][m], rtol=1e-5, atol=1e-5)
        # control: without restarting positions the packed row would attend across sequences
        row = max(rows, key=lambda r: len(r.sequence_index[0].unique()))
        leaky = MicroBatch(**{**row.__dict__, "position_ids": torch.arange(row.num_tokens)[None, :]})
        assert not torch.allclose(token_logprobs(model, leaky)[0][row.loss_mask], token_logprobs(model, row)[0][row.loss_mask], atol=1e-3)


def test_packed_gradients_equal_unpacked_gradients() -> None:
    torch.set_num_threads(1)
    model = toy.toy_model(seed=0)
    seqs = _sequences()[:6]

    def grads(rows: list[MicroBatch]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for row in rows:
            lp, _ = token_logprobs(model, row, with_entropy=False)
            (lp[0][row.loss_mask[0]] * row.advantages[0][row.loss_mask[0]]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    packed = grads(pack_sequences(seqs, micro_batch_tokens=64))
    alone = grads([pack_sequences([s], 64)[0] for s in seqs])
    for n in packed:
        torch.testing.assert_close(packed[n], alone[n], rtol=1e-4, atol=1e-6, msg=n)


def test_only_completion_positions_go_through_the_lm_head() -> None:
    """The head sees the loss positions alone, and their log-probs and entropies are those of a full forward."""
    torch.set_num_threads(1)
    model = toy.toy_model(seed=0)
    rows = pack_sequences(_sequences(), micro_batch_tokens=40)
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            for row in rows:
                lp, ent = token_logprobs(model, row, temperature=0.7)
                full = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).logits.float() / 0.7  # [1, T, V]
                m = row.loss_mask[0]
                logz = torch.logsumexp(full, -1)[0]  # [T]
                want = full[0].gather(-1, row.targets[0].unsqueeze(-1)).squeeze(-1) - logz  # [T]
                want_ent = logz - (full[0].softmax(-1) * full[0]).sum(-1)  # [T]
                torch.testing.assert_close(lp[0][m], want[m], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ent[0][m], want_ent[m], rtol=1e-5, atol=1e-5)
                assert not lp[0][~m].any() and not ent[0][~m].any()
    finally:
        hook.remove()
    assert seen[0::2] == [row.num_loss_tokens for row in rows]  # token_logprobs' forwards (the full ones in between)
    assert all(row.num_loss_tokens < row.num_tokens for row in rows)
