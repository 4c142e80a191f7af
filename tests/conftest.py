"""Shared fixtures: shared-data location, child-process reaping, single-threaded torch; the
``--durations-file`` option (every test's seconds, written by ``scripts/test.sh`` on every run)."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def shared_dir() -> Path:
    """``$INTELLECT_SHARED`` or ``<repo>/../shared`` (public task sets and reference vectors)."""
    return Path(os.environ.get("INTELLECT_SHARED", REPO.parent / "shared"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write every test's setup, call and teardown seconds, CPU seconds, outcome, pytest-xdist worker and "
                          "start time to PATH (tab-separated, slowest first) and each module's totals to PATH with .modules.tsv")


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of every child process it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuPerTest:
    """Adds each test's CPU seconds (setup to teardown: this process and the child processes it waited
    for, and theirs) to its teardown report's ``user_properties`` as ``("cpu_s", seconds)`` (pytest-xdist
    forwards them to the controller). The suite is CPU-bound on 2 cores, so CPU seconds, not wall
    seconds, say what a test costs the run; a child still running when the test ends (a module's
    shared devnet) counts where it is waited for."""

    def __init__(self) -> None:
        self.start = 0.0

    def pytest_runtest_logstart(self) -> None:
        self.start = _cpu_s()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        report = yield
        if call.when == "teardown":
            report.user_properties.append(("cpu_s", round(_cpu_s() - self.start, 2)))
        return report


class DurationsFile:
    """Collects every test's phase durations (on the controller under pytest-xdist: workers forward
    their reports) and writes them at the end of the session, also when tests failed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, dict[str, Any]] = {}
        self.started = time.time()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = self.rows.setdefault(report.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0, "cpu": 0.0, "outcome": "passed",
                                                   "worker": getattr(getattr(report, "node", None), "gateway", None),
                                                   "start": getattr(report, "start", None)})
        row[report.when] = report.duration
        row["cpu"] += sum(value for name, value in report.user_properties if name == "cpu_s")
        if report.failed:
            row["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"

    def pytest_sessionfinish(self) -> None:
        def total(row: dict[str, Any]) -> float:
            return row["setup"] + row["call"] + row["teardown"]

        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = ["seconds\tsetup_s\tcall_s\tteardown_s\tcpu_s\toutcome\tworker\tstart_s\ttest"]
        modules: dict[str, list[float]] = {}
        for nodeid, row in sorted(self.rows.items(), key=lambda kv: -total(kv[1])):
            worker = getattr(row["worker"], "id", "") or "-"
            start = f"{row['start'] - self.started:.1f}" if row["start"] else "-"
            lines.append(f"{total(row):.2f}\t{row['setup']:.2f}\t{row['call']:.2f}\t{row['teardown']:.2f}\t{row['cpu']:.2f}\t{row['outcome']}"
                         f"\t{worker}\t{start}\t{nodeid}")
            m = modules.setdefault(nodeid.split("::", 1)[0], [0.0, 0.0, 0])
            m[0] += total(row)
            m[1] += row["cpu"]
            m[2] += 1
        self.path.write_text("\n".join(lines) + "\n")
        self.path.with_name(self.path.name.removesuffix(".tsv") + ".modules.tsv").write_text(
            "seconds\tcpu_s\ttests\tmodule\n"
            + "".join(f"{s:.1f}\t{c:.1f}\t{n}\t{m}\n" for m, (s, c, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])))


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--durations-file")
    if path:
        config.pluginmanager.register(CpuPerTest(), "cpu-per-test")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) writes the file
        config.pluginmanager.register(DurationsFile(Path(path)), "durations-file")


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
def held_port() -> Iterator[Callable[[], int]]:
    """Call it for each port a test must choose before its server starts: each is held for the
    whole test by :func:`localnet.reserve_port` (the server binds it too, nobody else can)."""
    from localnet import reserve_port

    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(reserve_port())


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
    """Fail loudly rather than leak: kill any child process a test left running (with its own
    children), except those a module fixture shares across tests (``localnet.SHARED_PROCESSES``)."""
    yield
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return
    from localnet import SHARED_PROCESSES

    for child in psutil.Process().children():
        try:
            if child.pid in SHARED_PROCESSES or any(a.endswith("_math_worker.py") for a in child.cmdline()):
                continue  # a shared devnet, or this process's math-verify pool: long-lived by design
            tree = [*child.children(recursive=True), child]
        except psutil.Error:
            continue
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
