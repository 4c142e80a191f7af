"""The one log line a node writes when it comes to hold a policy step, and its parser.

Workers and validators (``node.policy.PolicyFollower``) and relays (``node.shardcast.relay``)
write it at INFO when a step's verified files are complete; ``intellect-node devnet`` reads it
from their logs to time how long each step took to reach every node (``node/devnet/timeline.py``)::

    holds policy step 3 via delta: 20154113 bytes in 6.214 s (apply 2.903 s) at 1764789012.345

``via`` is ``delta`` (applied to an earlier step held here) or ``full`` (every piece fetched);
bytes are those received for it; ``in``: from the start of the fetch; ``apply``: of which rebuilding
the files from base + delta (0 for a full fetch, whose hashing runs as pieces arrive); ``at``:
wall clock (Unix seconds) when the step was held.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

HELD_LINE = re.compile(r"holds policy step (\d+) via (delta|full): (\d+) bytes in ([0-9.]+) s \(apply ([0-9.]+) s\) at ([0-9.]+)")


@dataclass(frozen=True)
class HeldEvent:
    """One parsed hold line (fields as in the module docstring; times in seconds)."""

    step: int
    via: str
    bytes: int
    elapsed_s: float
    apply_s: float
    at: float


def log_held(log: logging.Logger, step: int, via: str, nbytes: int, elapsed_s: float, apply_s: float) -> None:
    """Write the hold line for ``step`` now (INFO, with ``step`` as a structured field)."""
    log.info("holds policy step %d via %s: %d bytes in %.3f s (apply %.3f s) at %.3f", step, via, nbytes, elapsed_s, apply_s, time.time(),
             extra={"step": step})


def parse_held(line: str) -> HeldEvent | None:
    """The :class:`HeldEvent` of a log line, or ``None`` if it is no hold line."""
    m = HELD_LINE.search(line)
    if m is None:
        return None
    return HeldEvent(int(m[1]), m[2], int(m[3]), float(m[4]), float(m[5]), float(m[6]))
