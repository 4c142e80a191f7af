"""`intellect-node doctor` against broken set-ups: a dead bootstrap peer, an ingest and origin of
another run, a non-libp2p bootstrap, a tampered spec, a taken port. (The healthy case runs against
a live devnet in test_run_page.py.)"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from localnet import free_port, serve_bodies

from node.cli import main
from node.commands.doctor import estimate_model_bytes, run_checks
from node.devnet.config import devnet_spec
from protocol.identity import NodeKey
from protocol.runspec import dump_run_spec, sign_run_spec


@pytest.fixture
def other_run_server() -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering /status and /shardcast/1/held for a different run."""
    doc = json.dumps({"run_id": "ab" * 32, "peer_id": "x", "held_steps": [0]}).encode()
    with serve_bodies({"/status": doc, "/shardcast/1/held": doc}) as url:
        yield url


def _write_spec(tmp_path: Path, *, http_url: str, bootstrap: str) -> Path:
    coord = NodeKey.generate()
    spec = devnet_spec(coord, [NodeKey.generate().peer_id], tasks="embedded", http_url=http_url, bootstrap=bootstrap, seed=1)
    path = tmp_path / "run.toml"
    path.write_text(dump_run_spec(sign_run_spec(spec, coord)))
    return path


def _by_name(checks: list) -> dict[str, object]:
    return {c.name.split(" ")[0]: c for c in checks}


def test_dead_bootstrap_and_wrong_run_ingest_fail(tmp_path, other_run_server, capsys):
    dead = free_port()  # nobody listens here
    run = _write_spec(tmp_path, http_url=other_run_server, bootstrap=f"/ip4/127.0.0.1/tcp/{dead}/p2p/{NodeKey.generate().peer_id}")
    checks = run_checks(run, role="worker", data_dir=tmp_path / "data", timeout_s=2.0)
    by = _by_name(checks)
    assert by["run"].status == "PASS"
    assert by["bootstrap"].status == "FAIL" and "unreachable" in by["bootstrap"].detail, by["bootstrap"]
    assert by["ingest"].status == "FAIL" and "not this run" in by["ingest"].detail, by["ingest"]
    assert by["origin"].status == "FAIL" and "not this run" in by["origin"].detail, by["origin"]
    assert all(c.fix for c in checks if c.status != "PASS")
    # the local checks still pass: the machine is fine, the run's services are not
    for name in ("free", "memory", "HTTP/status", "libp2p"):
        assert by[name].status == "PASS", by[name]
    rc = main(["doctor", "--run", str(run), "--data-dir", str(tmp_path / "data"), "--timeout", "2", "--gossip-wait", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  bootstrap" in out and "fix:" in out and "failed" in out.splitlines()[-1]
    assert "FAIL  gossip" in out  # nothing of this run is heard through a dead bootstrap


def test_bootstrap_that_is_not_libp2p_fails(tmp_path, other_run_server):
    port = other_run_server.rsplit(":", 1)[1]
    run = _write_spec(tmp_path, http_url=other_run_server, bootstrap=f"/ip4/127.0.0.1/tcp/{port}/p2p/{NodeKey.generate().peer_id}")
    by = _by_name(run_checks(run, data_dir=tmp_path, timeout_s=2.0))
    assert by["bootstrap"].status == "FAIL" and "does not speak libp2p" in by["bootstrap"].detail, by["bootstrap"]


def test_tampered_spec_fails_signature(tmp_path, other_run_server, capsys):
    run = _write_spec(tmp_path, http_url=other_run_server, bootstrap="/ip4/127.0.0.1/tcp/1/p2p/" + NodeKey.generate().peer_id)
    run.write_text(run.read_text().replace('name = "devnet"', 'name = "devnet2"'))
    checks = run_checks(run, data_dir=tmp_path)
    assert [c.status for c in checks] == ["FAIL"] and checks[0].name == "run spec signature"
    assert main(["doctor", "--run", str(run), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["status"] == "FAIL"


def test_taken_port_fails(tmp_path, other_run_server):
    run = _write_spec(tmp_path, http_url=other_run_server, bootstrap="/ip4/127.0.0.1/tcp/1/p2p/" + NodeKey.generate().peer_id)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        by = _by_name(run_checks(run, data_dir=tmp_path, http_port=taken, timeout_s=1.0))
    assert by["HTTP/status"].status == "FAIL" and "--http-port" in by["HTTP/status"].fix


def test_embedded_model_size_estimate_matches_the_built_model():
    from protocol.models import build_model, embedded_config, embedded_tokenizer

    coord = NodeKey.generate()
    spec = devnet_spec(coord, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=1)
    model = build_model(embedded_config(len(embedded_tokenizer()), hidden_size=spec.model.hidden_size))
    params = sum(p.numel() for p in model.parameters())
    assert estimate_model_bytes(spec) == params * 4


def test_gpu_memory_from_nvidia_smi(tmp_path, monkeypatch):
    from node.commands.doctor import _check_gpu

    fake = tmp_path / "nvidia-smi"  # prints what the real one prints for --query-gpu=name,memory.free,memory.total
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 140000, 143771'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    ok = _check_gpu(1 << 30, "worker")
    assert ok.status == "PASS" and "NVIDIA H200" in ok.detail and "136.7 GiB" in ok.detail, ok
    short = _check_gpu(40 << 30, "worker")  # 4 × 40 GiB does not fit in 136.7 GiB free
    assert short.status == "WARN" and "--device cpu" in short.fix, short
