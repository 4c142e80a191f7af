"""benchmarks/async_levels.py, shortened: levels 0 and 2 (the benchmark runs 0, 1, 2, 4) each run
a devnet of two steps, both at once to keep the suite's time down, and report their metrics; the
last line has the format the docs quote."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_every_level_completes_and_reports(tmp_path: Path) -> None:
    keep = tmp_path / "runs"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "async_levels.py"), "--levels", "0,2", "--seeds", "1", "--steps", "2",
         "--workers", "1", "--relays", "0", "--eval-samples", "1", "--jobs", "2", "--corrections", "truncate",
         "--timeout", "600", "--keep", str(keep), "--plot", str(tmp_path / "curves.png")],
        capture_output=True, text=True, timeout=840, cwd=ROOT, check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {x["level"]: x for x in json.loads((keep / "results.json").read_text())}
    assert sorted(results) == [0, 2]
    for level, x in results.items():
        assert x["ok"] and x["steps"] == 2, (level, x["tail"])
        assert x["gain"] is not None and len(x["curve"]) == 3  # held-out at 0, 1, 2
        assert x["s_per_step"] > 0 and 0 < x["utilization"] <= 1
        assert 0 <= x["staleness_mean"] <= level and x["mismatch_kl"] >= 0
        assert x["is_ratio_min"] <= x["is_ratio_mean"] <= x["is_ratio_max"] and x["is_weight_max"] <= 2.0
        # the correction reached the run spec
        assert re.search(r'is_correction = "truncate"', (keep / f"truncate-L{level}-s1" / "run.toml").read_text())
    # level 0 trains only on rollouts of the trainer's current weights
    assert results[0]["staleness_mean"] == 0 and results[0]["mismatch_kl"] < 1e-4
    rows = [line for line in r.stdout.splitlines() if re.match(r"\s+[0124] truncate\s+1 ", line)]
    assert len(rows) == 2, r.stdout
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"async levels: 0 → [+-]\d\.\d{3}, 2 → [+-]\d\.\d{3} "
                        r"\(median held-out gain over 1 seeds\)", last), last
