"""A contributor's path, as a newcomer takes it (issue 35): the coordinator prints its run address; a worker, a relay
and a validator start from that address alone, in fresh folders (own HOME and working directory, no data root, no
run.toml, no task files); the worker's rollouts are trained on, the relay mirrors the task list and the trained step,
and `intellect-node status ADDRESS` on the worker's machine shows its accepted and trained submissions, signed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from localnet import get_json
from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_TIMEOUT_S = 480.0
"""Longest time from the coordinator's start to a trained step whose rollouts came from the newcomer (2 shared cores)."""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("INTELLECT_NODE_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME")}
    bin_dir = str(Path(sys.executable).parent)
    return {**env, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def test_newcomer_joins_from_the_address_alone(tmp_path):
    from node.coordinator.base import EMBEDDED_BASE_DIR
    from protocol.embedded import embedded_tasks

    node_bin = Path(sys.executable).parent / "intellect-node"
    assert node_bin.exists() and (node_bin.parent / "intellect-train").exists(), "pip install -e . first"
    # the coordinator's machine: its keys, a validator's key, a task file and a model only it holds
    coord = tmp_path / "coordinator"
    coord.mkdir()
    cenv = _env(coord)
    for k in ("coord.key", "val.key"):
        subprocess.run([node_bin, "keygen", "--key", k], cwd=coord, env=cenv, check=True, capture_output=True, timeout=60)
    val_id = subprocess.run([node_bin, "id", "--key", "val.key"], cwd=coord, env=cenv, check=True, capture_output=True, text=True,
                            timeout=60).stdout.split()[0]
    (coord / "tasks.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in embedded_tasks()))
    shutil.copytree(EMBEDDED_BASE_DIR, coord / "model")
    init = subprocess.run([node_bin, "spec", "init", "--coordinator-key", "coord.key", "--out", "run.toml", "--name", "newcomer",
                           "--model-base", "model", "--tasks", str(coord / "tasks.jsonl"), "--validator", val_id, "--max-tokens", "4",
                           "--temperature", "1.5", "--group-size", "8", "--batch-groups", "2", "--tasks-per-submission", "2",
                           "--learning-rate", "0.001", "--piece-size", "65536"],
                          check=False, cwd=coord, env=cenv, capture_output=True, text=True, timeout=120)
    assert init.returncode == 0, init.stderr
    spec_text = (coord / "run.toml").read_text()
    assert "[artifacts]" in spec_text and "ingest_urls = []" in spec_text, "the spec pins the task list and names no URL: the address does"

    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def start(name: str, argv: list, cwd: Path, env: dict[str, str]) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "w") as log:
            procs[name] = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(name: str) -> str:
        return logs[name].read_text(errors="replace")

    try:
        start("coordinator", [node_bin.parent / "intellect-train", "--run", "run.toml", "--key", "coord.key", "--data-dir", "coord-data",
                              "--eval-samples", "0", "--probe-tasks", "0", "--max-steps", "50", "--batch-timeout", str(int(RUN_TIMEOUT_S))],
              coord, cenv)
        found = wait_for(lambda: re.search(r"^run address: (\S+)$", log("coordinator"), re.MULTILINE), 180, "the coordinator's run address",
                         procs["coordinator"])
        address = found.group(1)
        coord_url = re.search(r"@(http://[^,]+)", address).group(1)

        # newcomers: a fresh HOME and working directory each, the address and nothing else
        relay_home, worker_home = tmp_path / "relay-home", tmp_path / "worker-home"
        start("relay", [node_bin, "join", "--role", "relay", address], relay_home / "cwd", _env(relay_home))
        start("worker", [node_bin, "join", "--role", "worker", address], worker_home / "cwd", _env(worker_home))
        val_home = tmp_path / "validator-home"
        start("validator", [node_bin, "validate", address, "--key", str(coord / "val.key")], val_home / "cwd", _env(val_home))

        relay_url = wait_for(lambda: (m := re.search(r"serving (http://\S+) ", log("relay"))) and m.group(1), 120, "the relay's URL",
                             procs["relay"])
        wait_for(lambda: "worker fits the machine: engine transformers on cpu" in log("worker"), 240, "the worker's engine plan",
                 procs["worker"])

        def trained() -> bool:
            return (get_json(f"{coord_url}/status") or {}).get("trainer_step", 0) >= 1

        wait_for(trained, RUN_TIMEOUT_S, "a trained step", procs["coordinator"])
        held = wait_for(lambda: (st := get_json(f"{relay_url}/status")) and 1 in st.get("held_steps", []) and st, 120,
                        "the relay holding trained step 1", procs["relay"])
        assert held["latest_step"] >= 1

        # the worker's own view, on its machine, from the coordinator's signed account
        mine = subprocess.run([node_bin, "status", address, "--mine", "--json"], cwd=worker_home / "cwd", env=_env(worker_home),
                              check=False, capture_output=True, text=True, timeout=120)
        assert mine.returncode == 0, mine.stderr
        standing = json.loads(mine.stdout)["mine"]
        assert standing["accepted"] >= 1 and standing["trained"] >= 1 and standing["place"] >= 1, standing
        # doctor from the address alone: the coordinator's URL comes from it, and it dials a would-be relay back
        doc = subprocess.run([node_bin, "doctor", address, "--role", "relay", "--gossip-wait", "0", "--json"], cwd=worker_home / "cwd",
                             env=_env(worker_home), check=False, capture_output=True, text=True, timeout=120)
        checks = {c["name"]: c for c in json.loads(doc.stdout)}
        assert checks[f"ingest {coord_url}"]["status"] == "PASS", checks
        assert [checks[n]["status"] for n in ("reachable: HTTP (Shardcast) port", "reachable: libp2p port")] == ["PASS", "PASS"], checks
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        for name in logs:
            print(f"--- {name} (last 30 lines)\n" + "\n".join(log(name).splitlines()[-30:]))

    # what each newcomer holds: only its own node folder, under its fresh HOME
    run_id = re.search(r'run_id = "([0-9a-f]{64})"', spec_text).group(1)
    worker_dir = worker_home / ".local" / "share" / "intellect-node"
    assert (worker_dir / "runs" / run_id / "run.toml").is_file() and (worker_dir / "node.key").is_file()
    assert list((worker_dir / "runs" / run_id / "artifacts").glob("tasks-*/tasks.jsonl")), "the task list came as the run's artifact"
    assert not any((worker_home / "cwd").iterdir()), "nothing written in the working directory"
    relay_dir = relay_home / ".local" / "share" / "intellect-node"
    assert list((relay_dir / "shardcast" / run_id / "artifacts").glob("*.artifact")), "the relay mirrors the task list"
