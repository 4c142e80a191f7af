"""Shardcast step deltas: how small they are on real optimizer steps, and how much faster a step arrives.

Part 1 — **delta size on real steps.** A Qwen2 (default ≈ 125 M parameters: hidden 768, 12 layers,
vocabulary 32,000, untied head) is trained with the project's GRPO trainer and AdamW (fp32
masters) on synthetic GRPO batches at each learning rate of ``--lrs`` (INTELLECT-2 used 3e-7),
starting from the same initial weights; after each step the policy is published in bf16 (what
real runs publish) and the delta from the previous step is encoded. Printed per learning rate
and step: delta bytes / full checkpoint bytes, and the fraction of bf16 elements whose bits
changed. The weights start from the random initialisation (no pretrained checkpoint is
reachable here), so the weight magnitudes are those of a fresh model.

Part 2 — **time to the next step, delta vs full.** Origin → 2 relays → 4 clients on 127.0.0.1,
with the checkpoints of the middle learning rate. The relays (in this process) and the 4
clients (separate processes, started and polling before the clock starts) all hold step *s−1*;
the clock starts when the origin starts publishing step *s* and stops when the last client holds
a verified copy. **delta**: the origin publishes *s* with its delta, relays rebuild *s* from the
delta, clients apply it (``fetch_step``); **full**: the same step published without a delta,
relays and clients fetch all pieces (``fetch_checkpoint``). Each client reports its peak RSS
(``VmHWM``).

With ``--link-mibps R`` part 2 runs again with every hop (origin → each relay, each relay → its
clients) through a shared link capped at R MiB/s (an in-process forwarding proxy), since on an
uncapped loopback the network costs nothing and both modes are bound by local hashing and disk.

Run: ``python benchmarks/delta_bench.py [--hidden 768 --layers 12 --vocab 32000] [--steps 3] [--link-mibps 50]``.
Timings on a shared machine vary; both modes run in the same process, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20

CLIENT = r"""
import asyncio, json, sys, time
from pathlib import Path
from node.errors import FetchError
from node.shardcast.client import fetch_checkpoint
from node.shardcast.delta import fetch_step
from node.shardcast.download import DownloadConfig
from protocol.runspec import load_run_spec
mode, spec_path, out, held, step = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
sources = sys.argv[6:]
signed = load_run_spec(Path(spec_path))
cfg = DownloadConfig(stall_timeout_s=120, deadline_s=600)
print("ready", flush=True)
async def main():
    end = time.monotonic() + 600
    while True:
        try:
            if mode == "delta":
                r = await fetch_step(sources, out, run_id=signed.run_id, authorities=signed.spec.authorities, held_dir=held, step=step,
                                     config=cfg)
                return r.via, r.bytes_downloaded
            r = await fetch_checkpoint(sources, out, run_id=signed.run_id, authorities=signed.spec.authorities, step=step,
                                       config=cfg, progress=False)
            return "full", r.bytes_downloaded
        except FetchError as e:
            if "no source has a valid manifest" not in str(e) or time.monotonic() > end:
                raise
            await asyncio.sleep(0.02)
via, nbytes = asyncio.run(main())
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"done": time.monotonic(), "via": via, "bytes": nbytes, "vmhwm_kib": hwm}), flush=True)
"""


class Link:
    """A bandwidth-capped HTTP hop in front of ``upstream``: every byte it forwards, over all its
    connections together, waits its turn at ``rate_bps`` (a shared link of that capacity)."""

    def __init__(self, upstream: str, rate_bps: float) -> None:
        self.upstream, self.rate_bps = upstream, rate_bps
        self.url = ""
        self._t = 0.0
        self._runner = None
        self._session = None

    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request):  # noqa: ANN001, ANN202
        from aiohttp import web

        loop = asyncio.get_running_loop()
        async with self._session.get(self.upstream + request.path_qs) as up:  # type: ignore[union-attr]
            keep = {k: v for k, v in up.headers.items() if k.lower() in ("content-length", "content-type", "etag") or k.lower().startswith("x-shardcast")}
            resp = web.StreamResponse(status=up.status, headers=keep)
            try:
                await resp.prepare(request)
                async for chunk in up.content.iter_chunked(256 << 10):
                    now = loop.time()
                    self._t = max(self._t, now) + len(chunk) / self.rate_bps
                    if self._t > now:
                        await asyncio.sleep(self._t - now)
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionResetError:  # the client gave up on this request (aiohttp's reset error subclasses it)
                pass
            return resp


def train_policies(args: argparse.Namespace, lr: float, root: Path) -> list[Path]:
    import torch

    from protocol.models import build_model
    from trainer.model import tiny_qwen2_config
    from trainer.synthetic import synthetic_batch
    from trainer.train import Trainer, TrainerConfig

    cfg = tiny_qwen2_config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                            tie_word_embeddings=False)
    trainer = Trainer(build_model(cfg, seed=0), TrainerConfig(learning_rate=lr))
    n = sum(p.numel() for p in trainer.model.parameters())
    out = []
    for step in range(args.steps + 1):
        if step:
            t0 = time.monotonic()
            trainer.train_step(synthetic_batch(step, step - 1))
            print(f"  lr {lr:g}: trainer step {step} in {time.monotonic() - t0:.1f} s ({n / 1e6:.1f} M parameters)", flush=True)
        d = root / f"lr{lr:g}" / f"step-{step}"
        trainer.save_checkpoint(d, dtype=torch.bfloat16)
        out.append(d)
    del trainer
    return out


def delta_ratios(policies: list[Path]) -> list[tuple[int, int, int, int, int]]:
    """(step, delta bytes, full bytes, changed words, total words) per step."""
    import io

    from protocol.delta import encode_delta
    from protocol.shardcast import build_manifest

    rows = []
    mans = []
    for s, d in enumerate(policies):
        files = sorted(p for p in d.iterdir() if p.is_file())
        with_streams = [(p.name, open(p, "rb")) for p in files]
        mans.append(build_manifest(s, with_streams, piece_size_bytes=4 * MiB))
        for _, f in with_streams:
            f.close()
    for s in range(1, len(policies)):
        buf = io.BytesIO()
        stats = encode_delta(mans[s - 1], mans[s], lambda n, s=s: open(policies[s - 1] / n, "rb"),
                             lambda n, s=s: open(policies[s] / n, "rb"), buf)
        full = sum(f.size_bytes for f in mans[s].files)
        rows.append((s, len(buf.getvalue()), full, stats.changed_elements, stats.total_elements))
    return rows


async def distribute(mode: str, prev: Path, nxt: Path, work: Path, piece_size: int, link_bps: float = 0.0) -> dict[str, float]:
    from node.shardcast.publish import checkpoint_files, publish_checkpoint
    from node.shardcast.relay import Relay, RelayConfig
    from node.shardcast.server import ShardcastServer
    from node.shardcast.store import ShardcastStore
    from protocol.identity import NodeKey
    from protocol.runspec import RLSpec, RunInfo, RunSpec, ShardcastSpec, dump_run_spec, sign_run_spec

    key = NodeKey.generate()
    spec = RunSpec(run=RunInfo(name=f"bench-{mode}", coordinator=key.peer_id), rl=RLSpec(async_level=1),
                   shardcast=ShardcastSpec(piece_size_bytes=piece_size, keep_steps=2))
    signed = sign_run_spec(spec, key)
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{mode}.toml"
    spec_path.write_text(dump_run_spec(signed))

    def store(name: str) -> ShardcastStore:
        return ShardcastStore(work / name, run_id=signed.run_id, authorities=spec.authorities, keep_steps=2)

    origin = store(f"{mode}-origin")
    publish_checkpoint(origin, checkpoint_files(prev), step=0, key=key, piece_size_bytes=piece_size)
    server = ShardcastServer(origin)
    await server.start()
    links: list[Link] = []

    async def hop(url: str) -> str:
        if not link_bps:
            return url
        links.append(Link(url, link_bps))
        await links[-1].start()
        return links[-1].url

    origin_url = await hop(server.url)
    relays = [Relay(store(f"{mode}-relay{i}"), RelayConfig(upstreams=(origin_url,), poll_interval_s=0.05)) for i in range(2)]
    for r in relays:
        await r.start()
    relay_urls = [await hop(r.url) for r in relays]
    held = work / f"{mode}-held"
    procs: list[subprocess.Popen[str]] = []
    try:
        from node.shardcast.client import fetch_checkpoint

        await fetch_checkpoint([server.url], held, run_id=signed.run_id, authorities=spec.authorities, step=0, progress=False)
        end = time.monotonic() + 300
        while not all(0 in r.held_steps() for r in relays):
            if time.monotonic() > end:
                raise RuntimeError("relays did not hold step 0")
            await asyncio.sleep(0.05)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for i in range(4):
            p = subprocess.Popen([sys.executable, "-c", CLIENT, mode, str(spec_path), str(work / f"{mode}-client{i}"), str(held), "1",
                                  *relay_urls], stdout=subprocess.PIPE, text=True, env=env)
            procs.append(p)
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        await asyncio.to_thread(publish_checkpoint, origin, checkpoint_files(nxt), step=1, key=key, piece_size_bytes=piece_size,
                                delta_from=0 if mode == "delta" else None)
        t_pub = time.monotonic() - t0
        results = []
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            results.append(json.loads(line))
            p.wait(timeout=60)
        vias = {r["via"] for r in results}
        return {"publish_s": t_pub, "total_s": max(r["done"] for r in results) - t0, "via": ",".join(sorted(vias)),
                "client_bytes": max(r["bytes"] for r in results), "vmhwm_mib": max(r["vmhwm_kib"] for r in results) / 1024}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for r in relays:
            await r.stop()
        for link in links:
            await link.stop()
        await server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per learning rate")
    ap.add_argument("--lrs", default="3e-7,1e-6,1e-5")
    ap.add_argument("--piece-size-mib", type=int, default=4)
    ap.add_argument("--skip-distribution", action="store_true")
    ap.add_argument("--link-mibps", type=float, default=0.0,
                    help="also time part 2 with every hop (origin→relay, relay→clients) a shared link of this many MiB/s")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="delta-bench-"))
    try:
        lrs = [float(x) for x in args.lrs.split(",")]
        table = []
        pols: dict[float, list[Path]] = {}
        for lr in lrs:
            pols[lr] = train_policies(args, lr, work)
            for s, dbytes, full, changed, total in delta_ratios(pols[lr]):
                table.append((lr, s, dbytes, full, changed, total))
        print("\nPart 1: delta size per step (bf16 published, fp32 masters, GRPO + AdamW)")
        print(f"{'lr':>8} {'step':>4} {'full MiB':>9} {'delta MiB':>10} {'delta/full':>11} {'1/ratio':>8} {'changed':>9}")
        for lr, s, dbytes, full, changed, total in table:
            print(f"{lr:>8g} {s:>4d} {full / MiB:>9.1f} {dbytes / MiB:>10.3f} {dbytes / full:>11.5f} {full / dbytes:>8.1f} "
                  f"{changed / total:>9.4%}")
        if args.skip_distribution:
            return
        mid = lrs[len(lrs) // 2]
        prev, nxt = pols[mid][-2], pols[mid][-1]
        print(f"\nPart 2: origin → 2 relays → 4 clients, step {args.steps - 1} → {args.steps} at lr {mid:g}, "
              f"piece {args.piece_size_mib} MiB")
        for link in ([0.0, args.link_mibps * MiB] if args.link_mibps else [0.0]):
            res = {m: asyncio.run(distribute(m, prev, nxt, work / f"{m}-{link:g}", args.piece_size_mib * MiB, link)) for m in ("full", "delta")}
            print(f"links: {'loopback, uncapped' if not link else f'{link / MiB:g} MiB/s per hop'}")
            print(f"{'mode':>6} {'publish s':>10} {'publish→last client s':>22} {'client bytes':>13} {'client VmHWM MiB':>17} {'via':>6}")
            for m, r in res.items():
                print(f"{m:>6} {r['publish_s']:>10.2f} {r['total_s']:>22.2f} {int(r['client_bytes']):>13d} {r['vmhwm_mib']:>17.1f} "
                      f"{r['via']:>6}")
            print(f"speed-up delta vs full: {res['full']['total_s'] / res['delta']['total_s']:.1f}× (after the publish: "
                  f"{(res['full']['total_s'] - res['full']['publish_s']) / max(1e-9, res['delta']['total_s'] - res['delta']['publish_s']):.1f}×)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
