"""Tests of node.worker.spool (crash safety) and node.worker.submitter (delivery against a test ingest)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from node.worker.spool import Spool
from node.worker.submitter import Submitter
from protocol.ingest_api import SUBMISSIONS_ROUTE, TRANSIENT_RETRIES

REPO = Path(__file__).resolve().parents[2]


# --- spool -------------------------------------------------------------------------------------


def test_spool_survives_sigkill_and_never_reuses_a_counter(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    child = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from node.worker.spool import Spool
        s = Spool(Path({str(root)!r}))
        for _ in range(3):
            c = s.next_counter()
            s.put(c, b"submission %d" % c)
        s.next_counter()  # counter 3 taken, then the process dies before spooling it
        (Path({str(root)!r}) / "half-written.sub.tmp").write_bytes(b"partial")
        print("spooled", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "spooled"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    spool = Spool(root)  # the restarted worker
    pending = spool.pending()
    assert [p.name.split("-")[0] for p in pending] == ["000000000000", "000000000001", "000000000002"]
    assert [p.read_bytes() for p in pending] == [b"submission 0", b"submission 1", b"submission 2"]
    assert not list(root.glob("*.tmp"))  # half-written files are dropped, never sent
    assert spool.next_counter() == 4  # 3 was handed out before the crash: never reused
    assert Spool(root).next_counter() == 5


def test_counter_resumes_past_spooled_files_without_a_counter_file(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.put(41, b"x")
    (tmp_path / "counter").unlink(missing_ok=True)
    assert Spool(tmp_path).next_counter() == 42


# --- submitter -----------------------------------------------------------------------------------


class Ingest:
    """A test ingest: answers each POST with the next status of ``script`` (the last one repeats),
    as plain text, or as the ingest's JSON error with ``code`` and ``Retry-After`` when given."""

    def __init__(self, script: list[int], code: str | None = None, retry_after: str | None = None) -> None:
        self.script = list(script)
        self.code, self.retry_after = code, retry_after
        self.received: list[bytes] = []
        self.statuses: list[int] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        status = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        self.statuses.append(status)
        if status == 200:
            self.received.append(body)
            return web.json_response({"stored": True})
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        if self.code:
            return web.json_response({"error": self.code, "detail": "scripted"}, status=status, headers=headers)
        return web.Response(status=status, text=f"status {status}", headers=headers)


@asynccontextmanager
async def serve(ingest: Ingest, port: int = 0) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post(SUBMISSIONS_ROUTE, ingest.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        bound = runner.addresses[0][1]
        yield f"http://127.0.0.1:{bound}"
    finally:
        await runner.cleanup()


def _fill(spool: Spool, n: int) -> list[bytes]:
    bodies = [b"envelope-%d" % i for i in range(n)]
    for body in bodies:
        spool.put(spool.next_counter(), body)
    return bodies


def _submitter(spool: Spool, url: str) -> Submitter:
    return Submitter(spool, [url], timeout_s=5.0, base_backoff_s=0.05, max_backoff_s=0.2)


def _record_sleeps(sub: Submitter) -> list[float]:
    """Make ``sub``'s backoff waits instant and return the list the requested delays go into."""
    delays: list[float] = []

    async def record(seconds: float) -> None:
        delays.append(seconds)

    sub._sleep = record  # type: ignore[method-assign]
    return delays


async def _drain(spool: Spool, ingest: Ingest, expect: int) -> tuple[Submitter, list[float]]:
    """Drain ``spool`` into ``ingest`` with instant backoffs, checking that ``expect`` submissions were
    settled (acknowledged or refused for good); the closed submitter and the backoff delays it asked for."""
    async with serve(ingest) as url:
        sub = _submitter(spool, url)
        delays = _record_sleeps(sub)
        try:
            assert await asyncio.wait_for(sub.drain(deadline_s=60.0), 20.0) == expect
        finally:
            await sub.close()
    return sub, delays


async def test_acknowledged_submissions_leave_the_spool(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    bodies = _fill(spool, 3)
    ingest = Ingest([200])
    sub, delays = await _drain(spool, ingest, expect=3)
    assert ingest.received == bodies and delays == []  # in counter order, no backoff
    assert spool.pending() == [] and sub.acked == 3 and not sub.banned


@pytest.mark.parametrize(("status", "code", "reason"), [
    (409, None, "stale_policy"), (403, None, "banned"), (400, None, "malformed"), (413, None, "too_large"),
    (409, "replay", "replay"), (415, "unsupported_encoding", "unsupported_encoding"),
])
async def test_permanent_refusals_remove_for_good(tmp_path: Path, status: int, code: str | None, reason: str) -> None:
    spool = Spool(tmp_path)
    _fill(spool, 2)
    ingest = Ingest([status], code)
    sub, delays = await _drain(spool, ingest, expect=2)
    assert ingest.statuses == [status, status] and delays == []  # each tried once, never retried
    assert spool.pending() == [] and sub.acked == 0
    assert sub.refused == {reason: 2}
    assert sub.banned == (status == 403)


@pytest.mark.parametrize("transient", [429, 503])
async def test_transient_refusals_keep_the_file_and_retry_with_backoff(tmp_path: Path, transient: int) -> None:
    spool = Spool(tmp_path)
    bodies = _fill(spool, 2)
    ingest = Ingest([transient, transient, transient, 200])
    async with serve(ingest) as url:
        sub = _submitter(spool, url)
        try:
            out = await sub.send_one(spool.pending()[0])
            assert not out.final and out.status == transient and len(spool.pending()) == 2  # kept
            delays = _record_sleeps(sub)
            assert await asyncio.wait_for(sub.drain(deadline_s=10.0), 20.0) == 2
        finally:
            await sub.close()
    assert ingest.statuses == [transient] * 3 + [200, 200]
    assert ingest.received == bodies and spool.pending() == []
    assert len(delays) == 2 and 0.5 * 0.05 <= delays[0] < 1.5 * 0.05 and 0.5 * 0.1 <= delays[1] < 1.5 * 0.1  # jittered doubling


async def test_retry_after_is_honoured(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    bodies = _fill(spool, 1)
    ingest = Ingest([429, 507, 200], code=None, retry_after="3")
    sub, delays = await _drain(spool, ingest, expect=1)
    assert ingest.statuses == [429, 507, 200] and ingest.received == bodies and sub.acked == 1
    assert delays == [3.0, 3.0]  # the ingest's Retry-After, not the 0.05 s backoff


async def test_a_body_timeout_is_retried_a_bounded_number_of_times(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    _fill(spool, 1)
    ingest = Ingest([408])
    sub, delays = await _drain(spool, ingest, expect=1)
    assert ingest.statuses == [408] * (TRANSIENT_RETRIES + 1) and len(delays) == TRANSIENT_RETRIES
    assert spool.pending() == [] and sub.refused == {"timeout": 1} and sub.acked == 0


async def test_drain_gives_up_at_its_deadline_and_keeps_everything(tmp_path: Path, held_port) -> None:
    spool = Spool(tmp_path)
    _fill(spool, 3)
    sub = _submitter(spool, f"http://127.0.0.1:{held_port()}")  # connection refused
    try:
        assert await asyncio.wait_for(sub.drain(deadline_s=0.5), 10.0) == 0
    finally:
        await sub.close()
    assert len(spool.pending()) == 3


async def test_nothing_is_lost_while_the_coordinator_is_down(tmp_path: Path, held_port) -> None:
    spool = Spool(tmp_path)
    port = held_port()  # refused until the ingest comes back on it
    sub = _submitter(spool, f"http://127.0.0.1:{port}")
    bodies = _fill(spool, 2)
    ingest = Ingest([200])
    backoffs = asyncio.Semaphore(0)

    async def sleep_and_count(seconds: float) -> None:
        await asyncio.sleep(seconds)
        backoffs.release()

    sub._sleep = sleep_and_count  # type: ignore[method-assign]
    try:
        drain = asyncio.create_task(sub.drain(deadline_s=30.0))  # coordinator down: refused connections
        for _ in range(2):  # two failed rounds, each followed by a backoff
            await asyncio.wait_for(backoffs.acquire(), 10.0)
        assert not drain.done() and len(spool.pending()) == 2
        bodies += _fill(spool, 2)  # the worker keeps generating meanwhile
        async with serve(ingest, port):  # coordinator comes back on its address
            assert await asyncio.wait_for(drain, 15.0) == 4
    finally:
        await sub.close()
    assert ingest.received == bodies and spool.pending() == []


async def test_second_ingest_url_is_used_when_the_first_is_down(tmp_path: Path, held_port) -> None:
    spool = Spool(tmp_path)
    bodies = _fill(spool, 2)
    ingest = Ingest([200])
    async with serve(ingest) as url:
        sub = Submitter(spool, [f"http://127.0.0.1:{held_port()}", url], timeout_s=5.0, base_backoff_s=0.05)
        try:
            assert await asyncio.wait_for(sub.drain(deadline_s=10.0), 20.0) == 2
        finally:
            await sub.close()
    assert ingest.received == bodies



# --- after a restart: stale spooled work is dropped with one line, fresh work re-sent ------------


def _signed_submission(key, signed, step: int, counter: int) -> bytes:
    from protocol.envelope import seal
    from protocol.messages import Rollout, Submission, SubmissionTask

    r = Rollout(task=0, sample=0, seed=1, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00", logprobs=b"\x00" * 4,
                finish="length", task_reward=0.0, reward=0.0, proofs=[b"\x00" * 258])
    body = Submission(worker=key.peer_id, policy_step=step, counter=counter,
                      tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)], rollouts=[r])
    return seal(key, signed.run_id, body)


async def test_restart_drops_stale_spooled_work_with_one_line(tmp_path: Path, caplog) -> None:
    import logging

    from node.devnet.config import devnet_spec
    from node.worker.role import Worker, WorkerOptions
    from protocol.identity import NodeKey
    from protocol.runspec import sign_run_spec

    coord, key = NodeKey.generate(), NodeKey.generate()
    signed = sign_run_spec(devnet_spec(coord, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=1), coord)
    worker = Worker(signed, key, WorkerOptions(data_dir=tmp_path, gossip=None, http_port=None))
    for counter, step in enumerate([8, 9, 10, 12]):  # spooled before a crash; async level 2
        worker.spool.put(counter, _signed_submission(key, signed, step, counter))
    worker.spool.put(4, b"not an envelope")  # damaged on disk

    async def latest() -> int:
        return 12  # the newest policy announced while the worker was down: the window is [10, 12]

    worker.follower.poll_latest = latest  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="node.worker.role"):
        await worker._triage_spool()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart:")]
    assert len(lines) == 1, lines
    assert "re-sending 2 (policy steps 10, 12)" in lines[0] and "dropping 3 already stale (policy steps 8, 9, unreadable" in lines[0]
    assert "window [10, 12]" in lines[0]
    assert [worker.spool.policy_step(p, signed.run_id) for p in worker.spool.pending()] == [10, 12]
    assert worker.status()["spool_restart"] == {"found": 5, "resent": 2, "dropped_stale": 3, "latest_step": 12,
                                                "resent_steps": [10, 12], "dropped_steps": [8, 9, -1]}
    await worker.follower.close()
