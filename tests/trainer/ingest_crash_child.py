"""Child process of ``test_ingest_concurrency.py``'s crash test: the ingest on 127.0.0.1 until killed.

Run as ``python tests/trainer/ingest_crash_child.py DIR``; prints ``PORT <n>`` once it listens. The
test kills it with SIGKILL (no clean shutdown, no store close) while submissions are in flight.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

from node.http_server import start_site
from protocol.identity import NodeKey
from protocol.runspec import RunInfo, RunSpec
from trainer.ingest.limits import IngestLimits
from trainer.ingest.service import error_middleware, open_ingest

COORD = NodeKey.from_seed(b"c" * 32)
VALIDATOR = NodeKey.from_seed(b"v" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=1))  # as test_ingest.py's


async def main(root: Path) -> None:
    limits = IngestLimits(requests_per_s=1000.0, burst=1000.0, max_pending_per_ip=10_000, decode_concurrency_per_ip=4)
    service = open_ingest(root, SPEC, COORD, trainer_step=lambda: 0, latest_policy_step=lambda: 0, limits=limits)
    app = web.Application(middlewares=[error_middleware])
    service.add_routes(app)
    server = await start_site(app, "127.0.0.1", 0)
    print(f"PORT {server.port}", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
