"""Load fetched weights: safetensors only, never pickle."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from node.errors import ShardcastError

if TYPE_CHECKING:
    import torch


def load_safetensors_dir(path: Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in a fetched checkpoint directory.

    Args:
        path: a directory written by :func:`node.shardcast.fetch_checkpoint` (or one file).
        device: torch device to load onto.

    Returns:
        Tensor name → tensor, merged over the files in name order.

    Raises:
        ShardcastError: no safetensors file, a tensor name in two files, or an unreadable file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ShardcastError(f"no .safetensors files in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f, device=device)
        except (SafetensorError, OSError) as e:
            raise ShardcastError(f"cannot load {f}: {e}") from e
        dup = out.keys() & tensors.keys()
        if dup:
            raise ShardcastError(f"tensor {min(dup)!r} appears in more than one file")
        out.update(tensors)
    return out
