"""Shared fixtures: shared-data location, child-process reaping, single-threaded torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def shared_dir() -> Path:
    """``$INTELLECT_SHARED`` or ``<repo>/../shared`` (public task sets and reference vectors)."""
    return Path(os.environ.get("INTELLECT_SHARED", REPO.parent / "shared"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """An integration test (several processes or nodes) is slow: never in ``pytest -m "not slow"``.

    Then the longest modules first: those with an integration test, then those with a slow test, then
    the rest, each group in collection order (a stable sort keeps every module's tests together and in
    order). pytest-xdist's ``--dist loadscope`` hands out modules in this order (``scripts/test.sh``
    passes ``--no-loadscope-reorder``; its default puts modules with many tests first, which left the
    one-test devnet modules to the end, one worker running them alone while the other idled), so
    the short modules fill the end of the run.
    """
    rank: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("integration") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        r = 0 if item.get_closest_marker("integration") is not None else 1 if item.get_closest_marker("slow") is not None else 2
        module = item.nodeid.split("::", 1)[0]
        rank[module] = min(rank.get(module, 2), r)
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


@pytest.fixture
def shared() -> Path:
    d = shared_dir()
    if not d.is_dir():
        pytest.skip(f"shared data not found at {d} (set INTELLECT_SHARED)")
    return d


@pytest.fixture
def code_sandbox() -> None:
    """Skip, naming what to install, where code rewards cannot run (no bubblewrap, or no user
    namespaces); ``scripts/test.sh`` installs bubblewrap when it runs as root."""
    from protocol.rewards.sandbox import sandbox_status

    ok, why = sandbox_status()
    if not ok:
        pytest.skip(f"no code sandbox here: {why}")


@pytest.fixture(autouse=True)
def _reap_children():
    """Fail loudly rather than leak: kill any child process a test left running."""
    yield
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return
    for child in psutil.Process().children(recursive=True):
        try:
            if any(a.endswith("_math_worker.py") for a in child.cmdline()):
                continue  # this process's math-verify pool: long-lived by design
            child.kill()
        except psutil.Error:
            pass
