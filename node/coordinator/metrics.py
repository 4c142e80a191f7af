"""What the coordinator records of its run: Prometheus gauges and ``metrics.jsonl``.

* :class:`TrainerGauges` — ``intellect_trainer_*`` gauges in the ingest's registry (one
  ``/metrics``), set after each step and each held-out evaluation.
* :class:`MetricsLog` — ``<data dir>/metrics.jsonl``, one JSON row per event (``run``, ``step``,
  ``eval``, ``end``), each with its ``ts`` (seconds since the epoch); the run page follows it
  (``node/web/runpage.py``) and ``docs/trainer.md`` lists its fields.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Gauge

from trainer.train import StepMetrics

GAUGES: tuple[tuple[str, str], ...] = (
    ("step", "Trainer steps completed (policy step of the current weights)"),
    ("reward_mean", "Mean reward of the last batch"),
    ("pass_rate", "Pass rate (task reward 1) of the last batch"),
    ("loss", "GRPO loss of the last step"),
    ("grad_norm", "Gradient norm of the last step, before clipping"),
    ("clipped_frac", "Fraction of loss tokens clipped in the last step"),
    ("entropy", "Mean policy entropy of the last step, nats"),
    ("tokens_per_s", "Trainer tokens per second in the last step"),
    ("utilization", "Trainer busy time over wall time"),
    ("heldout_pass_rate", "Latest held-out pass rate"),
    ("mismatch_kl", "KL(behavior || trainer) of the last step's sampled tokens (k3 estimate), nats"),
)
"""The ``intellect_trainer_<name>`` gauges and their help texts."""


class TrainerGauges:
    """The trainer's Prometheus gauges in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauges = {name: Gauge(f"intellect_trainer_{name}", doc, registry=registry) for name, doc in GAUGES}

    def step(self, m: StepMetrics, utilization: float) -> None:
        """Set from one trainer step's metrics."""
        for name, value in (("step", m.step), ("reward_mean", m.reward_mean), ("pass_rate", m.pass_rate), ("loss", m.loss),
                            ("grad_norm", m.grad_norm), ("clipped_frac", m.clipped_frac), ("entropy", m.entropy_mean),
                            ("tokens_per_s", m.tokens_per_s), ("utilization", utilization), ("mismatch_kl", m.mismatch_kl)):
            self.gauges[name].set(value)

    def heldout(self, pass_rate: float) -> None:
        """Set the latest held-out pass rate."""
        self.gauges["heldout_pass_rate"].set(pass_rate)


class MetricsLog:
    """Appends rows to ``metrics.jsonl`` (each stamped ``ts``); an ``eval`` row also sets the
    held-out gauge.

    Args:
        path: the file (its directory is created).
        gauges: the gauges an ``eval`` row updates (``None``: none).
    """

    def __init__(self, path: Path, gauges: TrainerGauges | None = None) -> None:
        self.path = Path(path)
        self.gauges = gauges

    def write(self, row: dict[str, Any]) -> None:
        if row.get("event") == "eval" and self.gauges is not None:
            self.gauges.heldout(row["heldout_pass_rate"])
        row = {"ts": round(time.time(), 3), **row}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)
