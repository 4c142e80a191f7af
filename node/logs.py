"""Logging set-up: quiet by default, optional JSON lines with structured fields."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and any ``extra`` fields (peer_id, step…)."""

    _STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in self._STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(verbosity: int = 0, *, json_lines: bool = False) -> None:
    """Configure the root logger on stderr: WARNING by default, INFO with ``-v``, DEBUG with ``-vv``."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        fmt = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        fmt.converter = time.localtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # libp2p and its transports are noisy at INFO; keep them one level quieter than ours.
    for noisy in ("libp2p", "multiaddr", "aiohttp.access", "urllib3"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING) if verbosity < 2 else logging.INFO)
