"""Peers' strings on the operator's terminal (``node/terminal.py``).

Node records are self-signed, so any peer chooses its ``http_url`` (up to 256 characters) and
``version`` (64), and a relay answers ``/held`` with anything. ``intellect-node status`` printed
them through rich (markup such as ``[link=…]`` interpreted, ESC passed through) and ``doctor``
printed a relay's ``run_id`` and listed URL raw: ``\\x1b[8m`` hides every line printed after it
(doctor's own FAIL lines), ``\\x1b]0;…`` sets the window title, OSC 8 makes links. Now they are
printed with control characters escaped and no markup.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_doctor_hostile's spec helper
from localnet import serve_bodies
from test_doctor_hostile import _spec

from node.cli import main
from node.commands.status import _print_table

HIDE = "\x1b[8m"
TITLE = "\x1b]0;owned\x07"


@pytest.mark.timeout(120)
def test_doctor_prints_a_hostile_relays_answer_and_url_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str], held_port) -> None:
    relay_bodies = {"/shardcast/1/held": json.dumps({"run_id": HIDE + TITLE, "held_steps": [3], "steps": [3]}).encode()}
    bodies: dict[str, bytes] = {}
    with serve_bodies(relay_bodies) as relay, serve_bodies(bodies) as coord_url:
        run, run_id = _spec(tmp_path, coord_url, held_port())
        bodies["/status"] = json.dumps({"run_id": run_id, "trainer_step": 3, "latest_policy_step": 3}).encode()
        bodies["/shardcast/1/held"] = json.dumps({"run_id": run_id, "held_steps": [3], "steps": [3]}).encode()
        nodes = [{"role": "relay", "state": "alive", "http_url": u} for u in (relay, f"http://127.0.0.1:1/{HIDE}")]
        bodies["/api/run"] = json.dumps({"nodes": nodes}).encode()
        rc = main(["doctor", "--run", str(run), "--data-dir", str(tmp_path), "--gossip-wait", "0", "--timeout", "3"])
    out = capsys.readouterr().out
    assert rc == 1 and "relays" in out, out
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert "\\x1b[8m" in out  # shown, as its escape


def test_status_table_prints_peers_strings_escaped_and_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    peer = {"peer_id": "12D3KooWtest", "role": "relay", "http_url": f"http://evil/{HIDE}", "policy_step": 1, "held_steps": [1],
            "last_seen_s": 0.5, "version": "[link=http://evil]1.0[/link]" + TITLE}
    _print_table({"run_id": "ab" * 16, "latest_step": 1, "peers": [peer]})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert "[link=http://evil]" in out.replace("\n", "").replace("│", "").replace(" ", ""), out  # markup shown, not followed
