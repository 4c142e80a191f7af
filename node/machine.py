"""What this machine has free for a worker: GPU memory and host memory (reads the system).

:func:`probe_machine` gives the :class:`node.engine.fit.Machine` the sizing math plans with. A
worker (torch already loaded) asks CUDA itself (``torch.cuda.mem_get_info``: free and total
bytes of the current device); ``doctor``, which imports no torch, asks ``nvidia-smi`` for the
same two numbers. A machine with neither has no GPU.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from node.engine.fit import Machine

NVIDIA_SMI_TIMEOUT_S = 3.0


def host_available_bytes() -> int:
    """The host's available memory (psutil's ``available``: free plus reclaimable caches), bytes."""
    import psutil

    return int(psutil.virtual_memory().available)


def nvidia_smi_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[tuple[str, int, int]]:
    """``(name, free bytes, total bytes)`` of each GPU ``nvidia-smi`` lists; ``[]`` without it.

    Raises:
        OSError, subprocess.SubprocessError: ``nvidia-smi`` exists but failed (a driver problem).
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, "--query-gpu=name,memory.free,memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=timeout_s, check=True).stdout.strip().splitlines()
    gpus = []
    for line in out:
        name, free_mib, total_mib = (x.strip() for x in line.rsplit(",", 2))
        gpus.append((name, int(float(free_mib) * (1 << 20)), int(float(total_mib) * (1 << 20))))
    return gpus


def probe_machine(*, use_torch: bool | None = None) -> Machine:
    """Measure this machine now.

    Args:
        use_torch: ask CUDA through torch (default: when torch is already imported); otherwise
            ``nvidia-smi`` (the GPU with the most free memory).

    Returns:
        The :class:`~node.engine.fit.Machine` (no GPU fields when no GPU is found or the probe fails).
    """
    host = host_available_bytes()
    if use_torch is None:
        use_torch = "torch" in sys.modules
    if use_torch:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return Machine(torch.cuda.get_device_name(), int(free), int(total), host)
        return Machine(host_available_bytes=host)
    try:
        gpus = nvidia_smi_gpus()
    except (OSError, subprocess.SubprocessError):
        gpus = []
    if not gpus:
        return Machine(host_available_bytes=host)
    name, free, total = max(gpus, key=lambda g: g[1])
    return Machine(name, free, total, host)
