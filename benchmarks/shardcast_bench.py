"""Shardcast benchmark on 127.0.0.1: origin → 2 relays → 4 clients (each using both relays).

Prints, for one checkpoint (default 256 MiB of safetensors):

* **ours, phased**: publish on a running origin → both relays hold the step (``/held``), then 4
  ``intellect-node fetch`` processes at once → all hold a verified copy;
* **ours, pipelined**: the same, but the clients start together with the publish (cut-through);
* **reference** ``shardcast==0.3.2`` (from a separate virtualenv, ``--ref-python``), same topology
  and phases, same piece size, relay poll interval 1 s like ours; its client needs ``wget`` and a
  ``data1.bin`` probe file in every served directory (created here);
* **limit**: one single-stream HTTP GET of the checkpoint from an aiohttp server to a file;
* **client peak RSS** of ``intellect-node fetch`` for a 64 MiB and a 256 MiB checkpoint.

Every process is separate (as in a deployment); times include process start-up of the clients.
Run: ``python benchmarks/shardcast_bench.py [--size-mib 256] [--ref-python /work/refenv-shardcast/bin/python]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

NODE = [sys.executable, "-c", "import sys; from node.cli import main; sys.exit(main())"]
MiB = 1 << 20


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def make_checkpoint(path: Path, size_mib: int, seed: int) -> None:
    import numpy as np  # here, so the client wrapper processes stay light
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    per = size_mib * MiB // 4 // 8
    save_file({f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(8)}, str(path))


class Procs:
    """Child processes in their own sessions, all killed on exit."""

    def __init__(self, log: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.log = open(log, "ab")  # noqa: SIM115

    def start(self, args: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(args, stdout=kw.pop("stdout", self.log), stderr=self.log, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.log.close()


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def http_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def wait_exit_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    end = time.monotonic() + timeout_s
    for p in procs:
        p.wait(timeout=max(1.0, end - time.monotonic()))
    return [p.returncode for p in procs]


RSS_WRAPPER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mib(args: list[str]) -> tuple[int, float]:
    """Run ``args`` to completion; return (exit status, peak RSS in MiB).

    Measured from a small wrapper process: a child's ``ru_maxrss`` starts from the RSS of the
    process it was forked from, so forking from this (large) benchmark process would inflate it.
    """
    r = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *args], capture_output=True, text=True, check=True)
    code, kib = r.stdout.split()
    return int(code), int(kib) / 1024


# --- ours ----------------------------------------------------------------------------------------


def run_ours(work: Path, ckpt: Path, args: argparse.Namespace, procs: Procs) -> dict[str, float]:
    key = work / "coord.key"
    spec = work / "run.toml"
    subprocess.run([*NODE, "keygen", "--key", str(key)], check=True, capture_output=True)
    subprocess.run(
        [*NODE, "spec", "init", "--coordinator-key", str(key), "--out", str(spec), "--piece-size", str(args.piece_size), "--keep-steps", "4"],
        check=True, capture_output=True,
    )
    p0, pa, pb = free_port(), free_port(), free_port()
    origin = work / "origin"
    procs.start([*NODE, "join", "--role", "relay", "--run", str(spec), "--data-dir", str(origin), "--http-port", str(p0)])
    for port, d in ((pa, "ra"), (pb, "rb")):
        procs.start([*NODE, "join", "--role", "relay", "--run", str(spec), "--data-dir", str(work / d), "--http-port", str(port),
                     "--upstream", f"http://127.0.0.1:{p0}"])
    relays = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    for url in [f"http://127.0.0.1:{p0}", *relays]:
        wait_for(lambda u=url: http_json(f"{u}/shardcast/1/held") is not None, 60, f"{url} to serve")

    def relays_hold(step: int) -> bool:
        return all(step in ((http_json(f"{u}/shardcast/1/held") or {}).get("held_steps") or []) for u in relays)

    def clients(step: int, tag: str) -> list[subprocess.Popen]:
        return [
            procs.start([sys.executable, str(Path(__file__).resolve()), "--_our-client", str(spec), str(step), str(work / f"out-{tag}-{i}"), *relays])
            for i in range(args.clients)
        ]

    out: dict[str, float] = {}
    # phased: relays first, then the clients
    t0 = time.monotonic()
    subprocess.run([*NODE, "publish", str(ckpt), "--step", "1", "--run", str(spec), "--key", str(key), "--data-dir", str(origin)], check=True, capture_output=True)
    out["publish_s"] = time.monotonic() - t0
    wait_for(lambda: relays_hold(1), 600, "relays to hold step 1")
    out["relays_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    codes = wait_exit_all(clients(1, "phased"), 600)
    out["clients_s"] = time.monotonic() - t1
    out["total_s"] = time.monotonic() - t0
    if any(codes):
        raise SystemExit(f"our clients failed: {codes} (see {procs.log.name})")
    # pipelined: clients start with the publish of step 2
    ckpt2 = work / "step2.safetensors"
    make_checkpoint(ckpt2, args.size_mib, seed=2)
    t0 = time.monotonic()
    cl = clients(2, "piped")
    subprocess.run([*NODE, "publish", str(ckpt2), "--step", "2", "--run", str(spec), "--key", str(key), "--data-dir", str(origin)], check=True, capture_output=True)
    codes = wait_exit_all(cl, 600)
    out["pipelined_total_s"] = time.monotonic() - t0
    if any(codes):
        raise SystemExit(f"our pipelined clients failed: {codes}")
    for i in range(args.clients):
        got = work / f"out-phased-{i}" / ckpt.name
        if got.stat().st_size != ckpt.stat().st_size:
            raise SystemExit(f"client {i} copy has the wrong size")
    # client peak RSS for two checkpoint sizes
    for size in (64, args.size_mib):
        small = work / f"rss-{size}.safetensors"
        make_checkpoint(small, size, seed=size)
        step = 10 + size
        subprocess.run([*NODE, "publish", str(small), "--step", str(step), "--run", str(spec), "--key", str(key), "--data-dir", str(origin)], check=True, capture_output=True)
        wait_for(lambda s=step: relays_hold(s), 600, f"relays to hold step {step}")
        code, rss = peak_rss_mib([*NODE, "fetch", "--run", str(spec), "--step", str(step), "--source", relays[0], "--source", relays[1],
                                  "--out", str(work / f"rss-out-{size}")])
        if code:
            raise SystemExit(f"RSS fetch failed ({code})")
        out[f"rss_{size}_mib"] = rss
        small.unlink()
    return out


def our_client(spec: str, step: str, out: str, sources: list[str]) -> int:
    """One benchmark client: retry `fetch` until the step is available (at most 600 s)."""
    end = time.monotonic() + 600
    while time.monotonic() < end:
        cmd = [*NODE, "fetch", "--run", spec, "--step", step, "--out", out]
        for s in sources:
            cmd += ["--source", s]
        if subprocess.run(cmd, check=False, capture_output=True).returncode == 0:
            return 0
        time.sleep(0.2)
    return 1


# --- reference -----------------------------------------------------------------------------------

REF_ORIGIN = """
import sys, time
from shardcast import OriginServer
o = OriginServer(sys.argv[1], int(sys.argv[2]))
print("READY", flush=True)
path = sys.stdin.readline().strip()
o.broadcast(path, int(sys.argv[3]))
print("DONE", flush=True)
while True:
    time.sleep(1)
"""

REF_CLIENT = """
import sys, time, logging
from shardcast import ClientNode
servers, out_dir, out_file = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
end = time.time() + 600
while time.time() < end:
    try:
        if ClientNode(servers, output_dir=out_dir).download_version("v1", out_file):
            sys.exit(0)
    except Exception as e:
        pass
    time.sleep(0.2)
sys.exit(1)
"""


def run_reference(work: Path, ckpt: Path, args: argparse.Namespace, procs: Procs) -> dict[str, float]:
    py = args.ref_python
    env = {**os.environ, "SHARDCAST_LOG_LEVEL": "WARNING", "SHARDCAST_SHARD_SIZE": str(args.piece_size)}
    p0, pa, pb = free_port(), free_port(), free_port()
    dirs = {p0: work / "ref-origin", pa: work / "ref-ra", pb: work / "ref-rb"}
    for d in dirs.values():
        d.mkdir(parents=True)
        (d / "data1.bin").write_bytes(os.urandom(MiB))
    origin = procs.start([py, "-c", REF_ORIGIN, str(dirs[p0]), str(p0), str(args.piece_size)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert origin.stdout is not None and origin.stdin is not None
    if origin.stdout.readline().strip() != b"READY":
        raise SystemExit("reference origin did not start")
    for port in (pa, pb):
        procs.start([py, "-m", "shardcast.middle_node", "--upstream", f"http://127.0.0.1:{p0}", "--data-dir", str(dirs[port]),
                     "--port", str(port), "--check-interval", "1", "--log-level", "WARNING"], env=env)
    relays = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    for url in [f"http://127.0.0.1:{p0}", *relays]:
        def up(u: str = url) -> bool:
            try:
                with urllib.request.urlopen(f"{u}/data1.bin", timeout=2):
                    return True
            except OSError:
                return False
        wait_for(up, 60, f"reference {url}")
    n = math.ceil(ckpt.stat().st_size / args.piece_size)

    def relay_holds(d: Path) -> bool:
        v = d / "v1"
        return v.is_dir() and len([p for p in v.iterdir() if p.suffix == ".bin"]) == n and not any(p.suffix == ".tmp" for p in v.iterdir())

    out: dict[str, float] = {}
    t0 = time.monotonic()
    origin.stdin.write(f"{ckpt}\n".encode())
    origin.stdin.flush()
    if origin.stdout.readline().strip() != b"DONE":
        raise SystemExit("reference broadcast failed")
    out["publish_s"] = time.monotonic() - t0
    wait_for(lambda: relay_holds(dirs[pa]) and relay_holds(dirs[pb]), 900, "reference relays", interval_s=0.1)
    out["relays_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    cl = [procs.start([py, "-c", REF_CLIENT, ",".join(relays), str(work / f"ref-dl-{i}"), str(work / f"ref-out-{i}.bin")], env=env)
          for i in range(args.clients)]
    codes = wait_exit_all(cl, 900)
    out["clients_s"] = time.monotonic() - t1
    out["total_s"] = time.monotonic() - t0
    if any(codes):
        raise SystemExit(f"reference clients failed: {codes}")
    return out


# --- local limit ---------------------------------------------------------------------------------

LIMIT_SERVER = """
import sys
from aiohttp import web
app = web.Application()
app.router.add_get("/f", lambda r: web.FileResponse(sys.argv[1]))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""

LIMIT_CLIENT = """
import asyncio, sys, time, aiohttp
async def main():
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        t = time.monotonic()
        async with s.get(sys.argv[1]) as r:
            with open(sys.argv[2], "wb") as f:
                async for chunk in r.content.iter_chunked(1 << 20):
                    f.write(chunk)
        print(time.monotonic() - t)
asyncio.run(main())
"""


def run_limit(work: Path, ckpt: Path, procs: Procs) -> float:
    port = free_port()
    procs.start([sys.executable, "-c", LIMIT_SERVER, str(ckpt), str(port)])

    def up() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(up, 30, "limit server")
    r = subprocess.run([sys.executable, "-c", LIMIT_CLIENT, f"http://127.0.0.1:{port}/f", str(work / "limit.out")],
                       check=True, capture_output=True, text=True)
    return float(r.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256, help="checkpoint size in MiB (default 256)")
    ap.add_argument("--piece-size", type=int, default=16 * MiB, help="piece/shard size in bytes for both systems (default 16 MiB)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--ref-python", default="/work/refenv-shardcast/bin/python", help="python of a virtualenv with shardcast==0.3.2")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--workdir", default=None, help="where to put the files (default: a temporary directory)")
    ap.add_argument("--_our-client", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._our_client:
        spec, step, out, *sources = args._our_client
        return our_client(spec, step, out, sources)
    work = Path(tempfile.mkdtemp(prefix="shardcast-bench-", dir=args.workdir))
    procs = Procs(work / "processes.log")
    try:
        ckpt = work / "model.safetensors"
        make_checkpoint(ckpt, args.size_mib, seed=1)
        size = ckpt.stat().st_size
        print(f"checkpoint {size / MiB:.0f} MiB, piece {args.piece_size / MiB:g} MiB, origin → 2 relays → {args.clients} clients, {os.cpu_count()} CPUs")
        limit_s = run_limit(work, ckpt, procs)
        print(f"limit      single-stream aiohttp GET: {limit_s:6.2f} s ({size / MiB / limit_s:6.0f} MiB/s)")
        ours = run_ours(work, ckpt, args, procs)
        print(f"ours       publish {ours['publish_s']:.2f} s, relays hold {ours['relays_s']:.2f} s, 4 clients +{ours['clients_s']:.2f} s → total {ours['total_s']:.2f} s")
        print(f"ours       pipelined (clients start with the publish): total {ours['pipelined_total_s']:.2f} s")
        ref = None
        if not args.skip_reference:
            ref = run_reference(work, ckpt, args, procs)
            print(f"reference  publish {ref['publish_s']:.2f} s, relays hold {ref['relays_s']:.2f} s, 4 clients +{ref['clients_s']:.2f} s → total {ref['total_s']:.2f} s")
        print("ratios")
        if ref:
            print(f"  reference total / ours total (phased):     {ref['total_s'] / ours['total_s']:5.1f}×   (goal ≥ 5×)")
            print(f"  reference total / ours total (pipelined):  {ref['total_s'] / ours['pipelined_total_s']:5.1f}×")
            print(f"  reference clients / ours clients:          {ref['clients_s'] / ours['clients_s']:5.1f}×")
        per_client = size / MiB / ours["clients_s"]
        print(f"  ours per-client throughput / limit:       {per_client / (size / MiB / limit_s):5.0%}   ({per_client:.0f} vs {size / MiB / limit_s:.0f} MiB/s; 4 clients share the CPUs)")
        print(f"  ours aggregate client throughput / limit: {args.clients * per_client / (size / MiB / limit_s):5.0%}   (goal ≥ 50%)")
        print(f"  client peak RSS: 64 MiB checkpoint {ours['rss_64_mib']:.0f} MiB, {args.size_mib} MiB checkpoint {ours[f'rss_{args.size_mib}_mib']:.0f} MiB")
        return 0
    finally:
        procs.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
