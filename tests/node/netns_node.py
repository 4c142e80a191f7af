"""Test-only process for ``test_netns_partition.py``, run inside a network namespace.

``--role coordinator --host IP``: an ingest (durable store under ``--dir``) and a coordinator
gossip node, both on ``IP``; prints ``READY <http port> <multiaddr>``.
``--role worker --host IP --coordinator URL --bootstrap MADDR``: a worker gossip node, and a
submitter that posts ``--count`` signed submissions (one every ``--every-s`` seconds), each
retried until the ingest acknowledges it; prints ``ACK <id>`` per acknowledgement, ``FAIL <id>``
per attempt that got no answer, ``DONE`` after the last.

Both print ``PEERS <n> <peer ID>…`` whenever their live peer table changes. Both stop on
SIGTERM. The run spec is derived from a fixed seed, so both processes share it. The ingest's
per-worker pending quota is lifted (nothing judges the submissions here).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
HEARTBEAT_S = 1.0


def run_spec():  # type: ignore[no-untyped-def]
    from protocol.identity import NodeKey
    from protocol.runspec import NetworkSpec, RunInfo, RunSpec

    coord = NodeKey.from_seed(b"n" * 32)
    return coord, RunSpec(run=RunInfo(coordinator=coord.peer_id, seed=1), network=NetworkSpec(heartbeat_interval_s=HEARTBEAT_S))


async def watch_peers(node) -> None:  # type: ignore[no-untyped-def]
    last: list[str] | None = None
    while True:
        now = sorted(p.peer_id for p in node.peers.alive())
        if now != last:
            last = now
            print(f"PEERS {len(now)} {' '.join(now)}", flush=True)
        await asyncio.sleep(0.1)


async def coordinator(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from aiohttp import web

    from node.http_server import start_site
    from node.p2p import GossipConfig, GossipNode
    from trainer.ingest.limits import IngestLimits
    from trainer.ingest.service import error_middleware, open_ingest

    key, spec = run_spec()
    # nothing judges the submissions here: the per-worker pending quota (default 4) is lifted
    limits = IngestLimits(max_pending_per_worker=10_000)
    service = open_ingest(Path(args.dir), spec, key, trainer_step=lambda: 0, latest_policy_step=lambda: 0, limits=limits)
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)
    service.add_routes(app)
    running = await start_site(app, args.host, 0)
    node = await GossipNode.create(spec, key, GossipConfig(listen_host=args.host), role="coordinator",
                                   http_url=f"http://{args.host}:{running.port}")
    watcher = asyncio.create_task(watch_peers(node))
    print(f"READY {running.port} {node.addrs[0]}", flush=True)
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        await node.stop()
        await running.stop()
        service.close()
        service.ledger.close()


async def worker(args: argparse.Namespace, stop: asyncio.Event) -> None:
    import aiohttp

    from node.p2p import GossipConfig, GossipNode
    from protocol.envelope import open_envelope, seal
    from protocol.identity import NodeKey
    from protocol.messages import Rollout, Submission, SubmissionTask

    _, spec = run_spec()
    key = NodeKey.generate()
    node = await GossipNode.create(spec, key, GossipConfig(listen_host=args.host, bootstrap=[args.bootstrap], bootstrap_backoff_max_s=2.0),
                                   role="worker")
    watcher = asyncio.create_task(watch_peers(node))
    print(f"READY 0 {node.addrs[0]}", flush=True)

    def submission(counter: int) -> bytes:
        r = Rollout(task=0, sample=0, seed=counter, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00" * 32,
                    logprobs=b"\x00\x00\x00\x00" * 32, finish="length", task_reward=0.0, reward=0.0, proofs=[b"\x00" * 258])
        body = Submission(worker=key.peer_id, policy_step=0, counter=counter,
                          tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)], rollouts=[r])
        return seal(key, spec.run_id, body)

    timeout = aiohttp.ClientTimeout(total=3.0)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for counter in range(args.count):
                data = submission(counter)
                sid = open_envelope(data, run_id=spec.run_id, expect=Submission).id.hex()
                while not stop.is_set():  # retried until acknowledged (the partition makes posts fail)
                    try:
                        async with http.post(f"{args.coordinator}/ingest/1/submissions", data=data) as r:
                            if r.status == 200:
                                print(f"ACK {sid}", flush=True)
                                break
                    except (aiohttp.ClientError, TimeoutError):
                        print(f"FAIL {sid}", flush=True)
                    await asyncio.sleep(0.5)
                await asyncio.sleep(args.every_s)
            if not stop.is_set():
                print("DONE", flush=True)
        await stop.wait()
    finally:
        watcher.cancel()
        await node.stop()


async def main_async(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await (coordinator(args, stop) if args.role == "coordinator" else worker(args, stop))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["coordinator", "worker"], required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--dir", default="")
    p.add_argument("--coordinator", default="")
    p.add_argument("--bootstrap", default="")
    p.add_argument("--count", type=int, default=60)
    p.add_argument("--every-s", type=float, default=0.5)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
