"""The run page's layout in headless Chromium at 1280 and 1920 px: no card scrolls sideways (the Run
card's values were cut off behind a scrollbar), every curve visible where values coincide (batch
reward = pass rate without a length penalty), axis titles, integer verdict counts, the last x tick
inside the chart; and the static copy the coordinator writes at stop opens without a server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_checks import start_browser

from node.devnet.config import devnet_spec
from node.web.runpage import RunPage, write_archive
from protocol.identity import NodeKey
from protocol.runspec import sign_run_spec
from trainer.ledger import BanBook, SubmissionLedger

pytestmark = pytest.mark.integration

WIDTHS = (1280, 1400, 1600, 1920)
"""Window widths checked (the issue saw the Run card clipped at 1400 px)."""


def _metrics(path: Path) -> None:
    """A 60-step embedded run: reward equals the pass rate (no length penalty), verdict counts into the hundreds."""
    rows = []
    for i in range(1, 61):
        rate = round(0.3 + 0.4 * i / 60, 4)
        rows.append({"event": "step", "step": i, "reward_mean": rate, "pass_rate": rate, "loss": 0.01, "tokens_per_s": 900.0,
                     "broadcast_s": 0.2, "wall_s": 2.0 * i, "verdicts": {"ok": 4 * i + 1, "stale_policy": i // 6}})
    for step in (0, 10, 20, 30, 40, 50, 60):
        p = round(0.25 + 0.007 * step, 4)
        rows.append({"event": "eval", "step": step, "heldout_pass_rate": p, "heldout_ci_low": p - 0.04, "heldout_ci_high": p + 0.04})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _nodes() -> list[dict]:
    rows = []
    for i, role in enumerate(["relay", "relay", "validator", "worker", "worker"]):
        rows.append({"peer_id": NodeKey.generate().peer_id, "role": role, "state": "alive", "policy_step": 58 if role == "worker" else -1,
                     "held_steps": [57, 58, 59, 60] if role == "relay" else [], "last_seen_s": 0.4,
                     "http_url": f"http://127.0.0.1:{40000 + i}" if role == "relay" else "", "version": "0.1.0"})
    return rows


@pytest.fixture
def page_url(tmp_path) -> Iterator[tuple[str, RunPage]]:
    """A run page with a finished run's metrics, served on 127.0.0.1 from a thread."""
    from aiohttp import web

    key = NodeKey.generate()
    signed = sign_run_spec(devnet_spec(key, [NodeKey.generate().peer_id], tasks="embedded", http_url="http://127.0.0.1:1",
                                       bootstrap="", seed=3), key)
    store = SubmissionLedger(tmp_path / "ingest", signed.spec, BanBook(tmp_path / "bans.msgpack", key, signed.run_id),
                             trainer_step=lambda: 60, latest_policy_step=lambda: 60)
    _metrics(tmp_path / "metrics.jsonl")
    page = RunPage(signed, store, status=lambda: {"trainer_step": 60, "published_step": 60, "state": "done"},
                   metrics_path=tmp_path / "metrics.jsonl", peer_id=key.peer_id, url="http://127.0.0.1:8000")
    page._nodes = _nodes  # what gossip would have shown
    for step in range(61):
        page.propagation.note_published(step, 0.2 + 0.001 * step)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        app = web.Application()
        page.add_routes(app)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"] = site._server.sockets[0].getsockname()[1]
        holder["runner"] = runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        yield f"http://127.0.0.1:{holder['port']}", page
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(timeout=10)
        store.close()


LAYOUT = """
const out = {overflow: [], charts: {}};
for (const s of document.querySelectorAll('main section')) {
  // wider content, or a horizontal scrollbar (a fraction of a pixel too wide shows one: offsetHeight counts it, clientHeight not)
  const bar = s.offsetHeight - s.clientHeight - 2 * parseFloat(getComputedStyle(s).borderTopWidth);
  if (s.scrollWidth > s.clientWidth || bar > 0.5) out.overflow.push([s.querySelector('h2').textContent, s.scrollWidth, s.clientWidth, bar]);
}
for (const id of ['chart-reward', 'chart-verdicts', 'chart-propagation']) {
  const svgEl = document.querySelector('#' + id + ' svg');
  if (!svgEl) { out.charts[id] = null; continue; }
  const box = svgEl.getBoundingClientRect();
  const texts = Array.from(svgEl.querySelectorAll('text'));
  out.charts[id] = {
    titles: texts.filter((t) => t.classList.contains('axis-title')).map((t) => t.textContent),
    labels: texts.filter((t) => !t.classList.contains('axis-title')).map((t) => t.textContent),
    outside: texts.filter((t) => { const b = t.getBoundingClientRect(); return b.left < box.left - 0.5 || b.right > box.right + 0.5
                                                                               || b.top < box.top - 0.5 || b.bottom > box.bottom + 0.5; })
                  .map((t) => t.textContent),
    paths: Array.from(svgEl.querySelectorAll('path')).map((p) => [p.getAttribute('stroke'), p.getAttribute('stroke-width'),
                                                                 p.getAttribute('stroke-dasharray') || '', p.getAttribute('d')]),
  };
}
return out;
"""


def _layout(browser, url: str, width: int) -> dict:
    """Load ``url`` afresh at ``width`` px (a scrollbar a resize leaves behind, or one a fresh load
    adds, differ: the page is checked as a reader opens it) and measure it."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.set_window_size(width, 1100)
    browser.get(url)
    WebDriverWait(browser, 30, poll_frequency=0.2).until(
        lambda d: d.execute_script("return document.querySelectorAll('#chart-verdicts svg path').length") >= 2
        and d.execute_script("return document.getElementById('spec').rows.length") > 3)
    return browser.execute_script(LAYOUT)


def _check(layout: dict, width: int) -> None:
    assert layout["overflow"] == [], (width, layout["overflow"])  # no card scrolls sideways: nothing is clipped
    reward = layout["charts"]["chart-reward"]
    by_d: dict[str, list] = {}
    for stroke, w, dash, d in reward["paths"]:
        by_d.setdefault(d, []).append((stroke, w, dash))
    # reward and pass rate coincide point for point: the two lines differ in colour, width and dash
    same = [styles for styles in by_d.values() if len(styles) > 1]
    assert same and all(len(set(styles)) == len(styles) for styles in same), same
    assert all(len({w for _, w, _ in styles}) > 1 or len({dash for _, _, dash in styles}) > 1 for styles in same), same
    for chart in layout["charts"].values():
        assert chart is not None and len(chart["titles"]) == 2, chart  # an x and a y title
        assert chart["outside"] == [], (width, chart["outside"])  # every label, the last x tick too, inside the chart
    verdicts = layout["charts"]["chart-verdicts"]["labels"]
    assert all("." not in v for v in verdicts), verdicts  # counts are integers ("241", never "241.00")
    assert "241" in verdicts  # the largest count, 4 × 60 + 1


def test_run_page_layout_at_1280_and_1920_px(page_url, tmp_path):
    url, page = page_url
    browser = start_browser()
    try:
        for width in WIDTHS:
            _check(_layout(browser, f"{url}/", width), width)
        # the static copy of the final state (what the coordinator writes at stop) draws the same, from disk
        snapshot = page.build(_nodes())
        index = write_archive(tmp_path / "run-page", snapshot)
        for width in WIDTHS:
            _check(_layout(browser, index.as_uri(), width), width)
        assert "final state" in browser.execute_script("return document.getElementById('updated').textContent")
        assert browser.execute_script("return document.getElementById('trainer-step').textContent") == "60"
    finally:
        browser.quit()
