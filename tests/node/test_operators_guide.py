"""The operator's guide, run as written: docs/operators.md's marked command blocks on 127.0.0.1.

Blocks are found by the HTML comment before them (``<!-- guide-test: KIND [NAME] -->``):
``settings`` (shell variables: every one is given a local value here), ``once`` (run in order,
each to completion), ``serve NAME`` (a long-running node, started in its own process group) and
``watch`` (run once the run has trained). The only edits are the settings' values and the
validator's peer ID, which the guide says to paste. The model is a locally built HF-layout Qwen2
(``local_model.py``: bf16 safetensors, 32,768-token BPE, chat template), the task set
``gsm8k_train`` from the shared data. The run must train ≥ 2 steps, publish them, a relay must
hold a step ≥ 1, and the worker must fetch a step ≥ 1 and submit rollouts generated with it.

Stage times (model load, first publish, first accepted submission, per step) are printed and
written to ``guide-timings.json`` in the test's directory; they are not asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_model import build_local_model
from localnet import get_json

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operators.md"
BLOCK = re.compile(r"<!-- guide-test: (\w+)(?: (\w+))? -->\s*```bash\n(.*?)```", re.S)
ASSIGN = re.compile(r"\b([A-Z][A-Z0-9_]*)=(\S+)")
RUN_TIMEOUT_S = 600.0
"""Longest time the whole run may take to reach its checks (the 2-core machine is shared)."""


def guide_blocks() -> list[tuple[str, str, str]]:
    """``(kind, name, text)`` of every marked block, in document order."""
    return [(m.group(1), m.group(2) or "", m.group(3)) for m in BLOCK.finditer(GUIDE.read_text())]


def json_values(text: str) -> list:
    """Every JSON value printed one after another in ``text`` (curl prints no newline after one)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        start = text.find("{", i)
        if start < 0:
            return out
        value, i = dec.raw_decode(text, start)
        out.append(value)


def with_values(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``NAME=value`` whose NAME is in ``values`` given that value."""
    return ASSIGN.sub(lambda m: f"{m.group(1)}={values[m.group(1)]}" if m.group(1) in values else m.group(0), text)


def test_guide_blocks_are_found_and_complete():
    kinds = [(k, n) for k, n, _ in guide_blocks()]
    assert kinds == [("settings", ""), ("once", ""), ("once", ""), ("serve", "coordinator"), ("serve", "relay"),
                     ("serve", "worker"), ("serve", "validator"), ("watch", "")]
    text = "\n".join(t for _, _, t in guide_blocks())
    for flag in ("--data-root", "--model-base", "--public-url"):
        assert flag in text
    for _, name, t in guide_blocks():
        if name == "coordinator":
            assert '--data-root "$DATA_ROOT"' in t, "the coordinator needs the task files"
        if name in ("relay", "worker", "validator"):  # contributors start from the run address alone (issue 35)
            assert '"$RUN_ADDRESS"' in t and "--data-root" not in t and "--run" not in t, name
    torchrun = re.search(r"torchrun [^\n]*-m node\.train_cli -- --run", GUIDE.read_text())
    assert torchrun, "torchrun needs '--' between the module and its arguments"


def test_operators_guide_end_to_end(tmp_path, shared, held_port):
    data_root = shared / "data"
    t0 = time.monotonic()
    model = build_local_model(tmp_path / "my-qwen2", data_root)
    timings: dict[str, float] = {"build_model_s": round(time.monotonic() - t0, 1)}
    blocks = guide_blocks()
    settings = blocks[0][2]
    ports = {name: str(held_port()) for name in ("COORD_HTTP", "COORD_P2P", "RELAY_HTTP", "RELAY_P2P", "WORKER_HTTP", "VAL_HTTP")}
    values = {"COORD_HOST": "127.0.0.1", "RELAY_HOST": "127.0.0.1", "LISTEN": "127.0.0.1", "DATA_ROOT": str(data_root),
              "MODEL": str(model), "DEVICE": "cpu", "MAX_TOKENS": "16", "EVAL_SAMPLES": "1",
              "RUN_ADDRESS": "unknown-until-spec-init", **ports}
    names = {m.group(1) for m in ASSIGN.finditer(settings)}
    assert names == set(values), f"settings the test does not set: {names - set(values)}"
    prelude = with_values(settings, values)
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "intellect-node").exists() and (bin_dir / "intellect-train").exists(), "pip install -e . first"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    work = tmp_path / "work"
    work.mkdir()

    def bash(text: str, **kw):  # noqa: ANN003, ANN202
        return subprocess.run(["bash", "-euo", "pipefail", "-c", prelude + "\n" + text], cwd=work, env=env, capture_output=True,
                              text=True, **kw)

    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    try:
        for kind, name, text in blocks[1:]:
            if kind == "once":
                if "VALIDATOR_ID=" in text:  # the guide says to paste the validator's peer ID here
                    text = with_values(text, {"VALIDATOR_ID": (work / "val.id").read_text().strip()})
                r = bash(text, timeout=300)
                assert r.returncode == 0, f"guide block failed:\n{text}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
                if "keygen --key val.key" in text:
                    (work / "val.id").write_text(r.stdout.split()[0])
                if "spec init" in text:
                    assert "bfloat16" in r.stdout and "base_hash" in r.stdout, r.stdout
                    # the guide says to hand contributors the address it printed: paste it, as a contributor would
                    values["RUN_ADDRESS"] = re.search(r"^(intellect1:\S+)$", r.stdout, re.MULTILINE).group(1)
                    prelude = with_values(settings, values)
            elif kind == "serve":
                logs[name] = work / f"{name}.log"
                with open(logs[name], "w") as log:
                    procs[name] = subprocess.Popen(["bash", "-euo", "pipefail", "-c", prelude + "\nexec " + text.strip()], cwd=work,
                                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                if name == "coordinator":
                    started = time.monotonic()
        coord = f"http://127.0.0.1:{ports['COORD_HTTP']}"
        relay = f"http://127.0.0.1:{ports['RELAY_HTTP']}"

        def log_text(name: str) -> str:
            return logs[name].read_text(errors="replace")

        def alive_or_fail() -> None:
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited ({p.returncode}):\n{log_text(name)[-4000:]}"

        worker = f"http://127.0.0.1:{ports['WORKER_HTTP']}"
        status: dict = {}
        relay_status: dict = {}
        worker_status: dict = {}
        submitted_before_step1: int | None = None
        wait_reasons: list[str] = []
        events: dict[str, float] = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            alive_or_fail()
            status = get_json(f"{coord}/status") or status
            now = time.monotonic() - started
            if status.get("wait_reason"):
                wait_reasons.append(status["wait_reason"])
            if status:
                events.setdefault("coordinator_serving_s", now)  # imports, base hashed and loaded, trainer built
                for key, prefix in (("probe_started_s", "probing"), ("eval_started_s", "evaluating the initial"),
                                    ("training_ready_s", "waiting for a batch")):
                    if str(status.get("state", "")).startswith(prefix):
                        events.setdefault(key, now)
            if status.get("latest_policy_step", -1) >= 0:
                events.setdefault("first_publish_s", now)
            if status.get("submissions", {}).get("accepted", 0):
                events.setdefault("first_accepted_s", now)
            for k in (1, 2, 3):
                if status.get("trainer_step", 0) >= k:
                    events.setdefault(f"step_{k}_s", now)
            relay_status = get_json(f"{relay}/status") or relay_status
            worker_status = get_json(f"{worker}/status") or worker_status
            if worker_status.get("policy_step", -1) >= 1 and submitted_before_step1 is None:
                submitted_before_step1 = worker_status["submissions"]  # every later submission is generated with step ≥ 1
            used_trained_step = submitted_before_step1 is not None and worker_status.get("acked", 0) > submitted_before_step1
            if (status.get("trainer_step", 0) >= 2 and status.get("latest_policy_step", -1) >= 2
                    and max(relay_status.get("held_steps") or [-1]) >= 1 and used_trained_step
                    # a step the relay is late to hold is fetched from the origin (relays first only once they hold
                    # it): on a loaded machine that can be every step so far, so wait for one the relay served
                    and relay_status.get("pieces_served", 0) > 0):
                break
            assert time.monotonic() < deadline, (
                f"run did not reach 2 trained steps used by the worker, with pieces served by the relay, in {RUN_TIMEOUT_S:.0f} s: "
                f"status {json.dumps(status)[:3000]}\n"
                f"relay {relay_status}\nworker {worker_status}\ncoordinator log:\n{log_text('coordinator')[-3000:]}")
            time.sleep(1.0)
        # the relay fetched a trained step and served pieces; the worker generated with a trained step, acknowledged
        assert relay_status["role"] == "relay" and relay_status["latest_step"] >= 1 and relay_status["pieces_served"] > 0
        assert worker_status["refused"] == {}, worker_status  # an honest worker: nothing refused, not banned
        assert status["verdicts_by_reason"].get("ok", 0) > 0 and set(status["verdicts_by_reason"]) == {"ok"}, status["verdicts_by_reason"]
        assert status["signal_probe"] is not None and status["signal_probe"]["groups"] > 0 and status["warnings"] == []
        assert any("usable groups" in r for r in wait_reasons), wait_reasons[:3]  # while waiting, /status said why
        # the published checkpoint kept the base's format
        step_dir = work / "coord-data" / "policies" / "step-1"
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            assert (step_dir / f).read_bytes() == (model / f).read_bytes(), f
        assert json.loads((step_dir / "config.json").read_text())["dtype"] == "bfloat16"
        assert (step_dir / "model.safetensors").stat().st_size == (model / "model.safetensors").stat().st_size
        # watching: the guide's commands answer
        r = bash(blocks[-1][2], timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        coord_doc, relay_doc, report = json_values(r.stdout)
        assert coord_doc["trainer_step"] >= 2 and relay_doc["role"] == "relay", r.stdout[:2000]
        assert report["latest_step"] is not None and report["latest_step"] >= 2
        assert {p["role"] for p in report["peers"]} >= {"coordinator", "relay", "worker", "validator"}
        timings.update({k: round(v, 1) for k, v in events.items()})
        steps = [events.get(f"step_{k}_s") for k in (1, 2)]
        if all(steps):
            timings["step_2_minus_step_1_s"] = round(steps[1] - steps[0], 1)
        (tmp_path / "guide-timings.json").write_text(json.dumps(timings, indent=1))
        print("guide timings (s, from coordinator start):", json.dumps(timings))
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for name, p in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
