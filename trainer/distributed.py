"""torch.distributed plumbing for the trainer: process-group setup and the batch broadcast.

One process (no ``init_process_group``) is the default and needs nothing from here but a
:class:`DistContext` with ``world_size = 1``. Under ``torchrun`` (``WORLD_SIZE`` > 1 in the
environment) :func:`init_distributed` joins the group: gloo on CPU, NCCL on CUDA.

Only rank 0 runs the coordinator's services (ingest), so only rank 0 assembles a
:class:`~trainer.batch.Batch`; :func:`broadcast_batch` ships it to the other ranks as plain
tensors (token IDs, lengths, and a JSON header as UTF-8 bytes), never as a pickled object.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainer.batch import Batch, RolloutRecord, TrainSequence

logger = logging.getLogger(__name__)

__all__ = ["DistContext", "all_reduce_max", "all_reduce_sum", "broadcast_batch", "init_distributed"]


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the data-parallel group.

    Attributes:
        rank: this process's rank (0 in a single process).
        world_size: number of training processes (1: no process group, no sharding).
        device: the device this rank trains on.
        mesh: the 1-D ``DeviceMesh`` FSDP2 shards over, or ``None`` in a single process.
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None) -> DistContext:
    """Join the ``torchrun`` group if there is one, else return a single-process context.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else gloo.

    Returns:
        The context; with ``WORLD_SIZE`` ≤ 1 nothing is initialised.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world <= 1:
        return DistContext(device=device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, mesh=mesh)
    logger.info("joined process group: rank %d of %d on %s", ctx.rank, ctx.world_size, device)
    return ctx


def all_reduce_sum(values: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Sum scalar metrics over ranks (identity in a single process). Collective."""
    if not ctx.distributed or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.cpu().tolist()))


def all_reduce_max(value: int, ctx: DistContext) -> int:
    """Maximum of an integer over ranks (identity in a single process). Collective."""
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _broadcast(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    dev = t.to(ctx.device)
    dist.broadcast(dev, src=0)
    return dev.cpu()


def broadcast_batch(batch: Batch | None, ctx: DistContext) -> Batch:
    """Give every rank rank 0's batch. Collective; rank 0 passes the batch, others ``None``.

    Raises:
        ValueError: rank 0 passed ``None``.
    """
    if not ctx.distributed:
        if batch is None:
            raise ValueError("a single process needs a batch")
        return batch
    if ctx.is_main:
        if batch is None:
            raise ValueError("rank 0 must pass the batch")
        recs = [s.record for s in batch.sequences]
        header = {
            "step": batch.step,
            "group_keys": [list(k) for k in batch.group_keys],
            "zero_advantage_groups": [list(k) for k in batch.zero_advantage_groups],
            "incomplete_groups": [list(k) for k in batch.incomplete_groups],
            "reward_mean": batch.reward_mean,
            "pass_rate": batch.pass_rate,
            "completion_len_mean": batch.completion_len_mean,
            "rows": [
                [r.submission_id, r.worker, r.policy_step, r.task_key, r.group_seed, r.sample, r.reward, r.task_reward, r.finish, s.advantage]
                for r, s in zip(recs, batch.sequences)
            ],
        }
        meta = torch.frombuffer(bytearray(json.dumps(header).encode("utf-8")), dtype=torch.uint8)
        lengths = torch.tensor([[r.prompt_ids.size, r.completion_ids.size] for r in recs], dtype=torch.long).reshape(-1, 2)
        tokens = torch.from_numpy(np.concatenate([np.concatenate([r.prompt_ids, r.completion_ids]) for r in recs] or [np.zeros(0, np.int64)]))
        logprobs = torch.from_numpy(np.concatenate([r.logprobs for r in recs] or [np.zeros(0, np.float32)]))
        sizes = torch.tensor([meta.numel(), lengths.shape[0], tokens.numel(), logprobs.numel()], dtype=torch.long)
    else:
        sizes = torch.zeros(4, dtype=torch.long)
    sizes = _broadcast(sizes, ctx)
    n_meta, n_seq, n_tok, n_lp = (int(x) for x in sizes.tolist())
    if not ctx.is_main:
        meta = torch.zeros(n_meta, dtype=torch.uint8)
        lengths = torch.zeros(n_seq, 2, dtype=torch.long)
        tokens = torch.zeros(n_tok, dtype=torch.long)
        logprobs = torch.zeros(n_lp, dtype=torch.float32)
    meta, lengths, tokens, logprobs = (_broadcast(t, ctx) for t in (meta, lengths, tokens, logprobs))
    if ctx.is_main and batch is not None:
        return batch

    header = json.loads(bytes(meta.numpy()).decode("utf-8"))
    toks, lps = tokens.numpy(), logprobs.numpy()
    seqs, t_off, l_off = [], 0, 0
    for (p, c), row in zip(lengths.tolist(), header["rows"]):
        sub, worker, pstep, tkey, gseed, sample, reward, task_reward, finish, adv = row
        rec = RolloutRecord(
            submission_id=sub,
            worker=worker,
            policy_step=pstep,
            task_key=tkey,
            group_seed=gseed,
            sample=sample,
            prompt_ids=toks[t_off : t_off + p].copy(),
            completion_ids=toks[t_off + p : t_off + p + c].copy(),
            logprobs=lps[l_off : l_off + c].copy(),
            reward=reward,
            task_reward=task_reward,
            finish=finish,
        )
        t_off += p + c
        l_off += c
        seqs.append(TrainSequence(record=rec, advantage=adv))

    def keys(name: str) -> list[tuple[str, int]]:
        return [(k[0], int(k[1])) for k in header[name]]

    return Batch(
        step=header["step"],
        sequences=seqs,
        group_keys=keys("group_keys"),
        zero_advantage_groups=keys("zero_advantage_groups"),
        incomplete_groups=keys("incomplete_groups"),
        reward_mean=header["reward_mean"],
        pass_rate=header["pass_rate"],
        completion_len_mean=header["completion_len_mean"],
    )
