"""node/memory.py: heap pages a dropped model leaves in a thread's malloc arena go back to the kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# In a fresh process (its own malloc state): a freed 16 MiB block raises glibc's mmap threshold,
# then a worker thread allocates 384 MiB in 8 MiB blocks (now from its arena) with small live
# objects between them, as a model's weights sit among other allocations; the blocks are freed.
SCRIPT = """
import threading, numpy as np
from node.memory import release_free_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = np.ones(16 << 20, np.uint8); del base
pins = []
def load():
    blocks = []
    for _ in range(48):
        blocks.append(np.ones(8 << 20, np.uint8))
        pins.append(np.ones(4096, np.uint8))
    del blocks
t = threading.Thread(target=load); t.start(); t.join()
before = rss()
ok = release_free_memory()
print(before, rss(), ok)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc: Linux")
def test_a_dropped_models_arena_pages_go_back_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    before, after, ok = out.split()
    held = int(before) - int(after)
    assert ok == "True" and held > 256 << 20, out  # ≥ 256 of the 384 MiB were still resident, and now are not
