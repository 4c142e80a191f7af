"""`intellect-node doctor` against broken set-ups: a dead bootstrap peer, an ingest and origin of
another run, a non-libp2p bootstrap, a tampered spec, a taken port. (The healthy case runs against
a live devnet in test_devnet.py.)"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from localnet import serve_bodies

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


@pytest.mark.slow
def test_dead_bootstrap_and_wrong_run_ingest_fail(tmp_path, other_run_server, capsys, held_port):
    dead = held_port()  # nobody listens here (or can)
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


def test_coordinator_role(tmp_path, shared, capsys, held_port):
    """doctor --role coordinator: the key the spec names, validator keys in the spec, task files against
    tasks_hash (and a warning for a test split), ports read from the spec."""
    from node.commands.doctor import coordinator_checks

    key = NodeKey.generate()
    key.save(tmp_path / "coord.key")
    other = NodeKey.generate()
    other.save(tmp_path / "other.key")
    http, p2p = held_port(), held_port()  # the spec's ports: bindable by the coordinator (and doctor's check), by nobody else

    def spec(tmp: str, validators: list[str], tasks: str) -> Path:
        path = tmp_path / tmp
        assert main(["spec", "init", "--coordinator-key", str(tmp_path / "coord.key"), "--out", str(path), "--tasks", tasks,
                     "--data-root", str(shared / "data"), *[a for v in validators for a in ("--validator", v)],
                     "--ingest-url", f"http://127.0.0.1:{http}", "--bootstrap", f"/ip4/127.0.0.1/tcp/{p2p}/p2p/{key.peer_id}"]) == 0
        return path

    good = spec("good.toml", [NodeKey.generate().peer_id], "gsm8k_train")
    capsys.readouterr()
    by = _by_name(coordinator_checks(good, data_dir=tmp_path, data_root=shared / "data", key=tmp_path / "coord.key"))
    assert all(c.status == "PASS" for c in by.values()), [c for c in by.values() if c.status != "PASS"]
    assert "held out" in by["task"].detail and "matches the spec" in by["task"].detail
    assert str(http) in by["HTTP"].detail and str(p2p) in by["libp2p"].detail  # the spec's own ports
    # the wrong key, no task files, no validator in the spec, a test split: each one line with its fix
    bad = spec("bad.toml", [], "gsm8k")
    out = capsys.readouterr().out
    assert "warning: data.tasks 'gsm8k' is the GSM8K test split" in out and "gsm8k_train" in out  # spec init says so too
    by = _by_name(coordinator_checks(bad, data_dir=tmp_path, data_root=None, key=tmp_path / "other.key"))
    assert by["coordinator"].status == "FAIL" and key.peer_id in by["coordinator"].detail
    assert by["validator"].status == "FAIL" and "--validator" in by["validator"].fix and "new spec" in by["validator"].fix
    assert by["task"].status == "FAIL" and "--data-root" in by["task"].fix
    assert by["training"].status == "WARN" and "gsm8k_train" in by["training"].detail
    # task files that are not the ones the spec was made from
    alt = tmp_path / "data" / "math"
    alt.mkdir(parents=True)
    (alt / "gsm8k_train.jsonl").write_text("".join((shared / "data" / "math" / "gsm8k_train.jsonl").read_text().splitlines(True)[:-1]))
    by = _by_name(coordinator_checks(good, data_dir=tmp_path, data_root=tmp_path / "data"))
    assert by["task"].status == "FAIL" and "pins" in by["task"].detail
    assert by["coordinator"].status == "WARN"  # no --key given
    with socket.socket() as s:  # the coordinator's HTTP port taken by a listener
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # beside the test's own hold on it
        s.bind(("127.0.0.1", http))
        s.listen()
        rc = main(["doctor", "--run", str(good), "--role", "coordinator", "--data-root", str(shared / "data"), "--data-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL  HTTP port" in out and "doctor (coordinator)" in out


def test_coordinator_base_check_says_where_the_embedded_base_comes_from(tmp_path, monkeypatch):
    """The default spec's base is the one shipped in the package, its hash checked (doctor said 'built and
    cached here at start' after the base was shipped); a shipped base whose files changed is a FAIL; another
    task set's embedded base is warm-started on this machine."""
    from node.commands.doctor import _check_base
    from node.coordinator import base
    from protocol.runspec import load_run_spec

    NodeKey.generate().save(tmp_path / "coord.key")
    for name, tasks in (("default.toml", "embedded"), ("gsm8k.toml", "gsm8k_train")):
        assert main(["spec", "init", "--coordinator-key", str(tmp_path / "coord.key"), "--out", str(tmp_path / name), "--tasks", tasks]) == 0
    default, other = (load_run_spec(tmp_path / n).spec for n in ("default.toml", "gsm8k.toml"))
    check = _check_base(default)
    assert check.status == "PASS" and "shipped in the package" in check.detail and "hash checked" in check.detail, check
    assert _check_base(other).status == "PASS" and "warm-started once on this machine" in _check_base(other).detail
    monkeypatch.setattr(base, "EMBEDDED_BASE_HASH", "0" * 64)
    check = _check_base(default)
    assert check.status == "FAIL" and "expected 0000000000000000" in check.detail and "reinstall" in check.detail, check


def test_port_whose_server_just_stopped_passes() -> None:
    """A port whose last server stopped a moment ago (its end of a connection in TIME_WAIT) is one the node
    binds (with SO_REUSEADDR, as node/http_server.py and py-libp2p do): doctor passes it (it failed it)."""
    from node.commands.doctor import _check_port

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()  # the server's end closes first: TIME_WAIT on the server's port
            client.recv(1)
    check = _check_port("127.0.0.1", port, "HTTP/status port", "--http-port")
    assert check.status == "PASS", check
