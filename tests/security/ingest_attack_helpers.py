"""A real ingest server on 127.0.0.1 and the tools of a hostile worker against it.

The server is the coordinator's: :class:`trainer.ingest.service.IngestService` routes (over the
submission ledger, ``trainer/ledger/``) started by
:func:`node.http_server.start_site` (header timeout, per-IP connection cap, no compressed
bodies). Attackers connect from 127.0.0.2 (any 127/8 address reaches loopback), honest clients
from 127.0.0.1, so per-IP limits tell them apart as they would on a real network.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from node.http_server import RunningServer, ServerLimits, start_site
from protocol import encoding
from protocol.envelope import DOMAIN, open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask, Verdict
from protocol.runspec import RunInfo, RunSpec
from trainer.ingest.limits import IngestLimits
from trainer.ingest.service import IngestService, error_middleware, open_ingest
from trainer.ledger import BanBook, Recheck, SubmissionLedger, SubmissionStore

COORD = NodeKey.from_seed(b"c" * 32)
VALIDATOR = NodeKey.from_seed(b"v" * 32)
VALIDATOR2 = NodeKey.from_seed(b"w" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id, VALIDATOR2.peer_id], seed=1))
RUN = SPEC.run_id
ATTACKER_IP = "127.0.0.2"
CLIENT_TIMEOUT_S = 2.0
"""Behaviour bound: an honest request must be answered within this while the node is under attack."""


def submission(worker: NodeKey, counter: int = 0, step: int = 0, payload_tokens: int = 4) -> bytes:
    """A well-formed ``submission/1`` envelope with one rollout of ``payload_tokens`` tokens."""
    r = Rollout(task=0, sample=0, seed=1, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00" * payload_tokens,
                logprobs=b"\x00\x00\x00\x00" * payload_tokens, finish="length", task_reward=0.0, reward=0.0, proofs=[b"\x00" * 258])
    body = Submission(worker=worker.peer_id, policy_step=step, counter=counter,
                      tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)], rollouts=[r])
    return seal(worker, RUN, body)


def verdict(sub: bytes, accepted: bool, reason: str, key: NodeKey = VALIDATOR, **evidence: Any) -> bytes:
    env = open_envelope(sub, run_id=RUN, expect=Submission)
    return seal(key, RUN, Verdict(submission_id=env.id, worker=env.body.worker, policy_step=env.body.policy_step,
                                  counter=env.body.counter, accepted=accepted, reason=reason, evidence=evidence))


def forge(key: NodeKey, type_tag: str, body: Any, ts_ms: int | None = None, *, nonce: bytes | None = None,
          splice: dict[str, bytes] | None = None) -> bytes:
    """A correctly *signed* envelope around an arbitrary body (what a hostile peer can make with a free key).

    ``splice`` maps a placeholder string in ``body`` to the canonical msgpack bytes put in its place,
    in the signed bytes and in the envelope: a large value encoded once (``encoding.packb`` walks
    every element in Python: 380,000 empty maps take ≈ 0.4 s each time)."""
    import time

    def pack(obj: Any) -> bytes:
        raw = encoding.packb(obj)
        for placeholder, value in (splice or {}).items():
            token = encoding.packb(placeholder)
            assert raw.count(token) == 1, placeholder
            raw = raw.replace(token, value)
        return raw

    unsigned = {"v": 1, "type": type_tag, "run": RUN, "signer": key.public_key, "ts_ms": ts_ms or int(time.time() * 1000),
                "nonce": nonce or os.urandom(16), "body": body}
    return pack({**unsigned, "sig": key.sign(DOMAIN + pack(unsigned))})


@dataclass
class Ingest:
    """The running ingest: its service, ledger (with its store and ban book) and URL."""

    service: IngestService
    ledger: SubmissionLedger
    store: SubmissionStore
    bans: BanBook
    server: RunningServer
    gossiped: list[bytes]
    step: list[int]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@contextlib.asynccontextmanager
async def running_ingest(root: Path, limits: IngestLimits | None = None, server_limits: ServerLimits | None = None,
                         recheck: Recheck | None = None) -> AsyncIterator[Ingest]:
    """Start the ingest on 127.0.0.1 (all interfaces of 127/8 reach it: bound to 0.0.0.0 is not needed)."""
    from aiohttp import web

    step = [0]
    gossiped: list[bytes] = []
    service = open_ingest(root, SPEC, COORD, trainer_step=lambda: step[0], latest_policy_step=lambda: step[0], on_ban=gossiped.append,
                          limits=limits, recheck=recheck)
    ledger = service.ledger
    app = web.Application(middlewares=[error_middleware])
    service.add_routes(app)
    server = await start_site(app, "127.0.0.1", 0, limits=server_limits)
    try:
        yield Ingest(service, ledger, ledger.store, ledger.bans, server, gossiped, step)
    finally:
        await server.stop()
        service.close()
        ledger.close()


async def establish(ing: Ingest, worker: NodeKey) -> None:
    """Make ``worker`` and 127.0.0.1 established: one submission posted from there and accepted
    (what an honest worker that has been in the run a while is; a new one shares the rate of
    unproven addresses with whatever junk new addresses send)."""
    sub = submission(worker, counter=1_000_000)
    async with honest_session(ing.url) as http:
        status, body = await post(http, "/ingest/1/submissions", sub)
    assert status == 200, body
    assert ing.service.apply_verdict(verdict(sub, True, "ok"))


def honest_session(url: str) -> aiohttp.ClientSession:
    """An honest client from 127.0.0.1 that gives up after :data:`CLIENT_TIMEOUT_S`."""
    return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
                                 connector=aiohttp.TCPConnector(local_addr=("127.0.0.1", 0), force_close=True))


def attacker_session(url: str, limit: int = 100) -> aiohttp.ClientSession:
    """A hostile client from :data:`ATTACKER_IP` (no client-side timeout: it waits as long as the server lets it)."""
    return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=120),
                                 connector=aiohttp.TCPConnector(local_addr=(ATTACKER_IP, 0), limit=limit, force_close=True))


async def post(http: aiohttp.ClientSession, path: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with http.post(path, data=data, headers=headers) as r:
        body = await r.read()
        try:
            import json

            return r.status, json.loads(body)
        except ValueError:
            return r.status, body


