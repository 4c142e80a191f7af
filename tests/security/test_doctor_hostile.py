"""`intellect-node doctor` against hostile answers (issue #23, item 7): relays come from the
coordinator's run page, which any self-signed gossip record joins, so a relay may answer anything.
Real servers on 127.0.0.1: one dribbling its body a byte every 2 s, one dribbling its head, one
answering 400,000-deep JSON, one streaming more than the body bound, one dribbling libp2p's
multistream answer. Each is a FAIL line; doctor never crashes and finishes: its whole-request
deadlines cut the dribblers off ("too slow"; without them the dribbling body, 100,000 bytes at one
per 2 s, would hold it past each test's timeout). How long it takes is no assertion here."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from localnet import serve_bodies

from node.cli import main
from node.commands.doctor import run_checks
from node.devnet.config import devnet_spec
from protocol.identity import NodeKey
from protocol.runspec import dump_run_spec, sign_run_spec

pytestmark = pytest.mark.slow

DRIBBLE_S = 2.0
"""Seconds between two bytes of a dribbling server (the attack of the issue)."""


@contextmanager
def hostile_server(behave: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """A TCP server on 127.0.0.1 that runs ``behave(conn, stop)`` for every connection in its own
    thread; yields ``http://127.0.0.1:PORT``; on exit sets ``stop`` and closes every socket."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    conns: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket) -> None:
        try:
            conn.settimeout(5.0)
            conn.recv(65536)  # the request head (doctor's GETs fit in one read)
            behave(conn, stop)
        except OSError:
            pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            t = threading.Thread(target=serve, args=(conn,), daemon=True)
            threads.append(t)
            t.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(timeout=5)
        listener.close()
        for c in conns:
            c.close()
        for t in threads:
            t.join(timeout=5)


def dribble_body(conn: socket.socket, stop: threading.Event) -> None:
    """Headers at once, then one body byte every 2 s (urllib's per-read timeout never fires)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    while not stop.wait(DRIBBLE_S):
        conn.sendall(b" ")


def dribble_head(conn: socket.socket, stop: threading.Event) -> None:
    """A status line, then one header byte every 2 s: the head never ends."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not stop.wait(DRIBBLE_S):
        conn.sendall(b"a")


def deep_json(conn: socket.socket, stop: threading.Event) -> None:
    """400,000-deep JSON (400 KB): json.loads raises RecursionError on it."""
    body = b"[" * 400_000
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def endless_body(conn: socket.socket, stop: threading.Event) -> None:
    """No length, a body streamed until the reader gives up (more than doctor's 1 MiB bound)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    chunk = b" " * 65536
    for _ in range(1024):  # at most 64 MiB
        if stop.is_set():
            return
        conn.sendall(chunk)


def dribble_multistream(conn: socket.socket, stop: threading.Event) -> None:
    """libp2p's multistream answer, one byte every 2 s."""
    for b in bytes([19]) + b"/multistream/1.0.0\n":
        if stop.wait(DRIBBLE_S):
            return
        conn.sendall(bytes([b]))


def _spec(tmp_path: Path, http_url: str, bootstrap_port: int) -> tuple[Path, str]:
    coord = NodeKey.generate()
    spec = devnet_spec(coord, [NodeKey.generate().peer_id], tasks="embedded", http_url=http_url,
                       bootstrap=f"/ip4/127.0.0.1/tcp/{bootstrap_port}/p2p/{coord.peer_id}", seed=1)
    signed = sign_run_spec(spec, coord)
    path = tmp_path / "run.toml"
    path.write_text(dump_run_spec(signed))
    return path, signed.run_id.hex()


def _by_name(checks: list) -> dict:
    return {c.name.split(" ")[0]: c for c in checks}


@pytest.mark.timeout(120)
def test_hostile_relays_are_fail_lines_and_doctor_finishes(tmp_path, capsys, held_port):
    with (hostile_server(dribble_body) as slow_body, hostile_server(dribble_head) as slow_head, hostile_server(deep_json) as deep,
          hostile_server(endless_body) as endless):
        relays = {"slow body": slow_body, "slow head": slow_head, "deep": deep, "endless": endless}
        # the coordinator is honest; its run page lists the relays gossip told it about
        bodies: dict[str, bytes] = {}
        with serve_bodies(bodies) as coord_url:
            run, run_id = _spec(tmp_path, coord_url, held_port())
            bodies["/status"] = json.dumps({"run_id": run_id, "trainer_step": 3, "latest_policy_step": 3}).encode()
            bodies["/shardcast/1/held"] = json.dumps({"run_id": run_id, "held_steps": [3], "steps": [3]}).encode()
            bodies["/api/run"] = json.dumps({"nodes": [{"role": "relay", "state": "alive", "http_url": u} for u in relays.values()]}).encode()
            checks = run_checks(run, role="worker", data_dir=tmp_path, timeout_s=3.0)
            by = _by_name(checks)
            assert by["ingest"].status == "PASS" and by["origin"].status == "PASS"
            relay = by["relays"]
            assert relay.status == "FAIL", relay
            for url in relays.values():
                assert url in relay.detail, (url, relay.detail)
            assert "too slow" in relay.detail  # the two dribblers, cut off by their whole-request deadlines
            assert "deeper than" in relay.detail and "larger than" in relay.detail, relay.detail
            # the command: one FAIL line for the relays, exit status 1
            rc = main(["doctor", "--run", str(run), "--data-dir", str(tmp_path), "--gossip-wait", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL  relays" in out, out


@pytest.mark.timeout(120)
def test_hostile_ingest_and_bootstrap_are_fail_lines(tmp_path):
    """The spec's own addresses, hostile (a coordinator machine taken over, or a spec pointing at the
    wrong host): a deep-JSON ingest and a bootstrap peer dribbling its multistream answer."""
    with hostile_server(deep_json) as deep, hostile_server(dribble_multistream) as slow_p2p:
        run, _ = _spec(tmp_path, deep, int(slow_p2p.rsplit(":", 1)[1]))
        checks = run_checks(run, role="worker", data_dir=tmp_path, timeout_s=3.0)
    by = _by_name(checks)
    assert by["ingest"].status == "FAIL" and "deeper than" in by["ingest"].detail, by["ingest"]
    assert by["origin"].status == "FAIL" and "deeper than" in by["origin"].detail, by["origin"]
    assert by["bootstrap"].status == "FAIL" and "does not speak libp2p" in by["bootstrap"].detail, by["bootstrap"]
    assert by["relays"].status == "WARN"  # the run page (same hostile server) gave no relay list


def test_deep_json_is_refused_before_decoding():
    from node.jsonlimits import json_depth, loads_bounded

    assert json_depth(b'{"a": [1, {"b": "[[[["}], "c": "\\"]"}', 16) == 3  # brackets in strings do not count
    with pytest.raises(ValueError, match="deeper than 16"):
        loads_bounded(b"[" * 400_000, max_bytes=1 << 20, max_depth=16)
    with pytest.raises(ValueError, match="larger than"):
        loads_bounded(b"[]" * 10, max_bytes=8, max_depth=16)
    # an unterminated string of escaped quotes: linear work, then json's own error
    with pytest.raises(ValueError):
        loads_bounded(b'"' + b'\\"' * 200_000, max_bytes=1 << 20, max_depth=16)
    assert loads_bounded(b'{"held_steps": [1, 2]}', max_bytes=100, max_depth=2) == {"held_steps": [1, 2]}
