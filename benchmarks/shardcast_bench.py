"""Shardcast benchmark on 127.0.0.1: origin → 2 relays → 4 clients (each using both relays).

What is timed, for ours and for the reference alike: the origin and both relays are running and
the 4 client processes are started (imports done, polling for the new step) *before* the clock
starts; the clock starts when the publish starts and stops when the last client holds a verified
copy (each client reports the ``time.monotonic()`` of its finish; on Linux that clock is shared
by all processes). So the time covers publish → relays → clients with no process start-up.

* **ours**: origin and relays are ``intellect-node join --role relay`` processes; the publish is
  the library call the trainer makes (``publish_checkpoint``, with fsync) into the origin's
  store; clients call ``fetch_checkpoint`` (the code behind ``intellect-node fetch``). Piece size
  is a run-spec choice (``--piece-size``, default 4 MiB here so that relays pipeline).
* **reference** ``shardcast==0.3.2`` (a separate virtualenv, ``--ref-python``), same topology,
  same shard size, relay check interval 1 s; its client needs ``wget`` and a ``data1.bin`` probe
  file in every served directory (created here); the origin broadcasts from a running process.
  Every shardcast downloader (relays and clients) first fetches ``data1.bin`` from each upstream
  into the fixed path ``/tmp/dummy.bin``: two starting at once race on it and one dies ("Failed to
  download dummy file"), so the relays are started one after the other, each once the previous
  serves (clients retry on their own).
* **limit**: one single-stream HTTP GET of the checkpoint from an aiohttp server to a file.
* **client peak RSS** (``VmHWM`` of a client process) for a 64 MiB and a full-size checkpoint.

Each measurement is repeated ``--repeat`` times (fresh checkpoint content each time) and the
median is reported, since the machine may be shared.
Needs, for the reference leg: ``python3 -m venv /tmp/ref && /tmp/ref/bin/pip install shardcast==0.3.2``,
``wget`` on PATH, and a writable ``/tmp/dummy.bin``; without them it stops at once saying which
(or pass ``--skip-reference``).

Run: ``python benchmarks/shardcast_bench.py [--size-mib 256] [--repeat 3] [--ref-python /tmp/ref/bin/python]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
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


# --- ours ----------------------------------------------------------------------------------------


def start_clients(procs: Procs, argv_for: list[list[str]], env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start client processes and wait until each printed READY (imports done, polling)."""
    cl = [procs.start(a, stdout=subprocess.PIPE, env=env) for a in argv_for]
    for p in cl:
        assert p.stdout is not None
        if p.stdout.readline().strip() != b"READY":
            raise SystemExit(f"a client did not start (see {procs.log.name})")
    return cl


def client_results(cl: list[subprocess.Popen], timeout_s: float) -> list[tuple[float, float]]:
    """(finish time, peak RSS MiB) of each client, from its DONE line.

    Peak RSS is the process's ``VmHWM`` (``ru_maxrss`` would include the RSS of this large
    benchmark process, inherited across fork + exec)."""
    out = []
    end = time.monotonic() + timeout_s
    for p in cl:
        p.wait(timeout=max(1.0, end - time.monotonic()))
        assert p.stdout is not None
        line = p.stdout.read().decode().split()
        if p.returncode or len(line) != 3 or line[0] != "DONE":
            raise SystemExit(f"a client failed ({p.returncode}, {line})")
        out.append((float(line[1]), int(line[2]) / 1024))
    return out


def run_ours(work: Path, args: argparse.Namespace, procs: Procs) -> dict[str, list[float]]:
    from node.cli import load_key, load_spec
    from node.shardcast.publish import publish_checkpoint
    from node.shardcast.store import ShardcastStore

    key = work / "coord.key"
    spec = work / "run.toml"
    subprocess.run([*NODE, "keygen", "--key", str(key)], check=True, capture_output=True)
    subprocess.run(
        [*NODE, "spec", "init", "--coordinator-key", str(key), "--out", str(spec), "--piece-size", str(args.piece_size), "--keep-steps", "4"],
        check=True, capture_output=True,
    )
    signed, coord = load_spec(str(spec)), load_key(str(key))
    p0, pa, pb = free_port(), free_port(), free_port()
    origin = work / "origin"
    procs.start([*NODE, "join", "--role", "relay", "--run", str(spec), "--data-dir", str(origin), "--http-port", str(p0)])
    for port, d in ((pa, "ra"), (pb, "rb")):
        procs.start([*NODE, "join", "--role", "relay", "--run", str(spec), "--data-dir", str(work / d), "--http-port", str(port),
                     "--upstream", f"http://127.0.0.1:{p0}"])
    relays = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    for url in [f"http://127.0.0.1:{p0}", *relays]:
        wait_for(lambda u=url: http_json(f"{u}/shardcast/1/held") is not None, 60, f"{url} to serve")
    store = ShardcastStore(origin, run_id=signed.run_id, authorities=signed.spec.authorities, keep_steps=signed.spec.shardcast.keep_steps)

    def relays_hold(step: int) -> bool:
        return all(step in ((http_json(f"{u}/shardcast/1/held") or {}).get("held_steps") or []) for u in relays)

    out: dict[str, list[float]] = {"publish_s": [], "relays_s": [], "total_s": [], "rss": [], "rss_64": []}
    runs = [(args.size_mib, r) for r in range(args.repeat)] + [(64, args.repeat)]
    for size, r in runs:
        step = r + 1
        ckpt = work / f"step{step}.safetensors"
        make_checkpoint(ckpt, size, seed=100 + step)
        cl = start_clients(procs, [[sys.executable, str(Path(__file__).resolve()), "--_our-client", str(spec), str(step),
                                    str(work / f"out-{step}-{i}"), *relays] for i in range(args.clients)])
        t0 = time.monotonic()
        publish_checkpoint(store, [ckpt], step=step, key=coord, piece_size_bytes=args.piece_size)
        t_pub = time.monotonic() - t0
        t_rel = float("nan")
        while any(p.poll() is None for p in cl) and time.monotonic() - t0 < 600:
            if math.isnan(t_rel) and relays_hold(step):
                t_rel = time.monotonic() - t0
            time.sleep(0.05)
        res = client_results(cl, 600)
        total = max(t for t, _ in res) - t0
        for i in range(args.clients):
            if (work / f"out-{step}-{i}" / ckpt.name).stat().st_size != ckpt.stat().st_size:
                raise SystemExit(f"client {i} copy has the wrong size")
            shutil.rmtree(work / f"out-{step}-{i}")
        ckpt.unlink()
        if size == 64 and r == args.repeat:
            out["rss_64"].append(max(m for _, m in res))
            print(f"ours       64 MiB checkpoint: total {total:.2f} s, client peak RSS {max(m for _, m in res):.0f} MiB", flush=True)
            continue
        out["publish_s"].append(t_pub)
        out["relays_s"].append(t_rel)
        out["total_s"].append(total)
        out["rss"].append(max(m for _, m in res))
        print(f"ours       run {r + 1}: publish {t_pub:.2f} s, both relays hold {t_rel:.2f} s, all {args.clients} clients verified {total:.2f} s"
              f" (client peak RSS {out['rss'][-1]:.0f} MiB)", flush=True)
    return out


OUR_CLIENT = """
import asyncio, sys, time
from pathlib import Path
from node.cli import load_spec
from node.errors import FetchError
from node.shardcast.client import fetch_checkpoint
from node.shardcast.download import DownloadConfig, make_session

async def main(spec, step, out, sources):
    signed = load_spec(spec)
    cfg = DownloadConfig()
    session = make_session(cfg)
    print("READY", flush=True)
    end = time.monotonic() + 600
    while True:
        try:
            await fetch_checkpoint(sources, Path(out), run_id=signed.run_id, authorities=signed.spec.authorities, step=int(step),
                                   config=cfg, progress=False, session=session)
            break
        except FetchError as e:
            if "no source has a valid manifest" not in str(e) or time.monotonic() > end:
                raise
            await asyncio.sleep(0.02)
    t = time.monotonic()
    await session.close()
    hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    print("DONE", t, hwm, flush=True)
"""


def our_client(spec: str, step: str, out: str, sources: list[str]) -> int:
    """One benchmark client process: ready first, then fetch the step as soon as a relay has its manifest."""
    import asyncio

    ns: dict = {}
    exec(OUR_CLIENT, ns)  # noqa: S102 - our own code, kept as text so the child imports only what it needs
    asyncio.run(ns["main"](spec, step, out, sources))
    return 0


# --- reference -----------------------------------------------------------------------------------

REF_ORIGIN = """
import sys, time
from shardcast import OriginServer
o = OriginServer(sys.argv[1], int(sys.argv[2]))
print("READY", flush=True)
for line in sys.stdin:
    o.broadcast(line.strip(), int(sys.argv[3]))
    print("DONE", flush=True)
"""

REF_CLIENT = """
import sys, time, logging
from shardcast import ClientNode
servers, out_dir, out_file, version = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4]
print("READY", flush=True)
end = time.time() + 900
while time.time() < end:
    try:
        if ClientNode(servers, output_dir=out_dir).download_version(version, out_file):
            hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
            print("DONE", time.monotonic(), hwm, flush=True)
            sys.exit(0)
    except Exception as e:
        pass
    time.sleep(0.2)
sys.exit(1)
"""


def check_reference(py: str) -> None:
    """Stop at once, in one line, unless the reference leg can run: ``py`` has shardcast 0.3.2, wget
    is installed, ``/tmp/dummy.bin`` (shardcast's fixed probe path) is writable."""
    need = "python3 -m venv /tmp/ref && /tmp/ref/bin/pip install shardcast==0.3.2, then --ref-python /tmp/ref/bin/python"
    try:
        r = subprocess.run([py, "-c", "import importlib.metadata as m, shardcast; print(m.version('shardcast'))"],
                           capture_output=True, text=True, timeout=120, check=False)
    except OSError as e:
        raise SystemExit(f"reference: cannot run --ref-python {py} ({e.strerror}); {need} (or --skip-reference)") from None
    if r.returncode != 0 or r.stdout.strip() != "0.3.2":
        got = r.stdout.strip() or (r.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"reference: {py} has no shardcast 0.3.2 ({got[:120]}); {need} (or --skip-reference)")
    if shutil.which("wget") is None:
        raise SystemExit("reference: shardcast's client shells out to wget: apt-get install wget (or --skip-reference)")
    dummy = Path("/tmp/dummy.bin")
    if dummy.exists() and not os.access(dummy, os.W_OK):
        raise SystemExit(f"reference: shardcast writes its probe to {dummy}, which another user owns: remove it (or --skip-reference)")


def run_reference(work: Path, args: argparse.Namespace, procs: Procs) -> dict[str, list[float]]:
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
    def up(u: str, proc: subprocess.Popen | None = None) -> bool:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"reference relay at {u} exited ({proc.returncode}); see {work / 'processes.log'}")
        try:
            with urllib.request.urlopen(f"{u}/data1.bin", timeout=2):
                return True
        except OSError:
            return False

    wait_for(lambda: up(f"http://127.0.0.1:{p0}"), 60, f"reference origin http://127.0.0.1:{p0}")
    relays = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    for port, url in zip((pa, pb), relays):  # one after the other: both would race on /tmp/dummy.bin (module docstring)
        relay = procs.start([py, "-m", "shardcast.middle_node", "--upstream", f"http://127.0.0.1:{p0}", "--data-dir", str(dirs[port]),
                             "--port", str(port), "--check-interval", "1", "--log-level", "WARNING"], env=env)
        wait_for(lambda u=url, r=relay: up(u, r), 60, f"reference relay {url}")

    out: dict[str, list[float]] = {"publish_s": [], "total_s": [], "rss": []}
    for r in range(args.ref_repeat):
        version = f"v{r + 1}"
        ckpt = work / f"ref-{version}.safetensors"
        make_checkpoint(ckpt, args.size_mib, seed=200 + r)
        cl = start_clients(procs, [[py, "-c", REF_CLIENT, ",".join(relays), str(work / f"ref-dl-{version}-{i}"),
                                    str(work / f"ref-out-{version}-{i}.bin"), version] for i in range(args.clients)], env=env)
        t0 = time.monotonic()
        origin.stdin.write(f"{ckpt}\n".encode())
        origin.stdin.flush()
        if origin.stdout.readline().strip() != b"DONE":
            raise SystemExit("reference broadcast failed")
        t_pub = time.monotonic() - t0
        res = client_results(cl, 900)
        total = max(t for t, _ in res) - t0
        for i in range(args.clients):
            got = work / f"ref-out-{version}-{i}.bin"
            if got.stat().st_size != ckpt.stat().st_size:
                raise SystemExit(f"reference client {i} copy has the wrong size")
            got.unlink()
        out["publish_s"].append(t_pub)
        out["total_s"].append(total)
        out["rss"].append(max(m for _, m in res))
        print(f"reference  run {r + 1}: publish {t_pub:.2f} s, all {args.clients} clients verified {total:.2f} s"
              f" (client peak RSS {out['rss'][-1]:.0f} MiB)", flush=True)
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
    ap.add_argument("--piece-size", type=int, default=4 * MiB, help="piece/shard size in bytes for both systems (default 4 MiB)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs of ours and of the limit; medians are reported (default 3)")
    ap.add_argument("--ref-repeat", type=int, default=None, help="runs of the reference (default: --repeat)")
    ap.add_argument("--ref-python", default="/tmp/ref/bin/python",
                    help="python of a virtualenv with shardcast==0.3.2 (default /tmp/ref/bin/python: python3 -m venv /tmp/ref && "
                         "/tmp/ref/bin/pip install shardcast==0.3.2)")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--workdir", default=None, help="where to put the files (default: a temporary directory)")
    ap.add_argument("--_our-client", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._our_client:
        spec, step, out, *sources = args._our_client
        return our_client(spec, step, out, sources)
    if args.ref_repeat is None:
        args.ref_repeat = args.repeat
    if not args.skip_reference:
        check_reference(args.ref_python)  # before anything is measured: a missing reference stops at once, in one line
    work = Path(tempfile.mkdtemp(prefix="shardcast-bench-", dir=args.workdir))
    procs = Procs(work / "processes.log")
    med = statistics.median
    try:
        ckpt = work / "model.safetensors"
        make_checkpoint(ckpt, args.size_mib, seed=1)
        size = ckpt.stat().st_size / MiB
        print(f"checkpoint {size:.0f} MiB, piece {args.piece_size / MiB:g} MiB, origin → 2 relays → {args.clients} clients, "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; medians of {args.repeat} runs", flush=True)
        limits = [run_limit(work, ckpt, procs) for _ in range(args.repeat)]
        ckpt.unlink()
        limit_s = med(limits)
        print(f"limit      single-stream aiohttp GET: {', '.join(f'{x:.2f}' for x in limits)} s → median {limit_s:.2f} s ({size / limit_s:.0f} MiB/s)", flush=True)
        ours = run_ours(work, args, procs)
        ref = None if args.skip_reference else run_reference(work, args, procs)
        o_total = med(ours["total_s"])
        print("summary (medians; time from the start of the publish until all clients hold a verified copy)")
        print(f"  ours       publish {med(ours['publish_s']):.2f} s, relays hold {med(ours['relays_s']):.2f} s, all clients {o_total:.2f} s")
        if ref:
            r_total = med(ref["total_s"])
            print(f"  reference  publish {med(ref['publish_s']):.2f} s, all clients {r_total:.2f} s")
            print(f"  reference / ours:                          {r_total / o_total:5.1f}×   (goal ≥ 5×)")
        agg = args.clients * size / o_total
        print(f"  ours aggregate client throughput / limit:  {agg / (size / limit_s):5.0%}   ({agg:.0f} vs {size / limit_s:.0f} MiB/s; goal ≥ 50%)")
        print(f"  ours per-client throughput / limit:        {size / o_total / (size / limit_s):5.0%}   ({args.clients} clients, 2 relays and the origin share {os.cpu_count()} CPUs)")
        print(f"  client peak RSS: 64 MiB checkpoint {med(ours['rss_64']):.0f} MiB, {args.size_mib} MiB checkpoint {med(ours['rss']):.0f} MiB"
              + (f" (reference {med(ref['rss']):.0f} MiB)" if ref else ""))
        return 0
    finally:
        procs.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
