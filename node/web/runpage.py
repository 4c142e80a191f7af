"""The coordinator's run page: ``GET /`` (HTML) and ``GET /api/run`` (a bounded JSON snapshot).

What the page shows and where it comes from (all of it public; no keys, no submission bodies):

* run name and spec summary — the signed run spec; a run's own environment with its hash and how
  many verdicts blamed it (``environment``: its reward code crashed, hit a limit or did not
  reproduce; never a worker's fault);
* policy step, trainer state, curves — the coordinator's ``/status`` fields and its
  ``metrics.jsonl`` (followed incrementally: reward, pass rate, held-out pass rate, verdicts by
  reason after each step);
* bans with evidence — the ban book, joined with the rejecting verdict the coordinator applied
  (its reason, validator and ``evidence`` map; verdicts are remembered in memory only);
* Shardcast propagation per step — when the coordinator announced a step, and when each relay's
  signed heartbeat first listed it as held and each worker's first reported it as its policy;
* nodes by role — the gossip peer table (alive, or silent since the last heartbeat);
* contributor leaderboard — the submission ledger's read model (accepted / rejected / pending,
  submissions and rollouts trained on, completion tokens of everything stored), kept by the ledger
  as submissions change state: the page never opens a stored envelope.

When the coordinator stops, the page's final state is written as a static copy (``archive_dir``,
:func:`write_archive`: ``index.html`` opens in a browser without a server), so a run's report
keeps it after the run ends.

The snapshot is rebuilt at most once per :data:`REFRESH_S` in a background task, so a request
never triggers work; every list is capped (:data:`CAPS`) and the answer is refused to grow past
:data:`MAX_RESPONSE_BYTES`. Requests are rate-limited per IP (:class:`~node.web.assets.PageLimiter`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from node import __version__
from node.web.assets import ASSETS, SECURITY_HEADERS, PageLimiter, add_page_routes, asset_bytes
from protocol.durable import atomic_write
from protocol.envelope import Envelope
from protocol.identity import PeerId
from protocol.messages import NodeRecord, Verdict
from protocol.runspec import SignedRunSpec
from trainer.ledger.ids import submission_id
from trainer.ledger.ledger import SubmissionLedger

logger = logging.getLogger(__name__)

API_ROUTE = "/api/run"
SNAPSHOT_VERSION = 1
REFRESH_S = 1.0
"""Seconds between two rebuilds of the snapshot."""
BOARD_DUTY_FACTOR = 20
"""The leaderboard is rebuilt only once this many times its last build time has passed, so however
its cost grows it takes at most 1/20 of the page's refresh thread (it reads the ledger's
per-worker read model, top entries first; before that model it scanned the whole submission
history: ≈ 0.3 s a build at 200,000 submissions)."""
MAX_RESPONSE_BYTES = 1 << 20
"""Largest ``/api/run`` answer, bytes; curves are thinned until it fits."""
CAPS = {"curve_points": 300, "heldout_points": 100, "nodes": 300, "leaderboard": 200, "bans": 100, "propagation_steps": 50,
        "verdicts_remembered": 2048, "peers_per_step": 256}
"""Bounds of the snapshot's lists (entries)."""
EARLY_STEPS = 4
"""Steps above the latest announced one whose holders are noted before their announcement arrives."""


class Propagation:
    """When each policy step reached the relays and workers, in seconds after its announcement.

    Fed from two threads (the trainer thread announces, the event loop hears records), hence the lock.

    Args:
        max_steps: steps remembered (oldest forgotten first).
        max_peers: peers remembered per step.
        clock: wall clock, seconds.
    """

    def __init__(self, max_steps: int = CAPS["propagation_steps"], max_peers: int = CAPS["peers_per_step"],
                 clock: Callable[[], float] = time.time) -> None:
        self.max_steps = max_steps
        self.max_peers = max_peers
        self.clock = clock
        self._lock = threading.Lock()
        self._announced: collections.OrderedDict[int, tuple[float, float | None]] = collections.OrderedDict()
        self._seen: dict[str, dict[int, dict[str, float]]] = {"relay": {}, "worker": {}}

    def note_published(self, step: int, publish_s: float | None) -> None:
        """Step ``step`` was announced now, after ``publish_s`` seconds of save + cut + sign."""
        with self._lock:
            if step in self._announced:
                return
            self._announced[step] = (self.clock(), publish_s)
            while len(self._announced) > self.max_steps:
                self._announced.popitem(last=False)
            oldest = next(iter(self._announced))
            for seen in self._seen.values():
                for s in [s for s in seen if s < oldest]:
                    del seen[s]

    def note_record(self, record: NodeRecord) -> None:
        """A verified heartbeat: a relay's held steps, a worker's policy step."""
        steps = record.held_steps if record.role == "relay" else [record.policy_step] if record.role == "worker" else []
        now = self.clock()
        with self._lock:
            latest = max(self._announced) if self._announced else -1
            for step in steps:
                # a record may beat the announcement (relays poll the origin): it counts as 0 s
                if step < 0 or (step not in self._announced and not latest < step <= latest + EARLY_STEPS):
                    continue
                by_peer = self._seen[record.role].setdefault(step, {})
                if record.peer_id not in by_peer and len(by_peer) < self.max_peers:
                    by_peer[record.peer_id] = now

    def rows(self) -> list[dict[str, Any]]:
        """Per announced step: publish seconds, first/last relay and worker seconds, counts."""
        out = []
        with self._lock:
            for step, (t_ann, publish_s) in self._announced.items():
                row: dict[str, Any] = {"step": step, "publish_s": _r(publish_s)}
                for role, key in (("relay", "relays"), ("worker", "workers")):
                    delays = sorted(max(0.0, t - t_ann) for t in self._seen[role].get(step, {}).values())
                    row[f"{key}_first_s"] = _r(delays[0]) if delays else None
                    row[f"{key}_all_s"] = _r(delays[-1]) if delays else None
                    row["relays_holding" if role == "relay" else "workers_on_step"] = len(delays)
                out.append(row)
        return out


class MetricsTail:
    """Follows the coordinator's ``metrics.jsonl`` (appended rows) from where it last stopped reading.

    Args:
        path: the file; it may not exist yet.
        max_rows: step and eval rows kept each.
    """

    def __init__(self, path: Path, max_rows: int = 5000) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self.steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_rows)
        self.evals: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_rows)

    def poll(self, max_bytes: int = 4 << 20) -> None:
        """Read up to ``max_bytes`` new bytes and keep the complete rows among them."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(max_bytes)
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-(1 << 20):]
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            if row.get("event") == "step":
                self.steps.append(row)
            elif row.get("event") == "eval":
                self.evals.append(row)


class RunPage:
    """The run page of one coordinator (see the module docstring).

    Lifecycle: ``RunPage(...)`` (no I/O) → :meth:`add_routes` on the coordinator's app →
    :meth:`attach_gossip` once gossip runs → ``await start()`` → ``await stop()``.

    Args:
        signed: the run spec.
        ledger: the submission ledger (its read models and ban book; read only).
        status: the coordinator's ``/status`` dict (trainer step, state, held-out pass rates…).
        metrics_path: the coordinator's ``metrics.jsonl``.
        peer_id: the coordinator's peer ID; url: its public URL.
        clock: monotonic clock, seconds (paces the leaderboard, :data:`BOARD_DUTY_FACTOR`).
        archive_dir: where :meth:`stop` writes the page's final state (:func:`write_archive`); ``None``: nowhere.
    """

    def __init__(self, signed: SignedRunSpec, ledger: SubmissionLedger, *, status: Callable[[], dict[str, Any]],
                 metrics_path: Path, peer_id: PeerId, url: str = "", clock: Callable[[], float] = time.monotonic,
                 archive_dir: Path | None = None) -> None:
        self.signed = signed
        self.spec = signed.spec
        self.ledger = ledger
        self.bans = ledger.bans
        self.status = status
        self.peer_id = peer_id
        self.url = url
        self.metrics = MetricsTail(metrics_path)
        self.propagation = Propagation()
        self.gossip: Any = None
        self.limiter = PageLimiter()
        self._verdicts: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._verdict_lock = threading.Lock()
        self._silent: dict[str, dict[str, Any]] = {}
        self._last_alive: dict[str, dict[str, Any]] = {}
        self._snapshot: bytes = b""
        self._task: asyncio.Task[None] | None = None
        self._clock = clock
        self._board: list[dict[str, Any]] | None = None
        self._board_due = 0.0
        self._refreshing: asyncio.Lock | None = None  # one rebuild at a time (made on the loop)
        self.archive_dir = Path(archive_dir) if archive_dir is not None else None

    # --- wiring --------------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        """``GET /``, ``GET /web/<asset>`` and ``GET /api/run`` on the coordinator's app."""
        add_page_routes(app, "run.html", self.limiter)
        app.router.add_get(API_ROUTE, self._api)

    def attach_gossip(self, gossip: Any) -> None:
        """Read the peer table of ``gossip`` (a :class:`~node.p2p.GossipNode`) and follow its records."""
        self.gossip = gossip
        gossip.on_record(lambda env: self.propagation.note_record(env.body))

    def note_verdict(self, env: Envelope[Verdict]) -> None:
        """Remember an applied rejecting verdict (verified by the ingest or gossip), so a ban can show its evidence."""
        if env.body.accepted:
            return
        with self._verdict_lock:
            self._verdicts[env.id.hex()] = {"validator": env.peer_id, "submission_id": submission_id(env.body.submission_id),
                                            "evidence": {k: v for k, v in list(env.body.evidence.items())[:16]}}
            while len(self._verdicts) > CAPS["verdicts_remembered"]:
                self._verdicts.popitem(last=False)

    async def start(self) -> None:
        """Build the first snapshot and keep rebuilding it every :data:`REFRESH_S` seconds."""
        try:
            await self._refresh()
        except Exception:  # the page must never keep the coordinator from starting
            logger.exception("run page: first snapshot failed; retrying every %.0f s", REFRESH_S)
        self._task = asyncio.create_task(self._loop(), name="run-page-refresh")

    async def stop(self) -> None:
        """Stop refreshing; with ``archive_dir``, rebuild the snapshot once more and write the static copy."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.archive_dir is not None:
            try:
                await self._refresh()
                if self._snapshot:
                    await asyncio.to_thread(write_archive, self.archive_dir, self._snapshot)
                logger.info("run page: final state written to %s", self.archive_dir / "index.html")
            except Exception:  # a failed copy must not keep the coordinator from stopping
                logger.exception("run page: could not write its final state to %s", self.archive_dir)

    # --- snapshot ------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self._refresh()
            except Exception:  # the page must never take the coordinator down
                logger.exception("run page refresh failed")

    async def _refresh(self) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.Lock()
        async with self._refreshing:  # a request before start() must not race the first rebuild
            nodes = self._nodes()  # the peer table belongs to the event loop: read it here
            self._snapshot = await asyncio.to_thread(self.build, nodes)

    def _nodes(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        alive: dict[str, dict[str, Any]] = {}
        if self.gossip is not None:
            for p in self.gossip.peers.alive():
                alive[p.peer_id] = {**p.to_json(now), "state": "alive", "_seen_wall": time.time() - max(0.0, now - p.last_seen)}
        for pid in [p for p in self._silent if p in alive]:
            del self._silent[pid]
        for pid, row in list(self._last_alive.items()):
            if pid not in alive:
                self._silent[pid] = {**row, "state": "silent"}
        while len(self._silent) > CAPS["nodes"]:
            del self._silent[next(iter(self._silent))]
        self._last_alive = alive
        rows = list(alive.values()) + list(self._silent.values())
        for row in rows:
            row["last_seen_s"] = round(max(0.0, time.time() - row["_seen_wall"]), 1)
        return [{k: v for k, v in r.items() if k not in ("_seen_wall", "addrs", "hardware", "seq")} for r in rows][: CAPS["nodes"]]

    def _leaderboard(self, banned: Mapping[PeerId, Any]) -> list[dict[str, Any]]:
        """The top :data:`CAPS` ``leaderboard`` workers; the last one built until it is due again
        (:data:`BOARD_DUTY_FACTOR`)."""
        t0 = self._clock()
        if self._board is not None and t0 < self._board_due:
            return self._board
        board: list[dict[str, Any]] = []
        for row in self.ledger.leaderboard(CAPS["leaderboard"]):
            acc, rej, ban = row["accepted"], row["rejected"], banned.get(PeerId(row["peer_id"]))
            board.append({**row, "reputation": 0.0 if ban else round((acc + 1) / (acc + rej + 2), 4),
                          "banned": ban is not None, "ban_reason": ban.reason if ban else ""})
        self._board = board
        t1 = self._clock()
        self._board_due = t1 + (BOARD_DUTY_FACTOR - 1) * (t1 - t0)
        return self._board

    def build(self, nodes: list[dict[str, Any]] | None = None) -> bytes:
        """The ``/api/run`` document as JSON bytes (blocking: ledger reads; call off the event loop)."""
        self.metrics.poll()
        st = self.status()
        spec = self.spec
        published = int(st.get("published_step", st.get("latest_policy_step", -1)))
        coordinator_row = {"peer_id": self.peer_id, "role": "coordinator", "state": str(st.get("state", "")), "policy_step": published,
                           "held_steps": [], "last_seen_s": 0.0, "http_url": self.url, "version": __version__}
        banned = {e.peer_id: e for e in self.bans.entries()}
        board = self._leaderboard(banned)
        with self._verdict_lock:
            verdicts = dict(self._verdicts)
        bans = []
        for e in sorted(banned.values(), key=lambda e: -e.since_ms)[: CAPS["bans"]]:
            v = verdicts.get(e.verdict_id.hex(), {})
            bans.append({"peer_id": e.peer_id, "reason": e.reason, "since_ms": e.since_ms, "verdict_id": e.verdict_id.hex(),
                         "validator": v.get("validator", ""), "submission_id": v.get("submission_id", ""), "evidence": v.get("evidence")})
        doc: dict[str, Any] = {
            "version": SNAPSHOT_VERSION,
            "generated_ms": int(time.time() * 1000),
            "run": {
                "name": spec.run.name, "run_id": self.signed.run_id.hex(), "coordinator": spec.run.coordinator,
                "validators": len(spec.run.validators),
                "model": {"base": spec.model.base if spec.model.base == "embedded" else Path(spec.model.base).name,
                          "hidden_size": spec.model.hidden_size, "dtype": spec.model.dtype},
                "tasks": spec.data.tasks if "/" not in spec.data.tasks else Path(spec.data.tasks).name,
                "tasks_per_submission": spec.data.tasks_per_submission,
                "sampling": {"temperature": spec.sampling.temperature, "top_p": spec.sampling.top_p, "max_tokens": spec.sampling.max_tokens},
                "rl": {"group_size": spec.rl.group_size, "batch_groups": spec.rl.batch_groups, "async_level": spec.rl.async_level,
                       "learning_rate": spec.rl.learning_rate},
                "shardcast": {"keep_steps": spec.shardcast.keep_steps, "piece_size_bytes": spec.shardcast.piece_size_bytes},
                "heartbeat_interval_s": spec.network.heartbeat_interval_s,
                "environment": None if not spec.env.name else {
                    "name": spec.env.name if not spec.env.name.endswith(".py") else Path(spec.env.name).name, "hash": spec.env.hash,
                    "faults": int((st.get("verdicts_by_reason") or {}).get("environment", 0))},
            },
            "trainer": {
                "step": int(st.get("trainer_step", 0)), "published_step": published, "state": str(st.get("state", ""))[:300],
                "utilization": st.get("utilization"), "heldout_start": st.get("heldout_start"), "heldout_end": st.get("heldout_end"),
                "submissions": st.get("submissions", {}), "uptime_s": st.get("uptime_s"),
            },
            "curves": self._curves(CAPS["curve_points"]),
            "bans": bans,
            "propagation": self.propagation.rows()[-CAPS["propagation_steps"]:],
            "nodes": [coordinator_row, *(nodes or [])][: CAPS["nodes"]],
            "leaderboard": board,
        }
        out = json.dumps(doc, default=str).encode()
        points = CAPS["curve_points"]
        while len(out) > MAX_RESPONSE_BYTES and points > 10:
            points //= 2
            doc["curves"] = self._curves(points)
            out = json.dumps(doc, default=str).encode()
        return out

    def _curves(self, max_points: int) -> dict[str, Any]:
        steps = _thin(list(self.metrics.steps), max_points)
        evals = _thin(list(self.metrics.evals), CAPS["heldout_points"])
        return {
            "steps": [{"step": s.get("step"), "reward_mean": _r(s.get("reward_mean")), "pass_rate": _r(s.get("pass_rate")),
                       "loss": _r(s.get("loss")), "tokens_per_s": _r(s.get("tokens_per_s")), "publish_s": _r(s.get("broadcast_s")),
                       "wall_s": s.get("wall_s")} for s in steps],
            "heldout": [{"step": e.get("step"), "pass_rate": _r(e.get("heldout_pass_rate")), "ci_low": _r(e.get("heldout_ci_low")),
                         "ci_high": _r(e.get("heldout_ci_high"))} for e in evals],
            "verdicts": [{"step": s.get("step"), "by_reason": {str(k)[:64]: int(v) for k, v in list((s.get("verdicts") or {}).items())[:32]}}
                         for s in steps],
        }

    # --- HTTP ----------------------------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.Response:
        self.limiter.check(request)
        if not self._snapshot:
            await self._refresh()
        return web.Response(body=self._snapshot, content_type="application/json", headers=SECURITY_HEADERS)


def write_archive(directory: Path, snapshot: bytes) -> Path:
    """Write the run page with ``snapshot`` (an ``/api/run`` document) as static files; returns ``index.html``.

    ``index.html`` is the live page with relative asset paths plus ``snapshot.js``, which sets
    ``window.RUN_SNAPSHOT``; ``run.js`` draws that once instead of polling. It opens from disk
    (``file://``) in any browser; values from peers are still put in the page as text only.
    """
    directory = Path(directory)
    (directory / "web").mkdir(parents=True, exist_ok=True)
    for name in ASSETS:
        atomic_write(directory / "web" / name, asset_bytes(name))
    html = asset_bytes("run.html").decode().replace('"/web/', '"web/')
    html = html.replace('<script src="web/run.js" defer></script>', '<script src="snapshot.js" defer></script>\n<script src="web/run.js" defer></script>')
    atomic_write(directory / "snapshot.js", b"window.RUN_SNAPSHOT = " + snapshot + b";\n")
    atomic_write(directory / "index.html", html.encode())
    return directory / "index.html"


def _thin(rows: list[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """At most ``max_points`` rows, evenly spaced, always keeping the last."""
    if len(rows) <= max_points:
        return rows
    stride = -(-len(rows) // max_points)
    kept = rows[::stride]
    if kept[-1] is not rows[-1]:
        kept.append(rows[-1])
    return kept


def _r(x: Any, digits: int = 4) -> float | None:
    """A finite number rounded, else ``None`` (JSON has no inf or NaN: ``Infinity`` would break the
    browser's parse of the whole snapshot, e.g. after one unchecked submission's huge reward)."""
    return round(float(x), digits) if isinstance(x, (int, float)) and math.isfinite(x) else None
