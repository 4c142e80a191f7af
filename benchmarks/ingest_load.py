"""Ingest capacity: real signed submissions from many worker keys against a real ingest on 127.0.0.1.

The ingest (``trainer.ingest.IngestService`` with its durable ``SubmissionStore`` — tmp file,
fsync, rename, fsync of the directory — and the coordinator's HTTP server ``start_site`` with its
per-address connection cap) runs in a child process; this process is the load. Before the clock
starts it makes ``--workers`` ed25519 keys and signs every submission (``--submissions`` of them,
the run spec's default shape unless told otherwise: 2 tasks × group 8 = 16 rollouts, 32
completion tokens each with their log-probs and one 258-byte TOPLOC proof, ``--prompt-tokens``
prompt tokens), so only the ingest's work is timed: receive, verify the signature, decode and
schema-check, quota checks, durable write, answer.

Quotas (H2's, ``IngestLimits``): every load client connects from 127.0.0.1, so the per-address
limits are set out of the way for this benchmark — per-address request rate (4 × ``requests_per_s``)
to 4,000/s, the shared rate of addresses with no accepted submission to 4,000/s, unjudged
submissions per address to 10⁶, decode slots per address to the global 4, disk quotas to 10⁶
files / 1 TiB — and each worker key sends at most ``max_pending_per_worker`` (4)
submissions, because nothing judges them here. Per-key rate and the global decode concurrency
stay at their defaults. The server's own cap of 64 connections per address bounds
``--concurrency``.

Each concurrency level in ``--concurrency`` gets a fresh ingest and store and runs for at most
``--submissions`` requests or ``--max-s`` seconds; the levels are printed side by side with the
machine's load average, the ingest process's CPU per accepted submission, the median time of one
durable file write on the same disk measured just before, and how many submissions the store's
group commits carried (one directory fsync and one SQLite commit per group; each file has its
own fsync, several at once).

``--baseline REV[,REV…]``: the same levels also against the ingest of git revision ``REV`` (a copy of
this checkout's ``protocol/``, ``trainer/`` and ``node/`` in a temporary directory with
``trainer/ingest/`` and ``trainer/ledger/`` taken from ``REV`` by ``git archive``, imported by the server child instead of
this checkout), alternating baseline and current at each level, so both see the same machine
load; printed side by side.

``--history N``: the store starts with N index rows of submissions trained on long ago (files
deleted, as ``SubmissionStore.mark_consumed`` leaves them; 1,000 worker IDs, 100 addresses):
what a run has behind it after N submissions, since index rows are kept for the whole run.

``--status-hz H``: one more client GETs the ingest's ``/status`` H times a second while the load
runs (a dashboard, or any client: the route is public); with ``--history`` it shows what the
status's whole-history queries cost the submissions.

``--fsync-delay-ms X``: every ``fsync``/``fdatasync`` of the server child (its own and SQLite's)
first sleeps X ms, through a small ``LD_PRELOAD`` shim compiled with the system C compiler: a
reproducible stand-in for the slow disk of a loaded machine (0.4–38 ms per fsync measured on this
one). Concurrent sleeping fsyncs overlap fully; concurrent fsyncs on one ext4 journal share its
commits, so the model is optimistic for the writer threads and exact for the serial steps.

``--relay``: a relay's capacity instead. A Shardcast server (``node.shardcast.server``, the
one relays and the origin run, ``sendfile`` from its store) serves a published ``--relay-mib``
checkpoint (4 MiB pieces) from a child process; for each level of ``--clients``, that many
concurrent clients in this process each GET every piece once (bytes read and dropped, not
verified, so the clients cost as little as possible). Prints aggregate MiB/s and the p50/p99 time
per client to hold the whole checkpoint, side by side, with the load average.

``--sybil 0,16,66``: fair leasing under Sybil pressure (issue 23 item 4), attacked against
unattacked side by side. The child runs the ingest with its production limits plus a simulated
trainer (a step every ``--step-s`` seconds at best, once ``--step-submissions`` accepted fresh
submissions are there; consumed as the coordinator does). This process runs ``--honest``
honest workers on 127.0.0.1 (each a submission every ``1 / --honest-rate`` s at the current
policy step, retrying refusals after their ``Retry-After``), one simulated validator (signed
leases of 8, ``--validator-rate`` judgements a second: honest work accepted, anything else
rejected ``toploc``, which the coordinator's re-check reproduces) and, for a level N > 0, junk
from N addresses (127.i.0.1, each its own /24) with a fresh key per submission, as fast as the
ingest takes them. After a ``--warmup-s`` warm-up without junk (the honest workers become
established) it measures ``--duration-s``: honest accepted/s (and its ratio to the unattacked
level), trainer steps, the longest gap between steps against the unattacked median step time,
honest submissions gone stale, and the answers each side got; also the honest POSTs' answer
time (p50, max) and the CPU the ingest process used over the window, in cores
(``ingest_cpu_share``: what the box left it). With ``--baseline REV`` the same
levels run against the whole ``protocol/``, ``trainer/`` and ``node/`` of ``REV``.
``--newcomer-after-s T``: T seconds into the window a *new* honest worker (a fresh key from an
address prefix of its own, 127.200.0.1) starts submitting like the others; prints the seconds
from its first POST to its first stored submission (``newcomer_admitted_s``) and to its first
accepted one (``newcomer_accepted_s``), ``None`` when that did not happen within the window.
``--disk-files N`` and ``--probation-share F`` scale the ingest's disk quota and probation's share
of it (production: 4,096 and 0.5) so that a short run fills the share (2,048 take the flood
minutes at 20 unproven/s) without the disk quota itself binding.

``--admission``: what admission costs the event loop while probation's share is full (the
ledger alone, in a child process per code, no HTTP): the share (half of ``--disk-files``, default
the production 4,096) filled by fresh keys from 16 /24s, then the median and largest time of one
call, in ms: the pre-body check (``precheck``) for an address of a flood prefix and of a new
prefix, and ``admit`` for a flood prefix (refused) and for a new prefix (displaces, or refused by
older code), each admission after the previous one's commit; and ``admit`` while the share still
had room, for scale. With ``--baseline REV`` side by side with ``REV``'s ``protocol/``,
``trainer/`` and ``node/``.

Run: ``python benchmarks/ingest_load.py [--submissions 1200] [--concurrency 4,16,48] [--max-tokens 32]
[--baseline REV] [--fsync-delay-ms X] [--history N]``
or ``python benchmarks/ingest_load.py --relay [--relay-mib 64] [--clients 1,8,32]``
or ``python benchmarks/ingest_load.py --sybil 0,16,66 [--duration-s 60] [--baseline REV]``
or ``python benchmarks/ingest_load.py --admission [--disk-files 4096] [--baseline REV]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COORD_SEED = b"c" * 32


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0…1) of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def bench_spec():  # type: ignore[no-untyped-def]
    from protocol.identity import NodeKey
    from protocol.runspec import RunInfo, RunSpec

    return RunSpec(run=RunInfo(coordinator=NodeKey.from_seed(COORD_SEED).peer_id, seed=1))


def bench_limits():  # type: ignore[no-untyped-def]
    from trainer.ingest.service import IngestLimits

    lifted = {"unproven_requests_per_s": 4000.0, "unproven_burst": 4000.0}  # every client is one address nothing judges
    known = {f.name for f in dataclasses.fields(IngestLimits)}  # a --baseline's limits may lack them
    return IngestLimits(requests_per_s=1000.0, burst=1000.0, max_pending_per_ip=1_000_000, max_pending_bytes_per_ip=1 << 40,
                        max_disk_files=1_000_000, max_disk_bytes=1 << 40, decode_concurrency_per_ip=4,
                        **{k: v for k, v in lifted.items() if k in known})


def prefill(index: Path, n: int) -> None:
    """``n`` index rows of submissions trained on long ago (files gone, 1,000 workers, 100 addresses): a run's history."""
    import secrets
    import sqlite3

    db = sqlite3.connect(index)
    if db.execute("PRAGMA user_version").fetchone()[0] >= 2:  # trainer/ledger's schema: retired after training
        from trainer.ledger.states import State

        state = State.RETIRED.value
    else:  # a --baseline from before the ledger: accepted, with consumed_step 0
        state = "accepted"
    with db:
        start = db.execute("SELECT COALESCE(MAX(seq), 0) FROM submissions").fetchone()[0]
        db.executemany(
            "INSERT INTO submissions (id, worker, policy_step, counter, n_rollouts, size_bytes, received_ms, state, reason, consumed_step,"
            f" seq, source_ip, on_disk) VALUES (?, ?, 0, ?, 16, 14700, 0, '{state}', 'ok', 0, ?, ?, 0)",
            ((secrets.token_hex(32), f"history-worker-{i % 1000}", i // 1000, start + i + 1, f"10.0.{i % 100}.1") for i in range(n)),
        )
    db.close()


async def serve(root: Path, history: int = 0) -> None:
    """Child process: run the ingest on 127.0.0.1, print ``PORT <n>``, stop when stdin closes."""
    from aiohttp import web

    import trainer.ingest.service as ingest
    from node.http_server import start_site

    try:
        from trainer.ledger import SubmissionStore
    except ImportError:  # a --baseline revision from before trainer/ledger/
        from trainer.ingest import SubmissionStore  # type: ignore[attr-defined,no-redef]

    spec = bench_spec()
    if history:
        SubmissionStore(root / "ingest", spec.run_id).close()  # the schema (and this code's indexes)
        prefill(root / "ingest" / "index.sqlite", history)
    service, store = open_service(ingest, root, spec)
    app = web.Application(middlewares=[ingest.error_middleware], client_max_size=64 << 20)
    service.add_routes(app)
    running = await start_site(app, "127.0.0.1", 0)
    print(f"PORT {running.port}", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    await running.stop()
    service.close()
    store.close()
    commits = getattr(getattr(store, "store", store), "commits", {})  # the ledger's store; an old baseline store has none
    print("STATS " + json.dumps(commits), flush=True)


def open_service(ingest, root: Path, spec, *, trainer_step=lambda: 0, recheck=None, limits=None):  # type: ignore[no-untyped-def]
    """The ingest service of the code under test and its store: ``open_ingest`` (the ledger), or a
    ``--baseline`` revision's ``IngestService(spec, store, bans, …)``."""
    from protocol.identity import NodeKey

    key = NodeKey.from_seed(COORD_SEED)
    limits = limits or bench_limits()
    if hasattr(ingest, "open_ingest"):
        service = ingest.open_ingest(root, spec, key, trainer_step=trainer_step, latest_policy_step=trainer_step, limits=limits,
                                     recheck=recheck)
        return service, service.ledger
    try:
        from trainer.ledger import BanBook, SubmissionStore
    except ImportError:  # before trainer/ledger/
        from trainer.ingest import BanBook, SubmissionStore  # type: ignore[attr-defined,no-redef]

    store = SubmissionStore(root / "ingest", spec.run_id)
    bans = BanBook(root / "bans.msgpack", key, spec.run_id)
    service = ingest.IngestService(spec, store, bans, trainer_step=trainer_step, latest_policy_step=trainer_step, limits=limits,
                                   recheck=recheck)
    return service, store


async def serve_relay(root: Path, size_mib: int) -> None:
    """Child process: publish a ``size_mib`` checkpoint into a store, serve it, print ``PORT <n> <piece ids…>``."""
    from node.shardcast.publish import publish_checkpoint
    from node.shardcast.server import ShardcastServer
    from node.shardcast.store import ShardcastStore
    from protocol.identity import NodeKey
    from protocol.shardcast import iter_pieces

    spec = bench_spec()
    ckpt = root / "ckpt"
    ckpt.mkdir()
    with open(ckpt / "model.safetensors", "wb") as f:
        f.writelines(os.urandom(1 << 20) for _ in range(size_mib))
    store = ShardcastStore(root / "store", run_id=spec.run_id, authorities=spec.authorities, keep_steps=2)
    env = await asyncio.to_thread(publish_checkpoint, store, [ckpt / "model.safetensors"], step=1, key=NodeKey.from_seed(COORD_SEED),
                                  piece_size_bytes=4 << 20)
    server = ShardcastServer(store)
    await server.start()
    print(f"PORT {server.port} " + " ".join(ref.piece_id.hex() for ref in iter_pieces(env.body)), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop()


async def relay_level(port: int, pieces: list[str], clients: int) -> dict[str, object]:
    """``clients`` concurrent clients, each GETting every piece once; aggregate MiB/s."""
    import aiohttp

    per_client: list[float] = []
    total = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal total
        t = time.perf_counter()
        for pid in pieces:
            async with http.get(f"http://127.0.0.1:{port}/shardcast/1/pieces/{pid}") as r:
                if r.status != 200:
                    raise SystemExit(f"piece {pid[:12]}: HTTP {r.status}")
                async for chunk in r.content.iter_chunked(1 << 20):
                    total += len(chunk)
        per_client.append(time.perf_counter() - t)

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "MiB": round(total / 2**20), "wall_s": round(wall, 2), "aggregate_MiB_per_s": round(total / 2**20 / wall, 1),
            "per_client_p50_s": round(pct(per_client, 0.5), 2), "per_client_p99_s": round(pct(per_client, 0.99), 2),
            "load": f"{load0:.1f} → {os.getloadavg()[0]:.1f}"}


async def relay_main(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.clients.split(",")]
    if max(levels) > 64:
        raise SystemExit("--clients above 64: the server accepts 64 connections per address")
    with tempfile.TemporaryDirectory(prefix="relay-load-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, __file__, "--serve-relay", tmp, "--relay-mib", str(args.relay_mib)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 300)
            if not line.startswith("PORT "):
                raise SystemExit(f"relay did not start: {line!r}")
            port, *pieces = line.split()[1:]
            results = []
            for c in levels:
                r = await relay_level(int(port), pieces, c)
                print(json.dumps(r), flush=True)
                results.append(r)
        finally:
            _stop(proc)
    print(f"\nrelay serving a {args.relay_mib} MiB checkpoint (4 MiB pieces) on 127.0.0.1")
    print(f"{'clients':26s}" + "".join(f"{r['clients']:>20}" for r in results))
    for k in [k for k in results[0] if k != "clients"]:
        print(f"{k:26s}" + "".join(f"{r.get(k)!s:>20s}" for r in results))


def build_submissions(n: int, workers: int, per_worker: int, prompt_tokens: int, max_tokens: int, tasks: int, group: int) -> list[bytes]:
    """``n`` signed ``submission/1`` envelopes from ``workers`` keys, ``per_worker`` each at most."""
    import numpy as np

    from protocol.envelope import seal
    from protocol.identity import NodeKey
    from protocol.messages import Rollout, Submission, SubmissionTask

    run_id = bench_spec().run_id
    rng = np.random.default_rng(0)
    proofs = -(-max_tokens // 32)
    out: list[bytes] = []
    keys = [NodeKey.generate() for _ in range(workers)]
    for i in range(n):
        key = keys[i // per_worker]
        rollouts = [
            Rollout(task=t, sample=s, seed=int(rng.integers(1 << 31)),
                    prompt_ids=rng.integers(0, 4096, prompt_tokens, dtype=np.uint32).astype("<u4").tobytes(),
                    completion_ids=rng.integers(0, 4096, max_tokens, dtype=np.uint32).astype("<u4").tobytes(),
                    logprobs=(-rng.random(max_tokens, dtype=np.float32)).astype("<f4").tobytes(),
                    finish="length", task_reward=0.0, reward=0.0, proofs=[rng.bytes(258) for _ in range(proofs)])
            for t in range(tasks) for s in range(group)
        ]
        body = Submission(worker=key.peer_id, policy_step=0, counter=i % per_worker,
                          tasks=[SubmissionTask(task_index=t, problem_id=f"p{t}", target_length=0) for t in range(tasks)], rollouts=rollouts)
        out.append(seal(key, run_id, body))
    return out


async def load(port: int, subs: list[bytes], concurrency: int, max_s: float, status_hz: float = 0.0) -> dict[str, object]:
    """POST ``subs`` with ``concurrency`` requests in flight; latency per request, status counts. With
    ``status_hz`` > 0 one more client GETs ``/status`` that often meanwhile (an operator's dashboard,
    or anyone: the route is public); its answers are counted by HTTP status."""
    import aiohttp

    lat: list[float] = []
    codes: dict[int, int] = {}
    it = iter(subs)
    deadline = time.monotonic() + max_s
    url = f"http://127.0.0.1:{port}/ingest/1/submissions"
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def client() -> None:
            for data in it:
                if time.monotonic() > deadline:
                    return
                t = time.perf_counter()
                async with http.post(url, data=data, headers={"Content-Type": "application/msgpack"}) as r:
                    await r.read()
                    codes[r.status] = codes.get(r.status, 0) + 1
                lat.append(time.perf_counter() - t)

        status_codes: dict[int, int] = {}
        done = asyncio.Event()

        async def poller() -> None:
            async with aiohttp.ClientSession() as own:  # its own connection: the load's connector is always full
                for _ in range(int(max_s * status_hz) + 1):
                    if done.is_set():
                        return
                    async with own.get(f"http://127.0.0.1:{port}/status") as r:
                        await r.read()
                        status_codes[r.status] = status_codes.get(r.status, 0) + 1
                    await asyncio.sleep(1.0 / status_hz)

        t0 = time.perf_counter()
        polling = asyncio.create_task(poller()) if status_hz > 0 else None
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        done.set()
        if polling is not None:
            await polling
    ok = codes.get(200, 0)
    out: dict[str, object] = {"requests": len(lat), "accepted": ok, "status": codes, "wall_s": round(wall, 2),
                              "accepted_per_s": round(ok / wall, 1), "p50_ms": round(pct(lat, 0.5) * 1e3, 1),
                              "p99_ms": round(pct(lat, 0.99) * 1e3, 1), "max_ms": round(max(lat) * 1e3, 1)}
    if status_hz > 0:
        out["status_gets"] = status_codes
    return out



def _stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """End a helper process: close its stdin (its signal to exit), wait 15 s, then kill it."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
static void delay(void) {
    static long ns = -1;
    if (ns < 0) { const char *e = getenv("INGEST_LOAD_FSYNC_DELAY_US"); ns = e ? atol(e) * 1000L : 0; }
    if (ns > 0) { struct timespec ts = {ns / 1000000000L, ns % 1000000000L}; nanosleep(&ts, NULL); }
}
int fsync(int fd) { static int (*real)(int); if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync"); delay(); return real(fd); }
int fdatasync(int fd) { static int (*real)(int); if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync"); delay(); return real(fd); }
"""


def build_fsync_shim(directory: Path) -> Path:
    """Compile the ``LD_PRELOAD`` shim that delays every fsync/fdatasync (``--fsync-delay-ms``)."""
    src, lib = directory / "fsync_delay.c", directory / "fsync_delay.so"
    src.write_text(_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


def code_versions(baseline: str, tmp: Path, *, whole: bool = False) -> list[tuple[str, Path]]:
    """The code each run uses, named: each ``--baseline`` revision (comma-separated) extracted
    under ``tmp`` (:func:`extract_baseline`), then this checkout, ``"current"``."""
    codes: list[tuple[str, Path]] = []
    for i, rev in enumerate(baseline.split(",") if baseline else []):
        base = tmp / f"baseline{i}"
        base.mkdir()
        codes.append((f"base {rev[:10]}", extract_baseline(rev, base, whole=whole)))
    return [*codes, ("current", REPO)]


def extract_baseline(rev: str, directory: Path, *, whole: bool = False) -> Path:
    """This checkout's ``protocol/``, ``trainer/`` and ``node/`` under ``directory``, with ``trainer/ingest/``
    and ``trainer/ledger/`` replaced by git revision ``rev``'s (``--baseline``): only the ingest differs.
    With ``whole``, all three packages are ``rev``'s (``--sybil``: the ingest with the protocol and
    HTTP server of its time, which the current ones no longer fit)."""
    import shutil

    if whole:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "protocol", "trainer", "node"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
        return directory
    for pkg in ("protocol", "trainer", "node"):
        shutil.copytree(REPO / pkg, directory / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for pkg in ("ingest", "ledger"):
        shutil.rmtree(directory / "trainer" / pkg, ignore_errors=True)
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "trainer/"], check=True, capture_output=True, text=True).stdout
    paths = [p for p in ("trainer/ingest", "trainer/ledger") if p in listed.split()]
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory

def fsync_probe(directory: Path, size: int, n: int = 20) -> float:
    """Median seconds of one durable write as the store does it (write, fsync, rename, fsync the directory)."""
    times = []
    data = os.urandom(size)
    for i in range(n):
        t = time.perf_counter()
        tmp, final = directory / f"probe{i}.tmp", directory / f"probe{i}.sub"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t)
        final.unlink()
    return statistics.median(times)


async def run_level(subs: list[bytes], concurrency: int, max_s: float, code: Path = REPO, shim: Path | None = None,
                    fsync_delay_ms: float = 0.0, history: int = 0, status_hz: float = 0.0) -> dict[str, object]:
    """One level: a fresh ingest (the code under ``code``) in a child process, ``subs`` posted at ``concurrency``."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="ingest-load-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
        if shim is not None:
            env["LD_PRELOAD"] = str(shim)
            env["INGEST_LOAD_FSYNC_DELAY_US"] = str(int(fsync_delay_ms * 1000))
        proc = subprocess.Popen([sys.executable, __file__, "--serve", tmp, "--code", str(code), "--history", str(history)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 600)
            if not line.startswith("PORT "):
                raise SystemExit(f"ingest did not start: {line!r}")
            server = psutil.Process(proc.pid)
            load0 = os.getloadavg()[0]
            cpu0 = sum(server.cpu_times()[:2])
            probe = await asyncio.to_thread(fsync_probe, Path(tmp), len(subs[0]))
            out = await load(int(line.split()[1]), subs, concurrency, max_s, status_hz)
            out["durable_write_ms_p50"] = round(probe * 1e3, 1)  # measured just before, same disk: the store's serialized step
            cpu = sum(server.cpu_times()[:2]) - cpu0
            out["ingest_cpu_ms_per_accepted"] = round(cpu * 1e3 / max(1, int(out["accepted"])), 2)  # type: ignore[call-overload]
            out["ingest_cpu_cores"] = round(cpu / float(out["wall_s"]), 2)  # type: ignore[arg-type]
            out["load"] = f"{load0:.1f} → {os.getloadavg()[0]:.1f}"
            proc.stdin.close()  # the child stops and prints its store's group-commit counts
            rest = await asyncio.wait_for(asyncio.to_thread(proc.stdout.read), 60)
            stats = next((json.loads(ln[6:]) for ln in rest.splitlines() if ln.startswith("STATS ")), {})
            groups = stats.get("groups", 0)
            out["per_group_mean_max"] = f"{stats['submissions'] / groups:.1f} / {stats['largest_group']}" if groups else "1 / 1"
            return {"concurrency": concurrency, **out}
        finally:
            _stop(proc)


async def main_async(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    if max(levels) > 64:
        raise SystemExit("--concurrency above 64: the server accepts 64 connections per address")
    per_worker = 4  # IngestLimits.max_pending_per_worker: nothing judges them here
    t = time.perf_counter()
    subs = build_submissions(args.submissions, -(-args.submissions // per_worker), per_worker, args.prompt_tokens, args.max_tokens,
                             args.tasks, args.group)
    size = statistics.mean(len(s) for s in subs)
    print(f"{len(subs)} signed submissions from {-(-args.submissions // per_worker)} worker keys, {size / 1024:.1f} KiB each "
          f"({args.tasks}×{args.group} rollouts, {args.prompt_tokens}+{args.max_tokens} tokens), built in {time.perf_counter() - t:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="ingest-load-code-") as tmp:
        shim = build_fsync_shim(Path(tmp)) if args.fsync_delay_ms > 0 else None
        codes = code_versions(args.baseline, Path(tmp))
        if shim is not None:
            print(f"every fsync/fdatasync of the ingest delayed by {args.fsync_delay_ms} ms (LD_PRELOAD shim)", flush=True)
        results = []
        for c in levels:
            for name, code in codes:
                r = await run_level(subs, c, args.max_s, code, shim, args.fsync_delay_ms, args.history, args.status_hz)
                r = {"code": name, **r}
                print(json.dumps(r), flush=True)
                results.append(r)
    print(f"\n{'code':26s}" + "".join(f"{r['code']:>20}" for r in results))
    for k in [k for k in results[0] if k != "code"]:
        print(f"{k:26s}" + "".join(f"{r.get(k)!s:>20s}" for r in results))


# --- Sybil pressure on leasing (--sybil) ----------------------------------------------------------

VALIDATOR_SEED = b"v" * 32


def sybil_spec():  # type: ignore[no-untyped-def]
    from protocol.identity import NodeKey
    from protocol.runspec import RunInfo, RunSpec

    return RunSpec(run=RunInfo(coordinator=NodeKey.from_seed(COORD_SEED).peer_id, validators=[NodeKey.from_seed(VALIDATOR_SEED).peer_id],
                               seed=1))


async def serve_sybil(root: Path, step_s: float, step_submissions: int, disk_files: int = 0, probation_share: float = 0.0) -> None:
    """Child process of ``--sybil``: the ingest with production limits and a simulated trainer;
    prints ``PORT <n>``, then ``STEP <n>`` per trainer step, and ``WORKERS <json>`` when stdin closes."""
    from aiohttp import web

    import trainer.ingest.service as ingest
    from node.http_server import start_site
    from protocol.window import oldest_fresh_step

    spec = sybil_spec()
    step = [0]
    try:
        from trainer.ledger import RecheckResult
    except ImportError:
        from trainer.ingest.service import RecheckResult  # type: ignore[attr-defined,no-redef]
    from protocol.identity import NodeKey

    def recheck(raw: bytes) -> RecheckResult:  # the junk is a cheat, and the re-check reproduces it
        return RecheckResult(False, "toploc", "junk", NodeKey.from_seed(COORD_SEED).peer_id)

    limits = ingest.IngestLimits()
    if disk_files:
        limits.max_disk_files = disk_files
    if probation_share:
        limits.probation_share = probation_share
    service, store = open_service(ingest, root, spec, trainer_step=lambda: step[0], recheck=recheck, limits=limits)
    app = web.Application(middlewares=[ingest.error_middleware], client_max_size=64 << 20)
    service.add_routes(app)
    running = await start_site(app, "127.0.0.1", 0)
    print(f"PORT {running.port}", flush=True)

    def train_once() -> bool:
        n = step[0]
        if hasattr(store, "trainable"):  # the ledger
            ready = store.trainable(n)
        else:
            ready = store.accepted_unconsumed(oldest_fresh_step(n, spec.rl.async_level))
        if len(ready) < step_submissions:
            return False
        ids = [r.id for r in sorted(ready, key=lambda r: -r.policy_step)[:step_submissions]]
        if hasattr(store, "retire_superseded"):  # the ledger
            store.consume(n + 1, {}, ids)
            store.retire_superseded(n + 1)
        else:
            store.mark_consumed(ids, n + 1)
        step[0] = n + 1
        return True

    async def trainer() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            if time.monotonic() - last >= step_s and await asyncio.to_thread(train_once):
                last = time.monotonic()
                print(f"STEP {step[0]}", flush=True)

    task = asyncio.create_task(trainer())
    await asyncio.to_thread(sys.stdin.read)
    task.cancel()
    await running.stop()
    service.close()
    print("WORKERS " + json.dumps(store.worker_stats()), flush=True)
    store.close()


def sybil_submission(key, counter: int, step: int) -> bytes:  # type: ignore[no-untyped-def]
    """A small submission of the spec's shape (2 tasks × group 8, 32 tokens)."""
    from protocol.envelope import seal
    from protocol.messages import Rollout, Submission, SubmissionTask

    rollouts = [Rollout(task=t, sample=k, seed=k, prompt_ids=b"\x01\x00\x00\x00" * 16, completion_ids=b"\x02\x00\x00\x00" * 32,
                        logprobs=b"\x00\x00\x80\xbf" * 32, finish="length", task_reward=0.0, reward=0.0, proofs=[b"\x00" * 258])
                for t in range(2) for k in range(8)]
    body = Submission(worker=key.peer_id, policy_step=step, counter=counter,
                      tasks=[SubmissionTask(task_index=t, problem_id=f"p{t}", target_length=0) for t in range(2)], rollouts=rollouts)
    return seal(key, sybil_spec().run_id, body)


async def sybil_level(code: Path, junk_addresses: int, args: argparse.Namespace) -> dict[str, object]:
    """One scenario: a fresh ingest (the code under ``code``), warm-up, then the measured window."""
    import aiohttp

    from protocol import encoding
    from protocol.envelope import open_envelope, seal
    from protocol.identity import NodeKey
    from protocol.messages import LeaseRequest, Submission, Verdict

    spec = sybil_spec()
    validator = NodeKey.from_seed(VALIDATOR_SEED)
    honest = [NodeKey.generate() for _ in range(args.honest)]
    newcomer = NodeKey.generate()
    honest_ids = {k.peer_id for k in honest} | {newcomer.peer_id}
    with tempfile.TemporaryDirectory(prefix="ingest-sybil-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, __file__, "--serve-sybil", tmp, "--code", str(code), "--step-s", str(args.step_s),
                                 "--step-submissions", str(args.step_submissions), "--disk-files", str(args.disk_files),
                                 "--probation-share", str(args.probation_share)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 600)
            if not line.startswith("PORT "):
                raise SystemExit(f"ingest did not start: {line!r}")
            url = f"http://127.0.0.1:{line.split()[1]}"
            step = [0]
            steps: list[float] = []
            lines: list[str] = []

            def follow() -> None:  # trainer steps as the child reports them
                assert proc.stdout is not None
                for ln in proc.stdout:
                    if ln.startswith("STEP "):
                        step[0] = int(ln.split()[1])
                        steps.append(time.monotonic())
                    else:
                        lines.append(ln)

            reader = asyncio.get_running_loop().run_in_executor(None, follow)
            stop = asyncio.Event()
            window: dict[str, float] = {}
            stats = {"honest_sent": 0, "honest_stored": 0, "honest_accepted": 0, "junk_stored": 0, "junk_judged": 0}
            honest_codes: dict[str, int] = {}
            junk_codes: dict[str, int] = {}
            leased_at: dict[str, float] = {}
            honest_wait: list[float] = []
            honest_post: list[float] = []  # seconds from sending an honest submission to its answer
            arrival: dict[str, float] = {}  # the newcomer's first POST, first stored, first accepted (monotonic s)
            newcomer_codes: dict[str, int] = {}

            def in_window() -> bool:
                return "start" in window and "end" not in window

            async def honest_worker(key, ip: str = "127.0.0.1", delay_s: float = 0.0) -> None:  # type: ignore[no-untyped-def]
                counter = 0
                is_new = key is newcomer
                await asyncio.sleep(delay_s)
                async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=30),
                                                 connector=aiohttp.TCPConnector(local_addr=(ip, 0))) as http:
                    while not stop.is_set():
                        data = sybil_submission(key, counter, step[0])
                        counter += 1
                        while not stop.is_set():
                            t0 = time.monotonic()
                            if is_new:
                                arrival.setdefault("post", t0)
                            try:
                                async with http.post("/ingest/1/submissions", data=data) as r:
                                    body = await r.json(content_type=None)
                            except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # counted; tried again in 1 s
                                (newcomer_codes if is_new else honest_codes)[type(e).__name__] = 1 + (
                                    newcomer_codes if is_new else honest_codes).get(type(e).__name__, 0)
                                await asyncio.sleep(1.0)
                                continue
                            if is_new:
                                code = str(body.get("error", r.status))
                                newcomer_codes[code] = newcomer_codes.get(code, 0) + 1
                                if r.status == 200:
                                    arrival.setdefault("stored", time.monotonic())
                            elif in_window():
                                stats["honest_sent"] += 1
                                honest_post.append(time.monotonic() - t0)
                                honest_codes[str(body.get("error", r.status))] = honest_codes.get(str(body.get("error", r.status)), 0) + 1
                            if r.status == 200:
                                if in_window() and not is_new:
                                    stats["honest_stored"] += 1
                                leased_at[body["id"]] = -t0  # stored at t0 (negative: not leased yet)
                                break
                            if r.status == 409:
                                break  # stale or replayed: a new one
                            await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                        await asyncio.sleep(1.0 / args.honest_rate)

            async def validate() -> None:
                async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=60)) as http:
                    while not stop.is_set():
                        req = seal(validator, spec.run_id, LeaseRequest(limit=8, lease_s=30.0))
                        async with http.post("/ingest/1/lease", data=req) as r:
                            got = encoding.unpackb(await r.read(), 1 << 30)["submissions"] if r.status == 200 else []
                        if not got:
                            await asyncio.sleep(0.1)
                        for raw in got:
                            sub = open_envelope(raw, run_id=spec.run_id, expect=Submission)
                            sid = sub.id.hex()
                            ok = sub.body.worker in honest_ids
                            if ok and leased_at.get(sid, 0) < 0:
                                if in_window():
                                    honest_wait.append(time.monotonic() + leased_at[sid])
                                leased_at[sid] = 1.0
                            await asyncio.sleep(1.0 / args.validator_rate)
                            v = seal(validator, spec.run_id, Verdict(submission_id=sub.id, worker=sub.body.worker, policy_step=sub.body.policy_step,
                                                                     counter=sub.body.counter, accepted=ok, reason="ok" if ok else "toploc"))
                            async with http.post("/ingest/1/verdicts", data=v) as r:
                                applied = (await r.json()).get("applied") if r.status == 200 else False
                            if ok and applied and sub.body.worker == newcomer.peer_id:
                                arrival.setdefault("accepted", time.monotonic())
                            if in_window() and applied:
                                stats["honest_accepted" if ok else "junk_judged"] += 1

            tasks = [asyncio.create_task(honest_worker(k)) for k in honest] + [asyncio.create_task(validate())]
            await asyncio.sleep(args.warmup_s)
            load0 = os.getloadavg()[0]
            cpu0 = process_cpu_s(proc.pid)
            window["start"] = time.monotonic()
            # the junk comes from its own process (its CPU is not this process's, which plays the honest side)
            flood = subprocess.Popen([sys.executable, __file__, "--junk", url, "--code", str(code), "--junk-addresses", str(junk_addresses)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) if junk_addresses else None
            if args.newcomer_after_s is not None:
                tasks.append(asyncio.create_task(honest_worker(newcomer, "127.200.0.1", args.newcomer_after_s)))
            await asyncio.sleep(args.duration_s)
            window["end"] = time.monotonic()
            ingest_cpu = process_cpu_s(proc.pid) - cpu0
            if flood is not None:
                assert flood.stdin is not None and flood.stdout is not None
                flood.stdin.close()
                out = await asyncio.wait_for(asyncio.to_thread(flood.stdout.read), 120)
                flood.wait(30)
                junk_codes.update(next((json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("CODES ")), {}))
                stats["junk_stored"] = junk_codes.get("200", 0)
            stop.set()
            await asyncio.wait(tasks, timeout=60)
            for t in tasks:
                t.cancel()
            proc.stdin.close()
            await asyncio.wait_for(reader, 120)
        finally:
            _stop(proc)
    workers = next((json.loads(ln[8:]) for ln in lines if ln.startswith("WORKERS ")), {})
    start, end = window["start"], window["end"]
    marks = [start] + [t for t in steps if start < t < end] + [end]
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    before = [b - a for a, b in itertools.pairwise(steps) if b <= start]
    span = end - start
    newcomer_figures = {} if args.newcomer_after_s is None else {
        "newcomer_admitted_s": round(arrival["stored"] - arrival["post"], 2) if "stored" in arrival and arrival["stored"] <= end else None,
        "newcomer_accepted_s": round(arrival["accepted"] - arrival["post"], 2) if "accepted" in arrival and arrival["accepted"] <= end else None,
        "newcomer_answers": newcomer_codes}
    return {"junk_addresses": junk_addresses, **newcomer_figures, "honest_accepted_per_s": round(stats["honest_accepted"] / span, 3),
            "trainer_steps": len(marks) - 2, "step_gap_max_s": round(max(gaps), 2),
            "step_gap_median_warmup_s": round(statistics.median(before), 2) if before else None,
            "honest_lease_wait_p50_s": round(pct(honest_wait, 0.5), 2) if honest_wait else None,
            "honest_lease_wait_max_s": round(max(honest_wait), 2) if honest_wait else None,
            "honest_stale": sum(workers.get(k, {}).get("stale", 0) for k in honest_ids),
            "honest_post_p50_s": round(pct(honest_post, 0.5), 3) if honest_post else None,
            "honest_post_max_s": round(max(honest_post), 2) if honest_post else None,
            "ingest_cpu_share": round(ingest_cpu / span, 2),
            "honest_sent": stats["honest_sent"], "honest_answers": honest_codes, "junk_stored": stats["junk_stored"],
            "junk_judged": stats["junk_judged"], "junk_answers": junk_codes, "load": f"{load0:.1f} → {os.getloadavg()[0]:.1f}"}


def admission_child(disk_files: int) -> None:
    """Child of ``--admission`` (the ledger of the code on ``sys.path``): prints ``ADMISSION <json>``."""
    from protocol.envelope import open_envelope
    from protocol.identity import NodeKey
    from protocol.messages import Submission
    from trainer.errors import Refused
    from trainer.ledger import BanBook, SubmissionLedger
    from trainer.ledger.ledger import Quotas

    spec = sybil_spec()
    root = Path(tempfile.mkdtemp(prefix="ingest-admission-"))
    quotas = Quotas(max_disk_files=disk_files, max_pending_per_ip=1 << 20)
    ledger = SubmissionLedger(root, spec, BanBook(root / "bans.msgpack", NodeKey.from_seed(COORD_SEED), spec.run_id), trainer_step=lambda: 0,
                              latest_policy_step=lambda: 0, quotas=quotas)
    share = int(quotas.probation_share * disk_files)
    envs = [open_envelope(sybil_submission(NodeKey.generate(), 0, 0), run_id=spec.run_id, expect=Submission) for _ in range(share + 600)]
    flood = [f"10.{i % 16}.0.{1 + (i // 16) % 250}" for i in range(share)]  # 16 /24s
    out: dict[str, object] = {"share": share}

    def ms(samples: list[float]) -> str:
        return f"{statistics.median(samples) * 1e3:.3f} / {max(samples) * 1e3:.2f}"

    def one_by_one(items: list[tuple[object, str]]) -> list[float]:  # admit each after the previous one's commit
        spent = []
        for env, address in items:
            t0 = time.perf_counter()
            try:
                adm = ledger.admit(env, address)  # type: ignore[arg-type]
            except Refused:
                spent.append(time.perf_counter() - t0)
                continue
            spent.append(time.perf_counter() - t0)
            if adm.durable is not None:
                adm.durable.result()
            time.sleep(0.005)
        return spent

    def calls(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
        spent = []
        for i in range(n):
            t0 = time.perf_counter()
            with contextlib.suppress(Refused):
                fn(i)
            spent.append(time.perf_counter() - t0)
        return spent

    room = min(100, share // 2)
    out["admit_with_room_ms"] = ms(one_by_one(list(zip(envs[:room], flood[:room], strict=True))))
    for f in [ledger.admit(env, a).durable for env, a in zip(envs[room:share], flood[room:], strict=True)]:
        f.result()  # type: ignore[union-attr]
    out["precheck_flood_prefix_ms"] = ms(calls(lambda i: ledger.precheck("10.3.0.7"), 300))
    out["precheck_new_prefix_ms"] = ms(calls(lambda i: ledger.precheck(f"10.200.{i % 250}.1"), 300))
    out["admit_flood_prefix_ms"] = ms(one_by_one([(env, "10.3.0.7") for env in envs[share:share + 200]]))
    n_new = min(300, share // 2)  # each can displace: the flood's prefixes still hold more than one each after them
    out["admit_new_prefix_ms"] = ms(one_by_one([(env, f"10.{100 + i % 150}.{i // 150}.1")
                                                for i, env in enumerate(envs[share + 200:share + 200 + n_new])]))
    counts = ledger.counts()
    out["pending_after"], out["displaced"] = counts["pending"], counts.get("displaced", 0)
    ledger.close()
    print("ADMISSION " + json.dumps(out), flush=True)


def admission_main(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ingest-admission-code-") as tmp:
        codes = code_versions(args.baseline, Path(tmp), whole=True)
        results = []
        for name, code in codes:
            env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
            run = subprocess.run([sys.executable, __file__, "--admission-child", "--code", str(code), "--disk-files", str(args.disk_files or 4096)],
                                 env=env, capture_output=True, text=True, check=True)
            results.append((name, json.loads(next(ln[10:] for ln in run.stdout.splitlines() if ln.startswith("ADMISSION ")))))
    print(f"\nAdmission while probation's share ({results[0][1]['share']} files) is full, median / max ms per call "
          f"(load {load0[0]:.1f} → {os.getloadavg()[0]:.1f})")
    print(f"{'':28s}" + "".join(f"{name:>24s}" for name, _ in results))
    for k in [k for k in results[0][1] if k != "share"]:
        print(f"{k:28s}" + "".join(f"{r.get(k)!s:>24s}" for _, r in results))


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def junk_flood(url: str, addresses: int) -> None:
    """Child process of ``--sybil``: junk from ``addresses`` addresses (127.i.0.1), a fresh key per
    submission, as fast as the ingest takes them (a refusal: 0.2 s pause); prints ``CODES <json>``
    when stdin closes."""
    import aiohttp

    from protocol.identity import NodeKey

    codes: dict[str, int] = {}
    step = [0]

    async def flood(ip: str) -> None:
        async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(local_addr=(ip, 0), limit=4),
                                         timeout=aiohttp.ClientTimeout(total=30)) as http:
            while True:
                try:
                    async with http.post("/ingest/1/submissions", data=sybil_submission(NodeKey.generate(), 0, step[0])) as r:
                        body = await r.json(content_type=None)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    await asyncio.sleep(0.2)
                    continue
                code = "200" if r.status == 200 else str(body.get("error", r.status))
                codes[code] = codes.get(code, 0) + 1
                if code == "stale_policy":
                    step[0] += 1  # follow the trainer
                if r.status != 200:
                    await asyncio.sleep(0.2)

    async def follow_status() -> None:
        async with aiohttp.ClientSession(base_url=url) as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get("/status") as r:
                        if r.status == 200:
                            step[0] = int((await r.json())["trainer_step"])
                await asyncio.sleep(1.0)

    status = asyncio.create_task(follow_status())
    await asyncio.sleep(1.0)  # the trainer's step first: junk inside the window
    tasks = [asyncio.create_task(flood(f"127.{1 + i}.0.1")) for i in range(addresses)] + [status]
    await asyncio.to_thread(sys.stdin.read)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print("CODES " + json.dumps(codes), flush=True)


async def sybil_main(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.sybil.split(",")]
    with tempfile.TemporaryDirectory(prefix="ingest-sybil-code-") as tmp:
        codes = code_versions(args.baseline, Path(tmp), whole=True)
        results = []
        for n in levels:
            for name, code in codes:
                r = {"code": name, **(await sybil_level(code, n, args))}
                print(json.dumps(r), flush=True)
                results.append(r)
    for name, _ in codes:
        calm = next((r for r in results if r["code"] == name and r["junk_addresses"] == 0), None)
        for r in results:
            if r["code"] == name and calm is not None and calm["honest_accepted_per_s"]:
                r["honest_vs_unattacked"] = round(float(r["honest_accepted_per_s"]) / float(calm["honest_accepted_per_s"]), 2)  # type: ignore[arg-type]
                median = calm.get("step_gap_median_warmup_s") or 0
                r["gap_vs_normal_step"] = round(float(r["step_gap_max_s"]) / float(median), 2) if median else None  # type: ignore[arg-type]
    print(f"\nSybil pressure: {args.honest} honest workers × {args.honest_rate}/s, validator {args.validator_rate}/s, "
          f"{args.duration_s:.0f} s measured after {args.warmup_s:.0f} s warm-up")
    print(f"{'':26s}" + "".join(f"{r['code'] + ' / ' + str(r['junk_addresses']):>24}" for r in results))
    ratios = ["honest_vs_unattacked", "gap_vs_normal_step"]
    for k in [k for k in results[0] if k not in ("code", "junk_addresses", *ratios)] + ratios:
        print(f"{k:26s}" + "".join(f"{r.get(k)!s:>24s}" for r in results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--code", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--serve-relay", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--relay", action="store_true", help="measure a relay (concurrent clients, aggregate bytes/s) instead of the ingest")
    p.add_argument("--relay-mib", type=int, default=64, help="relay mode: checkpoint size, MiB (default 64)")
    p.add_argument("--clients", default="1,8,32", help="relay mode: concurrent clients, comma-separated levels (default 1,8,32)")
    p.add_argument("--submissions", type=int, default=1200, help="submissions per concurrency level (default 1200)")
    p.add_argument("--concurrency", default="4,16,48", help="requests in flight, comma-separated levels (default 4,16,48; ≤ 64)")
    p.add_argument("--max-s", type=float, default=60.0, help="time limit per level, seconds (default 60)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per rollout (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens per rollout (default 32, the run spec's)")
    p.add_argument("--tasks", type=int, default=2, help="tasks per submission (default 2, the run spec's)")
    p.add_argument("--group", type=int, default=8, help="rollouts per task (default 8, the run spec's)")
    p.add_argument("--baseline", metavar="REV[,REV]", help="also measure the ingest code of these git revisions, alternating, side by side")
    p.add_argument("--history", type=int, default=0, help="index rows of earlier, trained-on submissions in the store first (a long run)")
    p.add_argument("--status-hz", type=float, default=0.0, help="also GET /status this many times a second during the load (default 0: no)")
    p.add_argument("--fsync-delay-ms", type=float, default=0.0, help="delay every fsync of the ingest by this much (a slow disk), ms")
    p.add_argument("--serve-sybil", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--junk", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--junk-addresses", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sybil", metavar="N[,N]", help="fair leasing under junk from N addresses (0: unattacked), side by side")
    p.add_argument("--honest", type=int, default=4, help="sybil mode: honest workers (default 4)")
    p.add_argument("--honest-rate", type=float, default=0.5, help="sybil mode: submissions per second per honest worker (default 0.5)")
    p.add_argument("--validator-rate", type=float, default=10.0, help="sybil mode: judgements per second (default 10)")
    p.add_argument("--step-s", type=float, default=1.0, help="sybil mode: shortest trainer step, seconds (default 1)")
    p.add_argument("--step-submissions", type=int, default=4, help="sybil mode: accepted submissions a trainer step consumes (default 4)")
    p.add_argument("--warmup-s", type=float, default=15.0, help="sybil mode: honest-only warm-up, seconds (default 15)")
    p.add_argument("--duration-s", type=float, default=60.0, help="sybil mode: measured window, seconds (default 60)")
    p.add_argument("--newcomer-after-s", type=float, default=None,
                   help="sybil mode: a new honest worker from a prefix of its own starts this many seconds into the window (default: none)")
    p.add_argument("--probation-share", type=float, default=0.0,
                   help="sybil mode: probation's share of the disk quota (default 0: the production 0.5)")
    p.add_argument("--admission", action="store_true", help="admission's cost while probation's share is full (see the module docstring)")
    p.add_argument("--admission-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--disk-files", type=int, default=0,
                   help="sybil mode: the ingest's disk quota in files, probation's share half of it (default 0: the production 4,096)")
    args = p.parse_args()
    if args.code:  # server child: import the ingest from this tree (a --baseline revision or this checkout)
        sys.path.insert(0, args.code)
    if args.serve:
        asyncio.run(serve(Path(args.serve), args.history))
        return
    if args.serve_relay:
        asyncio.run(serve_relay(Path(args.serve_relay), args.relay_mib))
        return
    if args.junk:
        asyncio.run(junk_flood(args.junk, args.junk_addresses))
        return
    if args.serve_sybil:
        asyncio.run(serve_sybil(Path(args.serve_sybil), args.step_s, args.step_submissions, args.disk_files, args.probation_share))
        return
    if args.admission_child:
        admission_child(args.disk_files or 4096)
        return
    if args.admission:
        admission_main(args)
        return
    if args.sybil:
        asyncio.run(sybil_main(args))
        return
    if args.relay:
        asyncio.run(relay_main(args))
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
