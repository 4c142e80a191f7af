"""A hostile worker (and a failing disk) against the ingest's group commit (trainer/ledger/writer.py).

A real ingest server on 127.0.0.1; disk faults are injected into the real write path by making
``os.fsync`` fail (where a failing disk reports EIO or a full one ENOSPC) or wait, once each.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import threading
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ingest_attack_helpers import honest_session, post, running_ingest, submission
from waiting import wait_until

from protocol.identity import NodeKey

SUBMISSIONS = "/ingest/1/submissions"


class FsyncFault:
    """Replaces ``os.fsync``: the next call on a regular file (``files``) or a directory (``dirs``)
    raises ``error`` once, or waits for :attr:`release` (``block``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, files: bool = False, dirs: bool = False, error: int = errno.EIO,
                 block: bool = False) -> None:
        self.release = threading.Event()
        self.hit = threading.Event()
        self._armed = True
        real = os.fsync

        def fsync(fd: int) -> None:
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            if self._armed and (dirs if is_dir else files):
                self._armed = False
                self.hit.set()
                if block:
                    assert self.release.wait(30.0), "the test never released the blocked fsync"
                else:
                    raise OSError(error, os.strerror(error))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FsyncFault]]:
    made: list[FsyncFault] = []

    def make(**kw: object) -> FsyncFault:
        made.append(FsyncFault(monkeypatch, **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for f in made:
        f.release.set()


def _leftovers(store_dir: Path) -> list[str]:
    return sorted(p.name for p in store_dir.iterdir())


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
async def test_a_failed_file_write_answers_a_retryable_error_leaves_nothing_and_the_ingest_goes_on(
        tmp_path: Path, fault: Callable[..., FsyncFault], error: int) -> None:
    """Was: a 500 text/plain answer, and the half-written temporary file stayed on disk (counted by
    no quota, removed only at the next start), so every failed write leaked up to 32 MiB."""
    async with running_ingest(tmp_path) as ing:
        worker = NodeKey.generate()
        first, second = submission(worker, counter=0, payload_tokens=4096), submission(worker, counter=1)
        f = fault(files=True, error=error)
        async with honest_session(ing.url) as http:
            status, body = await post(http, SUBMISSIONS, first)
            assert f.hit.is_set()
            assert (status, body["error"]) == (503, "storage_failed"), body
            assert _leftovers(ing.store.dir) == []  # neither the file nor its temporary file
            u = ing.store.usage(worker.peer_id, "127.0.0.1")
            assert (u.worker_pending, u.disk_files, u.disk_bytes) == (0, 0, 0)
            # the same bytes again, and another submission: both stored (the failure was not final)
            assert (await post(http, SUBMISSIONS, first))[0] == 200
            assert (await post(http, SUBMISSIONS, second))[0] == 200
        assert ing.store.counts()["pending"] == 2
        assert all(name.endswith(".sub") for name in _leftovers(ing.store.dir))


async def test_a_failed_group_commit_answers_a_retryable_error_and_the_commit_thread_survives(
        tmp_path: Path, fault: Callable[..., FsyncFault]) -> None:
    async with running_ingest(tmp_path) as ing:
        worker = NodeKey.generate()
        f = fault(dirs=True)
        async with honest_session(ing.url) as http:
            status, body = await post(http, SUBMISSIONS, submission(worker, counter=0))
            assert f.hit.is_set()
            assert (status, body["error"]) == (503, "storage_failed"), body
            assert _leftovers(ing.store.dir) == []
            assert ing.store.counts()["pending"] == 0
            assert (await post(http, SUBMISSIONS, submission(worker, counter=1)))[0] == 200
        assert ing.store.counts()["pending"] == 1


async def test_concurrent_submissions_cannot_write_the_disk_past_its_free_space_floor(
        tmp_path: Path, fault: Callable[..., FsyncFault], monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the free-space check read the file system only, so every submission admitted while
    earlier ones were still being written saw the same free space, and up to the 512 MiB in flight
    could be written into the 256 MiB floor (a full disk also stops the index, verdicts and bans)."""
    async with running_ingest(tmp_path) as ing:
        a, b = submission(NodeKey.generate(), payload_tokens=2048), submission(NodeKey.generate(), payload_tokens=2048)
        floor = ing.service.limits.min_free_disk_bytes
        du = namedtuple("du", "total used free")
        # room for one of the two above the floor, as the file system reports before either lands
        monkeypatch.setattr(shutil, "disk_usage", lambda _p: du(1 << 40, 0, floor + len(a) + len(a) // 2))
        f = fault(files=True, block=True)  # the first file's write waits: it is admitted, not yet on disk
        async with honest_session(ing.url) as http:
            first = asyncio.ensure_future(post(http, SUBMISSIONS, a))
            await wait_until(f.hit.is_set, what="the first submission's write")
            status, body = await post(http, SUBMISSIONS, b)
            assert (status, body["error"]) == (507, "disk_full"), body
            f.release.set()
            assert (await asyncio.wait_for(first, 20.0))[0] == 200
        assert ing.store.counts()["pending"] == 1


async def test_replays_duplicates_and_quota_races_during_the_staged_window(tmp_path: Path, fault: Callable[..., FsyncFault]) -> None:
    """While a worker's first submission is admitted but not yet written (its file write held), the
    same bytes again are one stored copy, another envelope with its counter is a replay, and ten
    concurrent submissions with fresh counters get exactly its quota of 4 pending slots."""
    async with running_ingest(tmp_path) as ing:
        worker = NodeKey.generate()
        first = submission(worker, counter=0)
        f = fault(files=True, block=True)
        async with honest_session(ing.url) as http:
            held = asyncio.ensure_future(post(http, SUBMISSIONS, first))
            await wait_until(f.hit.is_set, what="the first submission's write")
            twin = asyncio.ensure_future(post(http, SUBMISSIONS, first))  # answered once the first is durable
            status, body = await post(http, SUBMISSIONS, submission(worker, counter=0))  # new nonce, same counter
            assert (status, body["error"]) == (409, "replay"), body
            answers = await asyncio.gather(*(post(http, SUBMISSIONS, submission(worker, counter=c)) for c in range(1, 11)))
            f.release.set()
            assert (await asyncio.wait_for(held, 20.0))[0] == 200
            twin_status, twin_body = await asyncio.wait_for(twin, 20.0)
        assert (twin_status, twin_body["stored"], twin_body["duplicate"]) == (200, False, True)
        codes = sorted(str(s) if s == 200 else b["error"] for s, b in answers)
        assert codes == ["200"] * 3 + ["backpressure"] * 7, codes  # 4 pending in all, the held one among them
        assert ing.store.counts()["pending"] == 4
        assert ing.store.worker_stats()[worker.peer_id] == {"pending": 4}
