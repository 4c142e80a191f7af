"""A hostile worker (and a failing disk) against the ingest's group commit (trainer/ingest/store.py).

A real ingest server on 127.0.0.1; disk faults are injected into the real write path by making
``os.fsync`` fail (where a failing disk reports EIO or a full one ENOSPC) or wait, once each.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ingest_attack_helpers import honest_session, post, running_ingest, submission

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
