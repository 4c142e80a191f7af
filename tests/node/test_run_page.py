"""The run page and node pages in a real headless browser against a short devnet, `doctor` against
the same healthy devnet, and the run page's bounds (rate limit, snapshot caps) without a browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from localnet import get_json
from waiting import wait_for

from protocol.messages import NodeRecord

STEPS = 5000
"""Far more than the test needs, so the devnet is still running while the page is checked (an idle
machine trains 20 steps in under 40 s, less than doctor and the node pages take); the fixture stops it."""
START_TIMEOUT_S = 300.0
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


@dataclass
class LiveDevnet:
    out: Path
    url: str
    proc: subprocess.Popen[bytes]

    def status_url(self, name: str) -> str:
        """A worker's or validator's status base URL, from the line its process prints at start."""
        log = (self.out / "logs" / f"{name}.log").read_text(errors="replace")
        m = re.search(r"started; status (http://127\.0\.0\.1:\d+)", log)
        assert m, f"{name} printed no status URL"
        return m.group(1)

    def relay_url(self, name: str) -> str:
        m = re.search(r"serving (http://127\.0\.0\.1:\d+)", (self.out / "logs" / f"{name}.log").read_text(errors="replace"))
        assert m, f"{name} printed no URL"
        return m.group(1)


@pytest.fixture
def devnet(tmp_path) -> Iterator[LiveDevnet]:
    """A devnet (2 workers, 1 reward-inflating adversary, 2 relays, 1 validator) running while the test looks at it.

    Function-scoped: the suite's autouse fixture reaps every child process after each test."""
    out = tmp_path / "out"
    log = open(out.parent / "devnet.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "node", "devnet", "--steps", str(STEPS), "--workers", "2", "--relays", "2",
                             "--validators", "1", "--adversary", "inflated-reward", "--eval-samples", "1", "--no-dashboard", "--out", str(out),
                             "--timeout", "850"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        url = wait_for(lambda: (out / "run.toml").exists() and re.search(r"http://127\.0\.0\.1:\d+", (out / "run.toml").read_text()),
                        60, "the run spec", proc).group(0)
        # every role on gossip and the first trainer step done: the page has something to show
        wait_for(lambda: (get_json(f"{url}/api/run") or {}).get("trainer", {}).get("step", 0) >= 1
                  and len((get_json(f"{url}/api/run") or {}).get("nodes", [])) >= 7, START_TIMEOUT_S, "step 1 and all nodes", proc)
        yield LiveDevnet(out, url, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the devnet stops every child it started
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _browser():
    """A headless Chromium driven by selenium, or a skip naming what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_bin = shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver (scripts/test.sh does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver_bin), options=opts)


def _table_rows(driver, table_id: str) -> list[list[str]]:
    """The table's data rows as text, read in one script call (the page replaces rows as it redraws)."""
    return driver.execute_script(
        "const t = document.getElementById(arguments[0]); if (!t) return [];"
        "return Array.from(t.rows).slice(1).map(r => Array.from(r.cells).map(c => c.textContent));", table_id)


def _text(driver, element_id: str) -> str:
    return driver.execute_script("const e = document.getElementById(arguments[0]); return e ? e.textContent : '';", element_id)


def _severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def _check_run_page(devnet: LiveDevnet, browser) -> None:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{devnet.url}/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.25)

    def roles() -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in _table_rows(browser, "nodes"):
            if len(row) > 2 and (row[0] == "coordinator" or row[2] == "alive"):
                counts[row[0]] = counts.get(row[0], 0) + 1
        return counts

    wait.until(lambda d: (lambda c: c.get("coordinator") == 1 and c.get("worker", 0) >= 2 and c.get("relay") == 2
                          and c.get("validator") == 1)(roles()))
    spec = devnet.out.joinpath("run.toml").read_text()
    coordinator = re.search(r'coordinator = "(12D3KooW\w+)"', spec).group(1)
    assert coordinator in _text(browser, "nodes")
    # the policy step advances on screen without a reload (the page polls /api/run)
    WebDriverWait(browser, 60).until(lambda d: _text(d, "policy-step").isdigit())
    first = int(browser.execute_script("window.__not_reloaded = true; return document.getElementById('policy-step').textContent"))
    WebDriverWait(browser, 600, poll_frequency=0.25).until(lambda d: _text(d, "policy-step").isdigit() and int(_text(d, "policy-step")) > first)
    assert browser.execute_script("return window.__not_reloaded === true")
    # the leaderboard's accepted counts are the coordinator's records: accepted counts only grow, so
    # the page's count lies between /status read just before and just after it
    seen: list[tuple[dict, dict, dict]] = []

    def accepted() -> dict[str, int]:
        status = get_json(f"{devnet.url}/status") or {}
        return {peer: c.get("accepted", 0) for peer, c in (status.get("workers") or {}).items()}

    def board_matches(d) -> bool:
        before = accepted()
        got = {r[1]: int(r[2]) for r in _table_rows(d, "leaderboard") if len(r) > 2}
        after = accepted()
        seen[:] = [(before, got, after)]
        return (bool(before) and set(got) == set(before) == set(after) and sum(before.values()) > 0
                and all(before[p] <= got[p] <= after[p] for p in got))

    try:
        WebDriverWait(browser, 120, poll_frequency=0.2).until(board_matches)
    except TimeoutException:
        raise AssertionError(f"leaderboard never matched /status (devnet alive: {devnet.proc.poll() is None}); last (status before, page, status after): {seen}") from None
    # the adversary's ban, with the rejecting verdict's evidence
    from protocol.identity import NodeKey

    adversary = NodeKey.load(devnet.out / "keys" / "adversary.key").peer_id

    def ban_shown(d) -> bool:
        return any(r[0] == adversary and r[1] == "reward" and "=" in r[5] for r in _table_rows(d, "bans") if len(r) > 5)

    WebDriverWait(browser, 300, poll_frequency=0.25).until(ban_shown)
    board = {r[1]: r for r in _table_rows(browser, "leaderboard")}
    # tokens generated (from the stored submissions) and rollouts trained on are counted for contributors
    assert all(int(r[6]) > 0 for r in board.values() if int(r[2]) > 0), board
    assert any(int(r[5]) > 0 for r in board.values()), board
    assert board[adversary][8].startswith("banned") and board[adversary][7] == "0.00"
    assert browser.execute_script("return document.querySelectorAll('#chart-reward svg path').length") > 0
    assert _table_rows(browser, "propagation"), "no propagation rows"
    assert _severe(browser) == [], _severe(browser)


def _check_node_pages(devnet: LiveDevnet, browser) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    for name, url in (("worker-0", devnet.status_url("worker-0")), ("validator-0", devnet.status_url("validator-0")),
                      ("relay-0", devnet.relay_url("relay-0"))):
        browser.get(f"{url}/")
        role = name.split("-")[0]
        WebDriverWait(browser, 30, poll_frequency=0.25).until(lambda d: _text(d, "role") == role)
        status = get_json(f"{url}/status")
        assert _text(browser, "peer-id") == status["peer_id"]
        assert _text(browser, "state") not in ("", "connecting…")
        if role == "worker":
            WebDriverWait(browser, 30).until(lambda d: _text(d, "policy-step").isdigit())
            assert "tokens_per_s" in _text(browser, "throughput")
        assert _text(browser, "errors"), "the last-errors table is empty"  # "none" or the records
        assert _severe(browser) == [], (name, _severe(browser))


def _check_doctor(devnet: LiveDevnet, tmp_path: Path) -> None:
    run = devnet.out / "run.toml"
    for role in ("worker", "relay", "validate"):
        r = subprocess.run([sys.executable, "-m", "node", "doctor", "--run", str(run), "--role", role, "--json", "--data-dir", str(tmp_path),
                            "--gossip-wait", "30"],
                           capture_output=True, text=True, timeout=120)
        checks = json.loads(r.stdout)
        assert r.returncode == 0, checks
        assert all(c["status"] == "PASS" for c in checks), [c for c in checks if c["status"] != "PASS"]
        names = " ".join(c["name"] for c in checks)
        for want in ("run spec signature", "ingest", "bootstrap", "gossip", "origin", "relays", "clock offset", "free disk", "memory"):
            assert want in names
    # the devnet's workers ran it at start and logged it
    assert "doctor (worker):" in (devnet.out / "logs" / "worker-0.log").read_text(errors="replace")


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_live_devnet_doctor_node_pages_and_run_page(devnet, tmp_path):
    """One devnet for all three (it is the expensive part): doctor all PASS, then the node pages and
    the run page in headless Chromium (skipped with the reason when no browser is installed)."""
    _check_doctor(devnet, tmp_path)
    browser = _browser()
    try:
        _check_node_pages(devnet, browser)
        _check_run_page(devnet, browser)
    finally:
        browser.quit()


# --- without a browser -----------------------------------------------------------------------


def test_propagation_rows_from_records():
    from node.web.runpage import Propagation

    now = [100.0]
    prop = Propagation(clock=lambda: now[0])
    relay, worker = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44
    prop.note_published(0, 0.5)
    now[0] = 100.4
    prop.note_record(NodeRecord(peer_id=relay, role="relay", seq=1, version="t", held_steps=[0, 1]))  # step 1 before its announcement
    now[0] = 101.0
    prop.note_record(NodeRecord(peer_id=worker, role="worker", seq=1, version="t", policy_step=0))
    prop.note_published(1, 0.2)
    rows = {r["step"]: r for r in prop.rows()}
    assert rows[0]["publish_s"] == 0.5 and rows[0]["relays_first_s"] == pytest.approx(0.4) and rows[0]["workers_all_s"] == pytest.approx(1.0)
    assert rows[1]["relays_holding"] == 1 and rows[1]["relays_first_s"] == 0.0  # held before the announcement: 0 s
    for step in range(2, 200):
        prop.note_published(step, 0.1)
    assert len(prop.rows()) == prop.max_steps  # bounded


async def test_api_is_bounded_and_rate_limited(tmp_path):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from node.devnet.config import devnet_spec
    from node.web.runpage import CAPS, RunPage
    from protocol.identity import NodeKey
    from protocol.runspec import sign_run_spec
    from trainer.ledger import BanBook, SubmissionLedger

    key = NodeKey.generate()
    signed = sign_run_spec(devnet_spec(key, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=3), key)
    ledger = SubmissionLedger(tmp_path / "ingest", signed.spec, BanBook(tmp_path / "bans.msgpack", key, signed.run_id),
                              trainer_step=lambda: 2000, latest_policy_step=lambda: 2000)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"event": "step", "step": i, "reward_mean": 0.5, "pass_rate": 0.25,
                                           "verdicts": {"ok": i}}) + "\n" for i in range(1, 2000))
                       # an unchecked submission's huge reward made the last mean overflow (json writes Infinity)
                       + json.dumps({"event": "step", "step": 2000, "reward_mean": float("inf"), "pass_rate": float("nan")}) + "\n"
                       + '{"event": "st')
    page = RunPage(signed, ledger, status=lambda: {"trainer_step": 2000, "published_step": 2000, "state": "training"},
                   metrics_path=metrics, peer_id=key.peer_id)
    app = web.Application()
    page.add_routes(app)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/api/run")
        assert r.status == 200
        def strict(c: str) -> None:
            raise AssertionError(f"{c} in the snapshot: browsers cannot parse it")

        doc = json.loads(await r.text(), parse_constant=strict)
        assert doc["curves"]["steps"][-1]["reward_mean"] is None and doc["curves"]["steps"][-1]["pass_rate"] is None
        assert len(doc["curves"]["steps"]) <= CAPS["curve_points"] + 1 and doc["curves"]["steps"][-1]["step"] == 2000
        assert doc["nodes"][0]["role"] == "coordinator" and doc["trainer"]["published_step"] == 2000
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
        html = await client.get("/")
        assert html.status == 200 and "/web/run.js" in await html.text()
        assert (await client.get("/web/..%2fassets.py")).status == 404
        codes = [(await client.get("/api/run")).status for _ in range(150)]
        assert 429 in codes  # one address cannot poll faster than the limit
    ledger.close()


async def test_node_page_and_last_errors(tmp_path):
    import logging

    from aiohttp import ClientSession
    from prometheus_client import CollectorRegistry

    from node.status_http import StatusServer

    server = StatusServer(lambda: {"role": "worker", "state": "waiting for the first policy announcement"}, CollectorRegistry())
    await server.start()
    try:
        logging.getLogger("node.test").warning("cannot fetch step %d", 7)
        async with ClientSession() as s:
            async with s.get(f"{server.url}/") as r:
                assert r.status == 200 and "/web/node.js" in await r.text()
            async with s.get(f"{server.url}/web/node.js") as r:
                assert r.status == 200 and r.content_type == "text/javascript"
            async with s.get(f"{server.url}/status") as r:
                doc = await r.json()
        assert doc["state"].startswith("waiting") and doc["last_errors"][-1]["message"] == "cannot fetch step 7"
    finally:
        await server.stop()
    assert server.errors not in logging.getLogger().handlers  # detached on stop
