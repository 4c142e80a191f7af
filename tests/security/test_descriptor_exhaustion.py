"""Descriptor exhaustion against a real node process (issue 23 item 6).

A relay (``intellect-node join --role relay``, serving its store as an origin, no gossip) runs
under ``ulimit -n 1024`` while an attacker on 127.0.0.2–127.0.0.19 keeps 1,152 connections open
that never send a request (64 per address, the per-address cap), re-opening every 5 s those
the server closed (≈ 130 connects/s, about the rate of the issue's attack, whose connections the
10 s header timeout closed; a faster connect flood is a network-level attack this process cannot
out-compute). Before: the connection cap was
1,024, the soft limit's own size, so ``accept()`` failed with EMFILE and asyncio logged an ERROR
per try (169,417 records in 45 s), honest GETs timed out and the node could not open its files.
Now the cap comes from the descriptor budget (1,024 − 256 kept for files − 256 for connections
accepted over the cap before they are closed), accept failures would be logged once per 10 s,
and ``/status`` answers within 2 s throughout (before: 6 of 7 GETs timed out).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from protocol.runspec import dump_run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
from shardcast_fixtures import make_run
from waiting import wait_for

pytestmark = pytest.mark.integration

ATTACK_S = 15.0
ADDRESSES = [f"127.0.0.{i}" for i in range(2, 20)]  # 18 × 64 = 1,152 connections
PER_ADDRESS = 64
CLIENT_TIMEOUT_S = 2.0


def _start_relay(tmp_path: Path, nofile: tuple[int, int]) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A relay process under ``nofile``, on a port it picks (``--http-port 0``) and prints; returns it, its URL and its log."""
    run = make_run()
    (tmp_path / "run.toml").write_text(dump_run_spec(run.signed))
    log = tmp_path / "relay.log"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "node", "join", "--role", "relay", "--run", str(tmp_path / "run.toml"), "--data-dir", str(tmp_path / "d"),
             "--http-port", "0", "--no-gossip"],
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit,  # noqa: PLW1509 - sets only the child's rlimit
        )
    serving = wait_for(lambda: re.search(r"serving (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace")), 60,
                       "the relay's 'serving' line", proc)
    return proc, serving.group(1), log


async def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + 60
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < end:
            assert proc.poll() is None, "the relay exited"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/status") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise AssertionError("the relay did not come up")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_half_open_flood_under_ulimit_1024_leaves_status_answering_and_the_log_quiet(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(ADDRESSES) * PER_ADDRESS + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        pytest.skip(f"the attacker needs {need} descriptors in this process")
    proc, url, log = _start_relay(tmp_path, (1024, 1024))
    port = int(url.rsplit(":", 1)[1])
    held: dict[str, list[socket.socket]] = {a: [] for a in ADDRESSES}
    answered, slowest = 0, 0.0
    try:
        await _wait_up(url, proc)

        def top_up() -> None:
            for addr, socks in held.items():
                socks[:] = [s for s in socks if _alive(s)]
                while len(socks) < PER_ADDRESS:
                    s = socket.socket()
                    s.setblocking(False)
                    s.bind((addr, 0))
                    with contextlib.suppress(BlockingIOError):
                        s.connect(("127.0.0.1", port))
                    socks.append(s)

        top_up()  # the flood's first burst of 1,152 connects: wait (unbounded) until the server answers again
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http, \
                http.get(f"{url}/status", timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200
        end = time.monotonic() + ATTACK_S
        next_top_up = 0.0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
                                         connector=aiohttp.TCPConnector(force_close=True)) as http:
            while time.monotonic() < end:  # the sustained attack: every honest GET within 2 s
                if time.monotonic() >= next_top_up:  # re-open what the server closed, every 5 s
                    top_up()
                    next_top_up = time.monotonic() + 5.0
                t0 = time.monotonic()
                async with http.get(f"{url}/status") as r:  # an honest client: raises past 2 s
                    assert r.status == 200
                    await r.read()
                answered += 1
                slowest = max(slowest, time.monotonic() - t0)
                await asyncio.sleep(0.3)
        assert proc.poll() is None, "the relay died"
    finally:
        for socks in held.values():
            for s in socks:
                s.close()
        _stop(proc)
    text = log.read_text(errors="replace")
    accept_errors = len(re.findall(r"socket\.accept\(\) out of system resource", text))
    reports = len(re.findall(r"accept\(\) failed \d+ times", text))
    errors = len(re.findall(r"\bERROR\b", text))
    assert answered >= 10 and slowest < CLIENT_TIMEOUT_S, (answered, slowest)
    assert accept_errors == 0 and errors == 0, f"{accept_errors} accept errors, {errors} ERROR records: {text[-2000:]}"
    assert reports <= ATTACK_S / 10 + 1
    assert "HTTP connections capped at 512" in text, "the cap came from the descriptor budget"


def _alive(s: socket.socket) -> bool:
    """Whether the server still holds this connection (a reset or EOF means it was dropped)."""
    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        return False
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError as e:
        return e.errno == errno.ENOTCONN  # still connecting


def test_the_soft_limit_is_raised_to_the_hard_limit_at_start() -> None:
    code = (
        "import resource\n"
        "from node.fds import CONNECTION_BUDGET, raise_open_files_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))\n"
        "print(raise_open_files_limit(), CONNECTION_BUDGET.grant(1024), CONNECTION_BUDGET.grant(4096))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ}, check=False)
    assert out.stdout.split("\n")[0] == "(4096, 4096) 1024 2560", out.stdout + out.stderr


_EXHAUSTED_SERVER = """
import asyncio, logging, os, resource, sys
from aiohttp import web
from node.http_server import start_site

async def main():
    app = web.Application()
    app.router.add_get("/small", lambda r: web.Response(text="ok"))
    running = await start_site(app, "127.0.0.1")
    # descriptors run out after start (another part of the process took them): accept() fails
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(running.port, flush=True)
    await asyncio.sleep(float(sys.argv[1]))
    print("failures", running.accept_errors.failures, "logged", running.accept_errors.logged, flush=True)
    await running.stop()

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
asyncio.run(main())
"""


def test_accept_failures_are_logged_once_per_interval(tmp_path: Path) -> None:
    """When descriptors do run out, asyncio's ERROR per failed ``accept()`` (up to 512 per loop
    pass, 169,417 records in 45 s) becomes one WARNING per 10 s with a count."""
    script = tmp_path / "server.py"
    script.write_text(_EXHAUSTED_SERVER)
    proc = subprocess.Popen([sys.executable, str(script), "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    socks = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            socks.append(s)
        out, err = proc.communicate(timeout=60)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
    failures, logged = (int(x) for x in re.findall(r"failures (\d+) logged (\d+)", out)[0])
    assert failures > 0, "descriptors did run out"
    assert logged == 1 and err.count("accept() failed") == 1, err[-2000:]
    assert "ERROR" not in err, err[-2000:]
