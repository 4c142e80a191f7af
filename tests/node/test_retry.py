"""Retry pacing: backoff grows with jitter and resets; a repeated failure is logged once per interval."""

from __future__ import annotations

import logging

import pytest

from node.retry import Backoff, FailureLog


def test_backoff_doubles_to_cap_with_jitter_and_resets():
    low = Backoff(base_s=1.0, max_s=8.0, rng=lambda: 0.0)
    assert [low.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    high = Backoff(base_s=1.0, max_s=8.0, rng=lambda: 0.999)
    delays = [high.next_delay() for _ in range(5)]
    assert delays[-1] == pytest.approx(8.0 * 1.499) and high.failures == 5
    high.reset()
    assert high.next_delay() == pytest.approx(1.499) and high.failures == 1
    with pytest.raises(ValueError):
        Backoff(base_s=2.0, max_s=1.0)


def test_failure_log_once_per_interval_then_recovery(caplog):
    now = [0.0]
    log = FailureLog(logging.getLogger("test.retry"), interval_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.retry")
    logged = []
    for _ in range(148):  # the validator's 148 attempts in 90 s
        logged.append(log.failed("ingest unreachable"))
        now[0] += 90 / 148
    assert sum(logged) == 3  # first at once, then once per 30 s (at ≈ 30 s and ≈ 61 s)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "ingest unreachable" and "times in the last 30 s" in lines[1] and "still failing after 61 s" in lines[2]
    assert log.failing
    log.recovered("ingest reachable")
    assert not log.failing and "again after 148 failed attempts" in caplog.records[-1].getMessage()
    log.recovered("ingest reachable")  # no streak: nothing more
    assert len(caplog.records) == 4


async def test_validator_backs_off_and_logs_once_while_no_ingest_answers(tmp_path, caplog):
    """The issue's validator logged "ingest unreachable" 148 times in 90 s after the coordinator
    exited: now its lease retries wait longer each time (jittered doubling) and log once."""
    import socket

    from node.validator.role import IDLE_POLL_S, LEASE_BACKOFF_MAX_S, ValidatorNode, ValidatorOptions
    from protocol.identity import NodeKey
    from protocol.runspec import NetworkSpec, RunInfo, RunSpec, sign_run_spec

    with socket.socket() as s:  # a port nobody listens on: every lease is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    coord, val = NodeKey.generate(), NodeKey.generate()
    spec = RunSpec(run=RunInfo(coordinator=coord.peer_id, validators=[val.peer_id]),
                   network=NetworkSpec(ingest_urls=[f"http://127.0.0.1:{port}"]))
    node = ValidatorNode(sign_run_spec(spec, coord), val, ValidatorOptions(data_dir=tmp_path, gossip=None, http_port=None))
    delays: list[float] = []

    async def record_sleep(seconds: float) -> None:  # no real waiting: the loop's requested delays are the evidence
        delays.append(seconds)
        if len(delays) == 10:
            node.request_stop()

    node._sleep = record_sleep  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="node.validator.role")
    await node.start()
    try:
        await node.run()
    finally:
        await node.stop()
    bounds = [min(LEASE_BACKOFF_MAX_S, IDLE_POLL_S * 2**k) for k in range(10)]
    assert all(0.5 * b <= d < 1.5 * b for d, b in zip(delays, bounds)), delays
    lines = [r.getMessage() for r in caplog.records if "lease failed" in r.getMessage()]
    assert len(lines) == 1 and f"127.0.0.1:{port} unreachable" in lines[0]
    assert node.state.startswith("ingest unreachable")


async def test_submitter_backs_off_and_logs_once_while_no_ingest_answers(tmp_path, caplog):
    import socket

    from node.worker.spool import Spool
    from node.worker.submitter import Submitter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spool = Spool(tmp_path / "spool")
    path = spool.put(1, b"not sent anyway")
    sub = Submitter(spool, [f"http://127.0.0.1:{port}"], base_backoff_s=0.5, max_backoff_s=8.0)
    delays: list[float] = []

    async def record_sleep(seconds: float) -> None:  # no real waiting: the requested delays are the evidence
        delays.append(seconds)
        if len(delays) == 8:
            spool.remove(path)  # taken care of elsewhere: drain ends

    sub._sleep = record_sleep  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="node.worker.submitter")
    try:
        assert await sub.drain() == 0
    finally:
        await sub.close()
    bounds = [min(8.0, 0.5 * 2**k) for k in range(8)]
    assert all(0.5 * b <= d < 1.5 * b for d, b in zip(delays, bounds)), delays
    assert sum("ingest not reachable" in r.getMessage() for r in caplog.records) == 1
