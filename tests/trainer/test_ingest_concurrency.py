"""Ingest under concurrency: group commit, exact quotas and replay protection, and no acknowledged
submission lost when the process is killed (``trainer/ledger/writer.py`` and ``store.py``,
``docs/capacity.md`` §1)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
from test_ingest import RUN, Coordinator, post, serve, submission

import trainer.ledger.writer as writer_mod
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.ingest_api import SUBMISSIONS_ROUTE
from trainer.ingest.limits import IngestLimits
from trainer.ledger import SubmissionStore

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # bound on every wait for an event below


def _wait(cond, what: str) -> None:
    """Wait (bounded) for a condition another thread makes true."""
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError(f"{what}: not within {WAIT_S} s")


@pytest.fixture
def blocked_commit(monkeypatch):
    """The store's directory flush waits for ``release``; ``entered`` is set when a commit reached it."""
    entered, release = threading.Event(), threading.Event()
    real = writer_mod.fsync_dir

    def fsync_dir(directory: Path) -> None:
        entered.set()
        assert release.wait(WAIT_S), "test never released the commit"
        real(directory)

    monkeypatch.setattr(writer_mod, "fsync_dir", fsync_dir)
    return entered, release


def test_group_commit_counts_staged_work_and_answers_only_when_durable(tmp_path, blocked_commit):
    entered, release = blocked_commit
    store = SubmissionStore(tmp_path, RUN)
    workers = [NodeKey.generate() for _ in range(3)]
    envs = [open_envelope(submission(w, counter=c), run_id=RUN) for w in workers for c in range(4)]
    first = store.submit(envs[0], source_ip="10.0.0.1")
    assert entered.wait(WAIT_S)  # the first group (of one) is in its commit, held at the directory flush
    rest = [store.submit(e, source_ip="10.0.0.1") for e in envs[1:]]
    _wait(lambda: len(store._writer._written) == len(rest), "files of the second group written")
    # nothing is answered or visible before its commit, yet every one counts for quotas and replays
    assert not first.done() and not any(f.done() for f in rest)
    assert store.get(envs[1].id.hex()) is None and store.counts()["pending"] == 0
    u = store.usage(workers[0].peer_id, "10.0.0.1")
    size = len(envs[0].raw)
    assert (u.worker_pending, u.ip_pending, u.disk_files) == (4, 12, 12) and u.worker_bytes == 4 * size
    assert store.counter_used(workers[1].peer_id, 2, exclude_id="other")
    assert not store.counter_used(workers[1].peer_id, 2, exclude_id=envs[6].id.hex())
    assert store.storing(envs[5].id.hex())
    again = store.submit(envs[5])  # the same bytes again while they are being stored: a duplicate
    release.set()
    assert first.result(WAIT_S) is True and all(f.result(WAIT_S) is True for f in rest)
    assert again.result(WAIT_S) is False
    assert store.commits == {"groups": 2, "submissions": 12, "largest_group": 11}
    assert store.counts()["pending"] == 12 and not store.storing(envs[5].id.hex())
    assert store.usage(workers[0].peer_id, "10.0.0.1") == u  # counted once: staged before, indexed now
    indexed = sorted(store.leasable(now_ms=0), key=lambda c: c.seq)
    assert [c.id for c in indexed] == [e.id.hex() for e in envs]  # arrival order
    assert all(store.read(e.id.hex()) == e.raw for e in envs)
    store.close()


def test_a_group_visible_in_the_index_but_not_yet_unstaged_is_counted_once(tmp_path, monkeypatch):
    """The commit thread writes on its own connection without the lock; between its COMMIT and the
    end of staging a submission is in both places, and quotas still count it once."""
    committed, release = threading.Event(), threading.Event()
    real = writer_mod.insert_rows

    def insert(db, items):
        real(db, items)
        if db is not store._db:  # the commit thread's transaction, now visible to readers
            committed.set()
            assert release.wait(WAIT_S), "test never released the commit"

    monkeypatch.setattr(writer_mod, "insert_rows", insert)
    store = SubmissionStore(tmp_path, RUN)
    w = NodeKey.generate()
    envs = [open_envelope(submission(w, counter=c), run_id=RUN) for c in range(3)]
    futures = [store.submit(e, source_ip="10.0.0.2") for e in envs]
    assert committed.wait(WAIT_S)
    # the first group (whichever files were written first) is in the index and still staged
    assert any(store.get(e.id.hex()) is not None and store.storing(e.id.hex()) for e in envs)
    n_indexed = store.counts()["pending"]
    u = store.usage(w.peer_id, "10.0.0.2")
    assert (u.worker_pending, u.ip_pending, u.disk_files) == (3, 3, 3) and u.worker_bytes == sum(len(e.raw) for e in envs)
    assert store.counter_used(w.peer_id, 0, exclude_id="other")
    release.set()
    assert all(f.result(WAIT_S) is True for f in futures)
    after = store.usage(w.peer_id, "10.0.0.2")  # every file written now (writing_bytes 0); the rest unchanged
    assert dataclasses.replace(after, writing_bytes=u.writing_bytes) == u and after.writing_bytes == 0 and n_indexed >= 1
    store.close()


def test_a_failed_commit_answers_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    store = SubmissionStore(tmp_path, RUN)
    w = NodeKey.generate()
    env = open_envelope(submission(w), run_id=RUN)

    def fail(directory: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer_mod, "fsync_dir", fail)
    with pytest.raises(OSError):
        store.add(env, source_ip="10.0.0.1")
    assert not (tmp_path / "submissions" / f"{env.id.hex()}.sub").exists()
    assert store.usage(w.peer_id, "10.0.0.1").disk_files == 0 and not store.storing(env.id.hex())
    monkeypatch.undo()
    assert store.add(env) is True  # nothing was stored: the retry stores it
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("binding", ["worker", "ip", "disk"])
async def test_concurrent_posts_from_many_workers_each_accepted_once_quotas_exact(tmp_path, binding):
    """12 workers post 6 counters each, every envelope twice, plus a replayed counter with other bytes,
    all at once: each quota that binds holds exactly, every counter is stored at most once, and
    every stored submission was answered ``stored: true`` exactly once."""
    # every worker here is new (on probation), from an address nothing judges: their share of the disk quota and
    # the shared rate of unproven addresses are lifted, so the quota under test binds
    limits = IngestLimits(requests_per_s=1000.0, burst=1000.0, decode_concurrency_per_ip=4, max_pending_per_worker=4,
                          max_pending_per_ip={"ip": 30}.get(binding, 10_000), max_disk_files={"disk": 25}.get(binding, 10_000),
                          probation_share=1.0, unproven_requests_per_s=1000.0, unproven_burst=1000.0)
    coord = Coordinator(tmp_path, limits=limits)
    runner, port = await serve(coord)
    workers = [NodeKey.generate() for _ in range(12)]
    subs = [submission(w, counter=c) for w in workers for c in range(6)]
    replays = [submission(w, counter=0, payload=5) for w in workers]  # counter 0 again, other bytes
    posts = subs + subs + replays
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=64)) as http:
            results = await asyncio.gather(*(post(http, SUBMISSIONS_ROUTE, s) for s in posts))
    finally:
        await runner.cleanup()
        coord.service.close()
    store = coord.store
    stored_ids = [b["id"] for status, b in results if status == 200 and b["stored"]]
    assert len(stored_ids) == len(set(stored_ids))  # no submission answered "stored" twice
    rows = [store.get(open_envelope(s, run_id=RUN).id.hex()) for s in subs + replays]
    in_store = {r.id for r in rows if r is not None}
    assert in_store == set(stored_ids)  # stored iff acknowledged as stored
    for status, b in results:
        assert status in (200, 409, 429, 507), (status, b)
        if status == 200 and not b["stored"]:
            assert b["duplicate"] and b["id"] in in_store
        if status == 409:
            assert b["error"] == "replay"
    per_worker: dict[str, list[int]] = {}
    for r in rows:
        if r is not None:
            per_worker.setdefault(r.worker, []).append(r.counter)
    for counters in per_worker.values():
        assert len(counters) == len(set(counters))  # each counter stored at most once
    expected = {"worker": 4 * 12, "ip": 30, "disk": 25}[binding]
    assert store.counts()["pending"] == len(in_store) == expected
    assert all(len(c) <= 4 for c in per_worker.values())
    store.close()


@pytest.mark.slow
def test_kill_9_after_acknowledgement_loses_nothing(tmp_path):
    """SIGKILL the ingest while submissions are in flight: every one it answered ``stored`` is there on reopening."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "trainer" / "ingest_crash_child.py"), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints its port, or exits (EOF) on failure
        assert line.startswith("PORT "), line
        port = int(line.split()[1])
        workers = [NodeKey.generate() for _ in range(40)]
        subs = [submission(w, counter=c) for w in workers for c in range(3)]
        acked: list[str] = []

        async def load() -> None:
            killed = asyncio.Event()

            async def one(http: aiohttp.ClientSession, data: bytes) -> None:
                try:
                    status, body = await post(http, SUBMISSIONS_ROUTE, data)
                except (TimeoutError, aiohttp.ClientError):
                    return  # cut off by the kill: not acknowledged
                if status == 200 and body["stored"]:
                    acked.append(body["id"])
                    if len(acked) == 30 and not killed.is_set():
                        killed.set()
                        os.kill(proc.pid, signal.SIGKILL)  # mid-flight: other posts are being stored right now

            timeout = aiohttp.ClientTimeout(total=WAIT_S)
            async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}", timeout=timeout,
                                             connector=aiohttp.TCPConnector(limit=32)) as http:
                await asyncio.gather(*(one(http, s) for s in subs))
            assert killed.is_set(), f"only {len(acked)} acknowledged before the load ended"

        asyncio.run(load())
        assert proc.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
    assert len(acked) >= 30
    store = SubmissionStore(tmp_path / "ingest", RUN)
    by_id = {open_envelope(s, run_id=RUN).id.hex(): s for s in subs}
    for sid in acked:
        assert store.get(sid) is not None, f"acknowledged submission {sid[:12]} lost"
        assert store.read(sid) == by_id[sid]
    assert store.counts()["pending"] >= len(acked)
    store.close()
