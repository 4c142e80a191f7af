"""A live devnet looked at from outside: its run page and node pages in a real headless browser
(selenium and Chromium) and ``intellect-node doctor`` against it. Used by ``test_devnet.py`` (the
shared live devnet) and ``test_run_page_layout.py`` (:func:`browser`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from localnet import get_json

CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def final_accepted(out: Path) -> dict[str, int]:
    """Accepted submissions per worker peer ID on the coordinator's final run page
    (``coordinator/run-page/snapshot.js``, written when it stops); ``{}`` when it is not there yet."""
    try:
        text = (out / "coordinator" / "run-page" / "snapshot.js").read_text()
        doc = json.loads(text[text.index("{") : text.rindex("}") + 1])
    except (OSError, ValueError):
        return {}
    return {r["peer_id"]: int(r["accepted"]) for r in doc.get("leaderboard") or [] if isinstance(r, dict) and "peer_id" in r and "accepted" in r}


@dataclass
class LiveDevnet:
    """A running devnet: its folder, its run page's URL and its process."""

    out: Path
    url: str
    proc: subprocess.Popen[bytes]

    def status_url(self, name: str) -> str:
        """A worker's or validator's status base URL, from the line its process prints at start (the
        latest: a restarted worker binds another port)."""
        log = (self.out / "logs" / f"{name}.log").read_text(errors="replace")
        found = re.findall(r"started; status (http://127\.0\.0\.1:\d+)", log)
        assert found, f"{name} printed no status URL"
        return found[-1]

    def relay_url(self, name: str) -> str:
        m = re.search(r"serving (http://127\.0\.0\.1:\d+)", (self.out / "logs" / f"{name}.log").read_text(errors="replace"))
        assert m, f"{name} printed no URL"
        return m.group(1)


def start_browser():
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


def table_rows(driver, table_id: str) -> list[list[str]]:
    """The table's data rows as text, read in one script call (the page replaces rows as it redraws)."""
    return driver.execute_script(
        "const t = document.getElementById(arguments[0]); if (!t) return [];"
        "return Array.from(t.rows).slice(1).map(r => Array.from(r.cells).map(c => c.textContent));", table_id)


def text(driver, element_id: str) -> str:
    return driver.execute_script("const e = document.getElementById(arguments[0]); return e ? e.textContent : '';", element_id)


def severe(driver, devnet: LiveDevnet | None = None) -> list[dict]:
    """The browser's SEVERE console entries (read once: the driver drains its log). With ``devnet``
    that has ended (a fast machine finished its steps under the check), the page's failed polls of
    the stopped coordinator are left out: the page catches them and shows them, they are no page error."""
    entries = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    if devnet is not None and devnet.proc.poll() is not None:
        entries = [e for e in entries if not (devnet.url in str(e.get("message", "")) and "net::ERR_CONNECTION_REFUSED" in str(e.get("message", "")))]
    return entries


def check_run_page(devnet: LiveDevnet, browser) -> None:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    def accepted() -> dict[str, int]:
        status = get_json(f"{devnet.url}/status") or {}
        return {peer: c.get("accepted", 0) for peer, c in (status.get("workers") or {}).items()}

    # accepted counts only grow: every count the page shows after loading lies between this read
    # (before the page existed) and a /status read just after the page's
    floor = accepted()
    browser.get(f"{devnet.url}/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.25)

    def roles() -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in table_rows(browser, "nodes"):
            if len(row) > 2 and (row[0] == "coordinator" or row[2] == "alive"):
                counts[row[0]] = counts.get(row[0], 0) + 1
        return counts

    def all_roles(_d) -> bool:
        c = roles()
        return c.get("coordinator") == 1 and c.get("worker", 0) >= 2 and c.get("relay") == 2 and c.get("validator") == 1

    wait.until(all_roles)
    spec = devnet.out.joinpath("run.toml").read_text()
    coordinator = re.search(r'coordinator = "(12D3KooW\w+)"', spec).group(1)
    assert coordinator in text(browser, "nodes")
    # the policy step advances on screen without a reload (the page polls /api/run)
    WebDriverWait(browser, 60).until(lambda d: text(d, "policy-step").isdigit())
    first = int(browser.execute_script("window.__not_reloaded = true; return document.getElementById('policy-step').textContent"))

    def advanced(d) -> bool:
        return text(d, "policy-step").isdigit() and int(text(d, "policy-step")) > first

    WebDriverWait(browser, 600, poll_frequency=0.25).until(lambda d: advanced(d) or devnet.proc.poll() is not None)
    assert advanced(browser), f"the run ended at policy step {first} on the page before the page showed another"
    assert browser.execute_script("return window.__not_reloaded === true")
    # the leaderboard's accepted counts are the coordinator's records: they lie between /status read
    # before the page loaded and /status read just after the page is read. (Not "just before": the page
    # shows its last poll, up to a poll interval old, so while workers submit every second it lags a
    # read taken just before it and that window rarely closes until the run ends.)
    seen: list[tuple[dict, dict, dict]] = []

    def board_matches(d) -> bool:
        got = {r[1]: int(r[2]) for r in table_rows(d, "leaderboard") if len(r) > 2}
        after = accepted() if devnet.proc.poll() is None else final_accepted(devnet.out)
        seen[:] = [(floor, got, after)]
        return (bool(after) and set(got) == set(after) and sum(got.values()) > 0
                and all(floor.get(p, 0) <= got[p] <= after[p] for p in got))

    try:
        WebDriverWait(browser, 120, poll_frequency=0.2).until(board_matches)
    except TimeoutException:
        raise AssertionError(f"leaderboard never matched /status (devnet alive: {devnet.proc.poll() is None}); last (status before, page, status after): {seen}") from None
    # the adversary's ban, with the rejecting verdict's evidence
    from protocol.identity import NodeKey

    adversary = NodeKey.load(devnet.out / "keys" / "adversary.key").peer_id

    def ban_shown(d) -> bool:
        return any(r[0] == adversary and r[1] == "reward" and "=" in r[5] for r in table_rows(d, "bans") if len(r) > 5)

    WebDriverWait(browser, 300, poll_frequency=0.25).until(ban_shown)
    board = {r[1]: r for r in table_rows(browser, "leaderboard")}
    # tokens generated (from the stored submissions) and rollouts trained on are counted for contributors
    assert all(int(r[6]) > 0 for r in board.values() if int(r[2]) > 0), board
    assert any(int(r[5]) > 0 for r in board.values()), board
    assert board[adversary][8].startswith("banned") and board[adversary][7] == "0.00"
    assert browser.execute_script("return document.querySelectorAll('#chart-reward svg path').length") > 0
    assert table_rows(browser, "propagation"), "no propagation rows"
    errors = severe(browser, devnet)
    assert errors == [], errors


def check_node_pages(devnet: LiveDevnet, browser) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    for name, url in (("worker-0", devnet.status_url("worker-0")), ("validator-0", devnet.status_url("validator-0")),
                      ("relay-0", devnet.relay_url("relay-0"))):
        browser.get(f"{url}/")
        role = name.split("-")[0]
        WebDriverWait(browser, 30, poll_frequency=0.25).until(lambda d, role=role: text(d, "role") == role)
        status = get_json(f"{url}/status")
        assert text(browser, "peer-id") == status["peer_id"]
        assert text(browser, "state") not in ("", "connecting…")
        if role == "worker":
            WebDriverWait(browser, 30).until(lambda d: text(d, "policy-step").isdigit())
            assert "tokens_per_s" in text(browser, "throughput")
        assert text(browser, "errors"), "the last-errors table is empty"  # "none" or the records
        errors = severe(browser)
        assert errors == [], (name, errors)


def check_doctor(devnet: LiveDevnet, tmp_path: Path) -> None:
    """``doctor --role worker|relay|validate --json`` against the live run, the three at once (each its
    own data directory): every check PASS, the checks of a joining node all there. ``--gossip-wait 90``
    gives doctor a 115 s budget (the gossip check ends as soon as it hears the coordinator): with 30 s
    (55 s budget) a loaded machine spent it before the last check, which doctor then reports as
    ``WARN not checked`` — right for doctor, a failure here (suite at load ≈ 8, 7 Dec 2026)."""
    run = devnet.out / "run.toml"
    roles = ("worker", "relay", "validate")
    running = {role: subprocess.Popen([sys.executable, "-m", "node", "doctor", "--run", str(run), "--role", role, "--json",
                                       "--data-dir", str(tmp_path / role), "--gossip-wait", "90"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in roles}
    try:
        for role in roles:
            out, err = running[role].communicate(timeout=240)
            checks = json.loads(out)
            assert running[role].returncode == 0, (role, checks, err[-2000:])
            assert all(c["status"] == "PASS" for c in checks), [c for c in checks if c["status"] != "PASS"]
            names = " ".join(c["name"] for c in checks)
            for want in ("run spec signature", "ingest", "bootstrap", "gossip", "origin", "relays", "clock offset", "free disk", "memory"):
                assert want in names
    finally:
        for p in running.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    # the devnet's workers ran it at start and logged it
    assert "doctor (worker):" in (devnet.out / "logs" / "worker-0.log").read_text(errors="replace")
