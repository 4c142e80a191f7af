"""A policy step over real, capped links: by delta and by full fetch, side by side (issue #25).

The devnet's ``--links`` topology (``node/devnet/links.py``): an origin in the coordinator's
namespace (1 Gb/s), a real relay process (1 Gb/s), a validator-side and two worker-side fetch
clients (500 and 100 Mb/s), each link a token bucket both ways. Every node first holds step
*s − 1*; the clients are started and polling; then the origin publishes step *s* — **delta**:
with its step delta (clients apply it to *s − 1*, the relay rebuilds *s* from it); **full**:
without one (clients fetch every piece). Printed per node: seconds from the announcement (the
signed manifest in the origin) until it held *s*, bytes received, its link rate, its apply time,
and the goal's bound 2 × (bytes / link rate) + apply time.

The checkpoints are two consecutive published steps of a real run: ``--policies DIR`` (a devnet's
``OUT/coordinator/policies``; its two newest ``step-N`` folders), or with ``--build`` the
profile's model as *s − 1* and one GRPO + AdamW step (fp32 masters, lr 3e-7, synthetic batch) as
*s* (≈ 8 GB of memory for the step).

Root only. Run: ``python benchmarks/links_bench.py --policies devnet-out/latest/coordinator/policies``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from node.devnet.links import Links

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PIECE = 4 << 20
CLIENTS = {"validator-0": "validator", "worker-0": "worker", "worker-1": "worker"}


# --- children (run inside a namespace) --------------------------------------------------------


def child_origin(spec_path: str, key_path: str, store_dir: str, host: str, port: int) -> None:
    """Serve a Shardcast origin on ``host:port``; publish on each ``publish STEP DIR [BASE]`` line of stdin."""
    from node.shardcast.publish import checkpoint_files, publish_checkpoint
    from node.shardcast.server import ShardcastServer
    from node.shardcast.store import ShardcastStore
    from protocol.identity import NodeKey
    from protocol.runspec import load_run_spec

    signed = load_run_spec(Path(spec_path))
    key = NodeKey.load(Path(key_path))
    store = ShardcastStore(Path(store_dir), run_id=signed.run_id, authorities=signed.spec.authorities, keep_steps=4)

    async def main() -> None:
        server = ShardcastServer(store, host=host, port=port)
        await server.start()
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            _, step, d, *base = line.split()
            t0 = time.time()
            await asyncio.to_thread(publish_checkpoint, store, checkpoint_files(Path(d)), step=int(step), key=key, piece_size_bytes=PIECE,
                                    delta_from=int(base[0]) if base else None)
            delta = store.delta(int(step))
            print(json.dumps({"published": int(step), "start": t0, "at": time.time(),
                              "delta_bytes": delta.body.size_bytes if delta else None}), flush=True)
        await server.stop()

    asyncio.run(main())


def child_fetch(mode: str, spec_path: str, out: str, held: str, step: int, sources: list[str]) -> None:
    """Print ``ready``, then fetch ``step`` (by delta from ``held`` or in full) as soon as a source has it; print the result."""
    from node.errors import FetchError
    from node.shardcast.client import fetch_checkpoint
    from node.shardcast.delta import fetch_step
    from node.shardcast.download import DownloadConfig
    from protocol.runspec import load_run_spec

    signed = load_run_spec(Path(spec_path))
    cfg = DownloadConfig(stall_timeout_s=300, deadline_s=1800)
    origin = sources[-1:]
    print("ready", flush=True)

    async def main() -> dict[str, object]:
        end = time.monotonic() + 3600
        while True:
            try:
                if mode == "delta":
                    r = await fetch_step(sources, Path(out), run_id=signed.run_id, authorities=signed.spec.authorities, held_dir=Path(held),
                                         step=step, config=cfg, origins=origin)
                    return {"via": r.via, "bytes": r.bytes_downloaded, "apply_s": r.apply_s, "fetch_s": r.elapsed_s}
                f = await fetch_checkpoint(sources, Path(out), run_id=signed.run_id, authorities=signed.spec.authorities, step=step,
                                           config=cfg, progress=False, origins=origin)
                return {"via": "full", "bytes": f.bytes_downloaded, "apply_s": 0.0, "fetch_s": 0.0}
            except FetchError as e:
                if "manifest" not in str(e) or time.monotonic() > end:
                    raise
                await asyncio.sleep(0.05)

    res = asyncio.run(main())
    print(json.dumps({"done": time.time(), **res}), flush=True)


# --- the benchmark ----------------------------------------------------------------------------


def build_policies(root: Path, data_root: Path, layers: int | None) -> tuple[Path, Path]:
    import torch

    from node.devnet.profile import prepare_profile_model
    from protocol.models import copy_model, load_model
    from protocol.step_dirs import step_dir
    from trainer.synthetic import synthetic_batch
    from trainer.train import Trainer, TrainerConfig

    base = prepare_profile_model("qwen2.5-0.5b", data_root, layers=layers)
    a = step_dir(root, 0)
    copy_model(base, a)
    trainer = Trainer(load_model(base), TrainerConfig(learning_rate=3e-7, micro_batch_tokens=512))
    trainer.train_step(synthetic_batch(1, 0))
    b = step_dir(root, 1)
    trainer.save_checkpoint(b, dtype=torch.bfloat16, base_dir=base)
    return a, b


def run_mode(mode: str, links: Links, a: Path, b: Path, work: Path, spec_path: Path, key_path: Path) -> dict[str, dict[str, Any]]:
    from node.devnet.timeline import read_node_log
    from node.shardcast.publish import checkpoint_files

    py = sys.executable
    me = str(Path(__file__).resolve())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    work.mkdir(parents=True)
    procs: list[subprocess.Popen[Any]] = []
    origin_url = f"http://{links.ip('coordinator')}:8601"
    relay_url = f"http://{links.ip('relay-0')}:8602"
    try:
        origin = subprocess.Popen(links.wrap("coordinator", [py, me, "--child", "origin", str(spec_path), str(key_path), str(work / "origin"),
                                                             links.ip("coordinator"), "8601"]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(origin)
        assert origin.stdout is not None and origin.stdin is not None
        assert origin.stdout.readline().strip() == "ready"
        origin.stdin.write(f"publish 0 {a}\n")
        origin.stdin.flush()
        json.loads(origin.stdout.readline())
        relay_log = work / "relay.log"
        with open(relay_log, "wb") as log:
            relay = subprocess.Popen(links.wrap("relay-0", [
                py, "-m", "node", "-v", "join", "--role", "relay", "--run", str(spec_path), "--key", str(work / "relay.key"),
                "--data-dir", str(work / "relay"), "--http-port", "8602", "--host", links.ip("relay-0"), "--upstream", origin_url,
                "--no-gossip"]), stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(relay)
        end = time.monotonic() + 1800
        while 0 not in read_node_log(relay_log).held:
            assert relay.poll() is None and time.monotonic() < end, relay_log.read_text()[-2000:]
            time.sleep(0.5)
        # every client holds step 0 first (untimed), then waits for step 1
        for name in CLIENTS:
            subprocess.run(links.wrap(name, [py, me, "--child", "fetch", "full", str(spec_path), str(work / f"{name}-0"), "-", "0",
                                             relay_url, origin_url]), check=True, stdout=subprocess.DEVNULL, env=env, timeout=3600)
        clients = {}
        for name in CLIENTS:
            c = subprocess.Popen(links.wrap(name, [py, me, "--child", "fetch", mode, str(spec_path), str(work / f"{name}-1"),
                                                   str(work / f"{name}-0"), "1", relay_url, origin_url]),
                                 stdout=subprocess.PIPE, text=True, env=env)
            procs.append(c)
            clients[name] = c
        for c in clients.values():
            assert c.stdout is not None and c.stdout.readline().strip() == "ready"
        origin.stdin.write(f"publish 1 {b}{' 0' if mode == 'delta' else ''}\n")
        origin.stdin.flush()
        pub = json.loads(origin.stdout.readline())
        out: dict[str, dict[str, Any]] = {"origin": {"publish_s": pub["at"] - pub["start"], "delta_bytes": pub["delta_bytes"] or 0}}
        for name, c in clients.items():
            assert c.stdout is not None
            r = json.loads(c.stdout.readline())
            c.wait(timeout=60)
            out[name] = {"after_s": r["done"] - pub["at"], "bytes": r["bytes"], "apply_s": r["apply_s"], "via": r["via"]}
        while 1 not in read_node_log(relay_log).held:
            assert relay.poll() is None and time.monotonic() < end, relay_log.read_text()[-2000:]
            time.sleep(0.5)
        h = read_node_log(relay_log).held[1]
        out["relay-0"] = {"after_s": h.at - pub["at"], "bytes": h.bytes, "apply_s": h.apply_s, "via": h.via}
        full = sum(f.stat().st_size for f in checkpoint_files(b))
        out["origin"]["full_bytes"] = full
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "origin":
            child_origin(rest[0], rest[1], rest[2], rest[3], int(rest[4]))
        else:
            child_fetch(rest[0], rest[1], rest[2], rest[3], int(rest[4]), rest[5:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=None, help="a folder of step-N policy folders (its two newest are s − 1 and s)")
    ap.add_argument("--build", action="store_true", help="make s − 1 and s from the profile model and one trainer step")
    ap.add_argument("--layers", type=int, default=None, help="with --build: decoder layers (default 24)")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--modes", default="delta,full")
    args = ap.parse_args()

    from node.devnet.links import Links, unavailable
    from protocol.identity import NodeKey
    from protocol.runspec import ModelSpec, RLSpec, RunInfo, RunSpec, ShardcastSpec, dump_run_spec, sign_run_spec

    why = unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="links-bench-"))
    try:
        if args.policies:
            from protocol.step_dirs import step_dirs

            steps = [p for _, p in step_dirs(Path(args.policies))]
            if len(steps) < 2:
                print(f"error: {args.policies} holds fewer than two step-N folders", file=sys.stderr)
                return 2
            a, b = steps[-2], steps[-1]
        elif args.build:
            a, b = build_policies(work / "policies", Path(args.data_root), args.layers)
        else:
            print("error: pass --policies DIR or --build", file=sys.stderr)
            return 2
        key = NodeKey.generate()
        key.save(work / "coord.key")
        spec = RunSpec(run=RunInfo(name="links-bench", coordinator=key.peer_id), model=ModelSpec(dtype="bfloat16", hidden_size=896),
                       rl=RLSpec(async_level=2), shardcast=ShardcastSpec(piece_size_bytes=PIECE, keep_steps=3))
        (work / "run.toml").write_text(dump_run_spec(sign_run_spec(spec, key)))
        print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
              f"step {a.name} → {b.name} of {a.parent}", flush=True)
        nodes = {"coordinator": "coordinator", "relay-0": "relay", **CLIENTS}
        results = {}
        with Links(nodes) as links:
            for mode in args.modes.split(","):
                print(f"mode {mode} …", flush=True)
                results[mode] = run_mode(mode, links, a, b, work / mode, work / "run.toml", work / "coord.key")
            rates = {n.name: n.mbit for n in links.nodes.values()}
        full = results[next(iter(results))]["origin"]["full_bytes"]
        print(f"\ncheckpoint {full:,} bytes; load average after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        for mode, res in results.items():
            o = res["origin"]
            extra = f", delta {o['delta_bytes']:,} bytes = 1/{full / o['delta_bytes']:.0f} of the checkpoint" if o["delta_bytes"] else ""
            print(f"\n{mode}: publish {o['publish_s']:.1f} s{extra}")
            print(f"  {'node':<12} {'Mb/s':>5} {'via':>5} {'bytes':>13} {'held after s':>12} {'apply s':>8} {'bound s':>8} {'ratio':>6}")
            for name in ["relay-0", *CLIENTS]:
                r = res[name]
                bound = 2 * r["bytes"] * 8 / (rates[name] * 1e6) + r["apply_s"]
                print(f"  {name:<12} {rates[name]:>5} {r['via']:>5} {int(r['bytes']):>13,} {r['after_s']:>12.1f} {r['apply_s']:>8.1f} "
                      f"{bound:>8.1f} {r['after_s'] / bound:>6.2f}")
            print(f"  every node held step s after {max(res[n]['after_s'] for n in ['relay-0', *CLIENTS]):.1f} s")
        if "delta" in results and "full" in results:
            d = max(results["delta"][n]["after_s"] for n in ["relay-0", *CLIENTS])
            f = max(results["full"][n]["after_s"] for n in ["relay-0", *CLIENTS])
            print(f"\nlast node: full {f:.1f} s / delta {d:.1f} s = {f / d:.1f}×")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
