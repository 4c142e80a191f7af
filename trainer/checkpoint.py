"""Policy checkpoints (for publishing) and training state (for ``--resume``), without pickle.

Tensors go to safetensors, scalars to JSON; nothing is ever unpickled (no ``torch.save`` /
``torch.load``). Every write is atomic (:func:`protocol.durable.atomic_write`): files are written
to a temporary name, fsynced, and renamed; a state directory is built under a temporary name and
renamed whole, then the ``latest`` pointer is replaced, so a crash at any point leaves the previous
state loadable.

Policy checkpoint (``save_policy``): the full weights gathered on rank 0 and written by
``protocol.models.save_model``, the one writer of a model directory (the layout every role loads)::

    <dir>/config.json          the base's config.json, its dtype field set to the weights' dtype
    <dir>/model.safetensors    full weights in the run spec's model.dtype, HF parameter names
                               (a tied lm_head is omitted)
    <dir>/…                    every other file of the base (tokenizer files, chat template,
                               generation_config.json), byte-identical

Step 0 is the base directory itself (``write_base_policy``: ``protocol.models.copy_model``), file for file.

Training state (``save_training_state``), one directory per trainer step under a root, named by
the one step-directory rule (:mod:`protocol.step_dirs`, as the policies are; states saved before
it was shared are named ``step-00000012`` and still found)::

    <root>/latest                  text: name of the newest complete state directory
    <root>/step-12/
        config.json, model.safetensors    as above, float32 master weights
        optimizer.safetensors             "state/<param fqn>/<exp_avg|exp_avg_sq|step>"
        rng.safetensors                   "cpu/<rank>" (and "cuda/<rank>") generator states
        trainer_state.json                format tag, step, optimizer_steps, world_size,
                                          param_groups (hyper-parameters + param fqns),
                                          data_position (the caller's JSON), sha256 of each file

All functions here that take a ``DistContext`` are collective: every rank calls them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from protocol.durable import atomic_write, fsync_dir
from protocol.models import TIED_HEAD, WEIGHTS_FILE, copy_model, save_model
from protocol.step_dirs import step_dir, step_dirs
from trainer.distributed import DistContext
from trainer.errors import StateError

logger = logging.getLogger(__name__)

__all__ = [
    "STATE_FORMAT",
    "latest_state_dir",
    "load_training_state",
    "save_policy",
    "save_training_state",
    "write_base_policy",
]

STATE_FORMAT = "intellect-node/trainer-state/1"
MODEL_FILE = WEIGHTS_FILE
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
EMBED = "model.embed_tokens.weight"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _full_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """Full (unsharded) CPU state dict on rank 0; empty on other ranks of a group. Collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_policy(
    model: torch.nn.Module,
    directory: Path,
    ctx: DistContext,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer: Any = None,
    base_dir: Path | None = None,
) -> list[Path]:
    """Write the full policy as a model directory in the base's format (rank 0 writes). Collective.

    Args:
        model: the (possibly FSDP2-sharded) policy.
        directory: created if missing; existing files of the same names are replaced atomically.
        ctx: the distributed context.
        dtype: dtype of the written weights (the run spec's ``model.dtype``); ``config.json``'s
            ``dtype``/``torch_dtype`` says the same.
        tokenizer: used only without ``base_dir``: its files are saved alongside
            (``save_pretrained``), so the directory is complete for ``protocol.models``.
        base_dir: the run's base model directory: its ``config.json`` is written back (dtype
            field set to ``dtype``, nothing else changed) and every other non-weight file
            (tokenizer files, chat template, ``generation_config.json``) is copied byte-identical.

    Returns:
        The written paths, sorted, on rank 0; ``[]`` on other ranks.
    """
    state = _full_model_state(model)
    paths: list[Path] = []
    if ctx.is_main:
        paths = save_model(model, tokenizer, Path(directory), state=state, dtype=dtype, base_dir=base_dir)
    if ctx.distributed:
        dist.barrier()
    return paths


def write_base_policy(base_dir: Path, directory: Path) -> list[Path]:
    """Policy step 0: the base directory's files copied unchanged into ``directory`` (no gather;
    ``protocol.models.copy_model``).

    Copies the non-hidden top-level files, so ``protocol.models.base_hash`` of ``directory``
    equals the base's (what workers and validators check against ``model.base_hash``).

    Returns:
        The written paths, sorted.

    Raises:
        OSError: a read or write failed.
    """
    return copy_model(Path(base_dir), Path(directory))


def _rng_states(ctx: DistContext) -> dict[str, torch.Tensor]:
    """Every rank's generator states, gathered (complete on rank 0). Collective."""
    local = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        local["cuda"] = torch.cuda.get_rng_state()
    if not ctx.distributed:
        return {f"{k}/0": v for k, v in local.items()}
    out = {}
    for k, v in sorted(local.items()):
        parts = [torch.empty_like(v, device=ctx.device) for _ in range(ctx.world_size)]
        dist.all_gather(parts, v.to(ctx.device))
        out.update({f"{k}/{r}": p.cpu() for r, p in enumerate(parts)})
    return out


def save_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    root: Path,
    ctx: DistContext,
    *,
    step: int,
    optimizer_steps: int,
    data_position: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Save everything needed to resume at ``step`` (rank 0 writes). Collective.

    Args:
        model: the (possibly sharded) policy.
        optimizer: its optimizer.
        root: state root; ``root/step-<step>`` is created and ``root/latest`` points at it.
        ctx: the distributed context.
        step: trainer steps completed.
        optimizer_steps: optimizer steps completed (drives the learning-rate schedule).
        data_position: the caller's JSON-serialisable record of what data was consumed.
        keep: how many newest state directories to keep (older ones are deleted).

    Returns:
        The state directory (on every rank).

    Raises:
        StateError: ``data_position`` is not JSON-serialisable.
    """
    root = Path(root)
    final = step_dir(root, step)
    model_state = _full_model_state(model)
    optim_state: Any = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rng = _rng_states(ctx)
    if ctx.is_main:
        try:
            data_json = json.loads(json.dumps(data_position or {}))
        except (TypeError, ValueError) as e:
            raise StateError(f"data_position is not JSON-serialisable: {e}", str(root)) from e
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        files = save_model(model, None, tmp, state=model_state, dtype=torch.float32)
        tensors = {
            f"state/{fqn}/{name}": t.detach().cpu().contiguous().reshape(t.shape)
            for fqn, entry in optim_state["state"].items()
            for name, t in entry.items()
        }
        atomic_write(tmp / OPTIMIZER_FILE, lambda p: save_file(tensors, str(p)), sync_dir=False)
        atomic_write(tmp / RNG_FILE, lambda p: save_file({k: v.contiguous() for k, v in rng.items()}, str(p)), sync_dir=False)
        files += [tmp / OPTIMIZER_FILE, tmp / RNG_FILE]
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_state["param_groups"]]
        meta = {
            "format": STATE_FORMAT,
            "step": step,
            "optimizer_steps": optimizer_steps,
            "world_size": ctx.world_size,
            "param_groups": groups,
            "data_position": data_json,
            "sha256": {p.name: _sha256(p) for p in files},
        }
        atomic_write(tmp / STATE_FILE, lambda p: p.write_text(json.dumps(meta, indent=1, sort_keys=True)), sync_dir=False)
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        atomic_write(root / LATEST_FILE, lambda p: p.write_text(final.name + "\n"))
        olds = [d for _, d in step_dirs(root) if d.name != final.name]  # ascending step
        for d in olds[: max(0, len(olds) - (keep - 1))]:
            shutil.rmtree(d, ignore_errors=True)
        logger.info("saved training state at step %d to %s", step, final)
    if ctx.distributed:
        dist.barrier()
    return final


def latest_state_dir(root: Path) -> Path | None:
    """The newest complete state under ``root`` (following ``latest``), or ``None`` if there is none."""
    root = Path(root)
    ptr = root / LATEST_FILE
    if not ptr.is_file():
        return None
    d = root / ptr.read_text().strip()
    return d if (d / STATE_FILE).is_file() else None


def _read_state_dir(d: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    try:
        meta = json.loads((d / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise StateError(f"unreadable {STATE_FILE}: {e}", str(d)) from e
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise StateError(f"not a {STATE_FORMAT} directory", str(d))
    for name, digest in meta.get("sha256", {}).items():
        p = d / name
        if not p.is_file() or _sha256(p) != digest:
            raise StateError(f"{name} is missing or does not match its recorded SHA-256", str(d))
    try:
        model_sd = load_file(str(d / MODEL_FILE))
        optim_flat = load_file(str(d / OPTIMIZER_FILE))
        rng = load_file(str(d / RNG_FILE))
    except (OSError, ValueError, RuntimeError) as e:
        raise StateError(f"cannot read tensors: {e}", str(d)) from e
    return meta, model_sd, optim_flat, rng


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, ctx: DistContext) -> dict[str, Any]:
    """Load a state saved by :func:`save_training_state` into ``model`` and ``optimizer``. Collective.

    Rank 0 reads the files and the tensors are broadcast, so other ranks need no access to them;
    the world size may differ from the one that saved (states are saved unsharded).

    Args:
        model: the policy, built and sharded exactly as when saving.
        optimizer: its optimizer (fresh).
        path: a state directory, or a root holding ``latest``.
        ctx: the distributed context.

    Returns:
        ``{"step", "optimizer_steps", "data_position"}`` from the state.

    Raises:
        StateError: missing/corrupt files, or parameter names or shapes that do not match.
    """
    path = Path(path)
    if (path / LATEST_FILE).is_file():
        found = latest_state_dir(path)
        if found is None:
            raise StateError("'latest' names no complete state directory", str(path))
        path = found
    meta: dict[str, Any] = {}
    model_sd: dict[str, Any] = {}
    optim_sd: Any = {}
    rng: dict[str, torch.Tensor] = {}
    error: StateError | None = None
    if ctx.is_main:
        try:
            meta, model_sd, optim_flat, rng = _read_state_dir(path)
            if getattr(model.config, "tie_word_embeddings", False) and TIED_HEAD not in model_sd and EMBED in model_sd:
                model_sd[TIED_HEAD] = model_sd[EMBED]
            _check_shapes(model, model_sd, path)
            state: dict[str, dict[str, torch.Tensor]] = {}
            for key, t in optim_flat.items():
                _, fqn, name = key.split("/", 2)
                state.setdefault(fqn, {})[name] = t
            groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
            optim_sd = {"state": state, "param_groups": groups}
        except StateError as e:
            error = e
    if ctx.distributed:
        flag = torch.tensor([1 if error else 0], device=ctx.device)
        dist.broadcast(flag, src=0)
        if int(flag.item()):
            raise error or StateError("rank 0 could not read the training state", str(path))
    elif error:
        raise error
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.distributed)
    try:
        set_model_state_dict(model, model_sd, options=opts)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
    except (KeyError, RuntimeError, ValueError) as e:
        raise StateError(f"state does not fit this model/optimizer: {e}", str(path)) from e
    scalars = torch.zeros(2, dtype=torch.long, device=ctx.device)
    if ctx.is_main:
        scalars[0], scalars[1] = int(meta["step"]), int(meta["optimizer_steps"])
    if ctx.distributed:
        dist.broadcast(scalars, src=0)
        rng_local = _scatter_rng(rng, ctx)
    else:
        rng_local = {k.split("/")[0]: v for k, v in rng.items() if k.endswith("/0")}
    if "cpu" in rng_local:
        torch.set_rng_state(rng_local["cpu"])
    if "cuda" in rng_local and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng_local["cuda"])
    step, opt_steps = (int(x) for x in scalars.tolist())
    logger.info("loaded training state of step %d from %s", step, path)
    return {"step": step, "optimizer_steps": opt_steps, "data_position": meta.get("data_position", {}) if ctx.is_main else {}}


def _check_shapes(model: torch.nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Raise StateError unless ``saved`` has exactly the model's parameter names and global shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in saved.items()}
    if set(expected) != set(got):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise StateError(f"parameter names differ: missing {missing[:5]}, unexpected {extra[:5]}", str(path))
    bad = [k for k in expected if expected[k] != got[k]]
    if bad:
        raise StateError(f"shape of {bad[0]} is {got[bad[0]]}, the model has {expected[bad[0]]}", str(path))


def _scatter_rng(rng: dict[str, torch.Tensor], ctx: DistContext) -> dict[str, torch.Tensor]:
    """Each rank's own generator states from rank 0's file (a rank the file lacks keeps its own)."""
    out = {}
    local = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        local["cuda"] = torch.cuda.get_rng_state()
    for kind, mine in sorted(local.items()):
        buf = torch.zeros(ctx.world_size, mine.numel(), dtype=torch.uint8, device=ctx.device)
        have = torch.zeros(ctx.world_size, dtype=torch.uint8, device=ctx.device)
        if ctx.is_main:
            for r in range(ctx.world_size):
                t = rng.get(f"{kind}/{r}")
                if t is not None and t.numel() == mine.numel():
                    buf[r] = t.to(ctx.device)
                    have[r] = 1
        dist.broadcast(buf, src=0)
        dist.broadcast(have, src=0)
        if int(have[ctx.rank]):
            out[kind] = buf[ctx.rank].cpu()
    return out
