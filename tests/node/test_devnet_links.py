"""``devnet --links``: network namespaces with token-bucket-capped links, and their removal on
every way out — a normal exit, an exception, a failed set-up, SIGTERM, and a SIGKILLed devnet's
leftovers swept by the next run. Root only (``ip netns``, ``tc``); skipped elsewhere, except the
refusal itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.devnet import links as links_mod
from node.devnet.links import LINK_MBIT, PREFIX, Links, LinksError, namespaces, sweep_stale, unavailable

REASON = unavailable()
needs_root = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _ours() -> list[str]:
    return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{os.getpid()}-")]


def _qdiscs(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], check=False, capture_output=True).returncode == 0


@needs_root
def test_links_cap_each_node_both_ways_and_are_removed_on_exit():
    nodes = {"coordinator": "coordinator", "relay-0": "relay", "validator-0": "validator", "worker-0": "worker"}
    with Links(nodes) as ln:
        assert sorted(_ours()) == sorted([ln.bridge, *(n.namespace for n in ln.nodes.values())])
        bridge = _qdiscs(ln.bridge)
        for i, (name, role) in enumerate(nodes.items()):
            node = ln.nodes[name]
            rate = f"rate {LINK_MBIT[role] // 1000}Gbit" if LINK_MBIT[role] >= 1000 else f"rate {LINK_MBIT[role]}Mbit"
            assert "qdisc tbf" in _qdiscs(node.namespace) and rate in _qdiscs(node.namespace)  # upload
            assert f"dev p{i} " in bridge  # download, on its bridge port
            assert ln.wrap(name, ["true"])[:4] == ["ip", "netns", "exec", node.namespace]
        assert len({n.ip for n in ln.nodes.values()} | {ln.host_ip}) == 5
        host = ln.host_veth
        assert _link_exists(host)
        # the host reaches a node (the devnet process polls the coordinator's run page this way)
        code = (f"import socket; s = socket.socket(); s.bind(('{ln.ip('coordinator')}', 18731)); s.listen(); print('up', flush=True); "
                "c, _ = s.accept(); c.sendall(b'hi'); c.close()")
        server = subprocess.Popen(ln.wrap("coordinator", [sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "up"
            import socket

            with socket.create_connection((ln.ip("coordinator"), 18731), timeout=10) as c:
                assert c.recv(2) == b"hi"
        finally:
            server.kill()
            server.wait()
    assert _ours() == [] and not _link_exists(host)


@needs_root
def test_links_are_removed_when_the_run_raises():
    with pytest.raises(RuntimeError, match="boom"), Links({"coordinator": "coordinator", "worker-0": "worker"}) as ln:
        assert len(_ours()) == 3
        host = ln.host_veth
        raise RuntimeError("boom")
    assert _ours() == [] and not _link_exists(host)


@needs_root
def test_a_failed_setup_removes_what_it_made(monkeypatch):
    real = links_mod._run
    calls = []

    def failing(*args):
        calls.append(args)
        if args[:3] == ("ip", "netns", "exec") and len([c for c in calls if c[:3] == ("ip", "netns", "exec")]) == 3:
            raise LinksError("tc: simulated failure")  # the third qdisc: two namespaces exist by then
        return real(*args)

    monkeypatch.setattr(links_mod, "_run", failing)
    with pytest.raises(LinksError, match="simulated"):
        Links({"coordinator": "coordinator", "relay-0": "relay", "worker-0": "worker"}).setup()
    monkeypatch.setattr(links_mod, "_run", real)
    assert _ours() == []


@needs_root
def test_namespaces_of_a_killed_devnet_are_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    stale = f"{PREFIX}{dead.pid}-worker-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)


@needs_root
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_sigterm_stops_the_devnet_and_removes_its_namespaces(tmp_path):
    """A devnet stopped by SIGTERM while its nodes start: every child stopped, every namespace gone."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "node", "devnet", "--links", "--steps", "1", "--workers", "1", "--relays", "1",
                          "--out", str(out), "--no-dashboard", "--timeout", "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        mine = f"{PREFIX}{p.pid}-"
        end = time.monotonic() + 120
        while not (out / "logs" / "coordinator.log").exists():  # namespaces are up, the coordinator starting in one
            assert p.poll() is None and time.monotonic() < end, p.stdout.read() if p.stdout else ""
            time.sleep(0.1)
        assert len([ns for ns in namespaces() if ns.startswith(mine)]) == 5  # bridge, coordinator, relay, validator, worker
        p.send_signal(signal.SIGTERM)
        output, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "every process was stopped" in output, output
    assert [ns for ns in namespaces() if ns.startswith(mine)] == []
    assert not _link_exists(f"{PREFIX}h{p.pid}"[:15])
    import psutil

    assert [q for q in psutil.process_iter(["cmdline"]) if str(out) in " ".join(q.info["cmdline"] or [])] == []


def test_links_refused_without_root_in_one_line(monkeypatch, capsys):
    from node.cli import main

    monkeypatch.setattr(links_mod.os, "geteuid", lambda: 1000)
    assert unavailable() is not None and "needs root" in (unavailable() or "")
    assert main(["devnet", "--links", "--out", str(Path("/nonexistent-h25-links")), "--no-dashboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --links needs root"), err


@pytest.mark.parametrize(("flags", "says"), [
    (["--link-mbit", "worker=1000"], "--link-mbit sets link rates of --links: add --links"),
    (["--links", "--link-mbit", "miner=1000"], "--link-mbit 'miner=1000': expected ROLE=MBIT with ROLE one of coordinator, relay"),
    (["--links", "--link-mbit", "worker"], "--link-mbit 'worker': expected ROLE=MBIT"),
    (["--links", "--link-mbit", "worker=0"], "--link-mbit 'worker=0': the rate is a whole number of Mb/s from 1 to 100000"),
    (["--links", "--link-mbit", "worker=1.5"], "--link-mbit 'worker=1.5': the rate is a whole number"),
    (["--links", "--link-mbit", "worker=100", "--link-mbit", "worker=200"], "--link-mbit: worker given twice"),
])
def test_bad_link_rates_are_one_line_errors(flags, says, capsys):
    from node.cli import main

    assert main(["devnet", *flags, "--out", str(Path("/nonexistent-link-mbit")), "--no-dashboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {says}"), err


@needs_root
def test_a_role_given_its_own_rate_gets_it_both_ways():
    with Links({"coordinator": "coordinator", "worker-0": "worker"}, mbit={"worker": 1000}) as links:
        assert links.nodes["worker-0"].mbit == 1000 and links.nodes["coordinator"].mbit == LINK_MBIT["coordinator"]
        assert "rate 1Gbit" in _qdiscs(links.nodes["worker-0"].namespace)
