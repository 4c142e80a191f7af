"""ValidatorNode in process: lease from a real ingest, fetch step 0 through a real Shardcast origin,
judge an honest and a cheating worker, post signed verdicts; the coordinator bans the cheater.

The coordinator side mirrors ``node.coordinator.role``: one aiohttp app on one port serving the
Shardcast origin routes and the ingest routes (with ``error_middleware``). The policy is a tiny
embedded Qwen2 with random weights (the checks do not need a model that solves anything).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from localnet import reserve_port

from node.coordinator.recheck import CoordinatorRecheck
from node.engine.hf import TransformersEngine
from node.validator.role import ValidatorNode, ValidatorOptions
from node.shardcast import ShardcastServer, ShardcastStore, publish_checkpoint
from node.worker.adversary import build_dishonest_submission
from node.worker.rollouts import build_submission
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.models import build_model, embedded_config, embedded_tokenizer, save_model
from protocol.runspec import (
    DataSpec,
    NetworkSpec,
    RLSpec,
    RunInfo,
    RunSpec,
    SamplingSpec,
    SignedRunSpec,
    dump_run_spec,
    sign_run_spec,
)
from trainer.ingest.service import error_middleware, open_ingest
from trainer.ledger import BanBook, SubmissionStore
from trainer.ledger.states import PENDING

COORD = NodeKey.from_seed(b"C" * 32)
VALIDATOR = NodeKey.from_seed(b"V" * 32)
HONEST = NodeKey.from_seed(b"h" * 32)
CHEAT = NodeKey.from_seed(b"x" * 32)
VERDICT_WAIT_S = 90.0


def make_spec(url: str) -> SignedRunSpec:
    spec = RunSpec(
        run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=3),
        data=DataSpec(tasks_per_submission=2),
        sampling=SamplingSpec(max_tokens=8, temperature=1.5),
        rl=RLSpec(group_size=2, async_level=1),
        network=NetworkSpec(origin_urls=[url], ingest_urls=[url]),
    )
    return sign_run_spec(spec, COORD)


@dataclass
class Coordinator:
    """The coordinator's services of one run: Shardcast origin holding step 0, ingest, ban book."""

    url: str
    signed: SignedRunSpec
    store: SubmissionStore
    bans: BanBook
    engine: TransformersEngine


@contextlib.asynccontextmanager
async def coordinator(root: Path) -> AsyncIterator[Coordinator]:
    with reserve_port() as port:  # the origin URL goes into the signed spec, so the port is chosen first
        async with _coordinator(root, port) as c:
            yield c


@contextlib.asynccontextmanager
async def _coordinator(root: Path, port: int) -> AsyncIterator[Coordinator]:
    url = f"http://127.0.0.1:{port}"
    signed = make_spec(url)
    spec, run_id = signed.spec, signed.run_id
    tok = embedded_tokenizer()
    model = build_model(embedded_config(len(tok), hidden_size=spec.model.hidden_size), seed=0)
    files = save_model(model, tok, root / "policies" / "step-0")
    origin = ShardcastStore(root / "origin", run_id=run_id, authorities=spec.authorities, keep_steps=spec.shardcast.keep_steps, fsync=False)
    publish_checkpoint(origin, files, step=0, key=COORD, piece_size_bytes=spec.shardcast.piece_size_bytes)
    recheck = CoordinatorRecheck(spec, run_id, resolve_tasks(spec.data.tasks).train, lambda: tok, lambda step: root / "policies" / f"step-{step}",
                                 by=COORD.peer_id)  # the independent re-check a ban needs
    ingest = open_ingest(root, spec, COORD, trainer_step=lambda: 0, latest_policy_step=lambda: 0, recheck=recheck)
    store, bans = ingest.ledger.store, ingest.ledger.bans
    app = ShardcastServer(origin, host="127.0.0.1", port=port).make_app()
    app.middlewares.append(error_middleware)
    ingest.add_routes(app)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Coordinator(url, signed, store, bans, TransformersEngine(model, tok))
    finally:
        await runner.cleanup()
        ingest.close()
        ingest.ledger.close()


async def test_validator_judges_posts_verdicts_and_gets_the_cheater_banned(tmp_path: Path) -> None:
    async with coordinator(tmp_path / "coord") as coord:
        spec, run_id = coord.signed.spec, coord.signed.run_id
        tasks = resolve_tasks(spec.data.tasks).train
        tok = coord.engine.tokenizer
        honest = await asyncio.to_thread(build_submission, spec, run_id, HONEST, coord.engine, tok, tasks, 0, 0)
        cheat = await asyncio.to_thread(build_dishonest_submission, "inflated-reward", spec, run_id, CHEAT, coord.engine, tok, tasks, 0, 0)
        ids = {}
        async with ClientSession() as http:
            for name, blob in (("honest", honest), ("cheat", cheat)):
                async with http.post(f"{coord.url}/ingest/1/submissions", data=blob) as r:
                    assert r.status == 200, await r.text()
                    ids[name] = (await r.json())["id"]
        assert ids["honest"] == open_envelope(honest, run_id=run_id, expect=Submission).id.hex()

        options = ValidatorOptions(data_dir=tmp_path / "validator", gossip=None, http_port=None)
        node = ValidatorNode(coord.signed, VALIDATOR, options)
        assert node.ingest_urls == [coord.url]  # from the run spec
        await node.start()
        runner = asyncio.create_task(node.run())
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + VERDICT_WAIT_S
            while any(coord.store.get(i).state in PENDING for i in ids.values()):
                assert not runner.done(), f"validator stopped: {runner.exception() if not runner.cancelled() else 'cancelled'}"
                assert loop.time() < end, f"no verdicts within {VERDICT_WAIT_S} s; validator state: {node.state}"
                await asyncio.sleep(0.1)
            status = node.status()
        finally:
            node.request_stop()
            await asyncio.wait_for(runner, timeout=30)
            await node.stop()

        good, bad = coord.store.get(ids["honest"]), coord.store.get(ids["cheat"])
        assert (good.state, good.reason) == ("accepted", "ok")
        assert (bad.state, bad.reason) == ("rejected", "reward")
        end = asyncio.get_running_loop().time() + VERDICT_WAIT_S
        while not coord.bans.is_banned(CHEAT.peer_id):  # the coordinator's re-check must reproduce the cheat first
            assert asyncio.get_running_loop().time() < end, "the cheat verdict was not confirmed by the re-check"
            await asyncio.sleep(0.1)
        assert not coord.bans.is_banned(HONEST.peer_id)
        assert [e.reason for e in coord.bans.entries()] == ["reward"]
        assert [(x.by, x.reason) for x in coord.bans.entries()[0].evidence] == [(VALIDATOR.peer_id, "reward"), (COORD.peer_id, "reward")]
        # the validator fetched step 0 through Shardcast and kept its own account
        assert node.follower.have(0)
        assert status["checked"] == 2 and status["verdicts_by_reason"] == {"ok": 1, "reward": 1}
        assert status["judged_step"] == 0  # what its gossip record carries as policy_step (intellect-node status showed "—")
        assert status["reputation"] == {HONEST.peer_id: {"ok": 1}, CHEAT.peer_id: {"reward": 1}}
        assert status["seconds_per_submission"] > 0
        # a banned worker's next submission is refused at the door
        async with ClientSession() as http:
            again = await asyncio.to_thread(build_submission, spec, run_id, CHEAT, coord.engine, tok, tasks, 0, 1)
            async with http.post(f"{coord.url}/ingest/1/submissions", data=again) as r:
                assert r.status == 403 and (await r.json())["error"] == "banned"


def test_validator_refuses_a_key_the_spec_does_not_name(tmp_path: Path) -> None:
    signed = make_spec("http://127.0.0.1:9")
    stranger = NodeKey.from_seed(b"s" * 32)
    with pytest.raises(ValueError, match="not a validator of this run"):
        ValidatorNode(signed, stranger, ValidatorOptions(data_dir=tmp_path, gossip=None, http_port=None))
    ValidatorNode(signed, VALIDATOR, ValidatorOptions(data_dir=tmp_path, gossip=None, http_port=None)).judgements.close()


@pytest.mark.slow
def test_validate_command_exits_2_for_a_key_not_in_the_spec(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(dump_run_spec(make_spec("http://127.0.0.1:9")))
    key = tmp_path / "stranger.key"
    stranger = NodeKey.from_seed(b"s" * 32)
    stranger.save(key)
    r = subprocess.run([sys.executable, "-m", "node", "validate", "--run", str(run), "--key", str(key), "--no-gossip",
                        "--data-dir", str(tmp_path / "data")], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert stranger.peer_id in r.stderr and "does not name as a validator" in r.stderr and "spec init --validator" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()  # refused before touching anything


@pytest.mark.slow
async def test_spot_checks_check_a_new_worker_in_full_then_a_keyed_share(tmp_path: Path) -> None:
    """With full_checks 2 and min_share 0.2 a worker's first submissions are checked in full, later
    ones in a share the validator's key picks; every honest one is accepted, light checks say so in
    the verdict's evidence, and only full checks add to the worker's verified history."""
    from validator.spot import SpotCheckPolicy, selected

    async with coordinator(tmp_path / "coord") as coord:
        spec, run_id = coord.signed.spec, coord.signed.run_id
        tasks = resolve_tasks(spec.data.tasks).train
        blobs = [await asyncio.to_thread(build_submission, spec, run_id, HONEST, coord.engine, coord.engine.tokenizer, tasks, 0, i)
                 for i in range(8)]
        ids = [open_envelope(b, run_id=run_id, expect=Submission).id for b in blobs]
        policy = SpotCheckPolicy(full_checks=2, min_share=0.2)
        node = ValidatorNode(coord.signed, VALIDATOR, ValidatorOptions(data_dir=tmp_path / "validator", gossip=None, http_port=None,
                                                                       spot=policy, batch=1))
        await node.start()
        runner = asyncio.create_task(node.run())
        try:
            end = asyncio.get_running_loop().time() + 3 * VERDICT_WAIT_S
            async with ClientSession() as http:
                for lo in range(0, 8, 4):  # the ingest holds at most 4 of a worker's submissions awaiting verdicts
                    for blob in blobs[lo : lo + 4]:
                        async with http.post(f"{coord.url}/ingest/1/submissions", data=blob) as r:
                            assert r.status == 200, await r.text()
                    while any(coord.store.get(i.hex()).state in PENDING for i in ids[lo : lo + 4]):
                        assert not runner.done() and asyncio.get_running_loop().time() < end, node.state
                        await asyncio.sleep(0.1)
            status = node.status()
            verified = node.judgements.verified(HONEST.peer_id)
            with node.judgements._lock:
                judged = [bytes.fromhex(r[0]) for r in node.judgements._db.execute("SELECT submission_id FROM judged ORDER BY rowid")]
        finally:
            node.request_stop()
            await asyncio.wait_for(runner, timeout=30)
            await node.stop()
        assert all(coord.store.get(i.hex()).state == "accepted" for i in ids)
        depth = status["spot_checks"]["checked"]
        assert depth["full"] + depth["light"] == 8 and depth["full"] >= 3 and depth["light"] >= 1, depth
        assert verified == depth["full"]
        # replay the validator's decisions in the order it judged: the keyed selection at the share of the history so far
        assert sorted(judged) == sorted(ids)
        full, v = 0, 0
        for sid in judged:
            if selected(VALIDATOR.sign, sid, policy.share(v)):
                full, v = full + 1, v + 1
        assert full == depth["full"]


@pytest.mark.slow
async def test_a_validator_out_of_resources_retries_once_then_sends_a_benign_resources_verdict(tmp_path: Path, monkeypatch) -> None:
    """Running out of memory while checking is the validator's failure: the lease is left to expire
    once (the failure may pass), then a ``resources`` verdict rejects the submission without a ban."""
    import node.validator.role as role

    calls = []

    def out_of_memory(self, env, **kwargs):
        calls.append(env.id.hex())
        raise MemoryError("cannot allocate the prefill's logits")

    monkeypatch.setattr(role, "LEASE_S", 1.0)  # a short lease, so the retry comes at once
    monkeypatch.setattr(role.SubmissionChecker, "check", out_of_memory)
    async with coordinator(tmp_path / "coord") as coord:
        spec, run_id = coord.signed.spec, coord.signed.run_id
        blob = await asyncio.to_thread(build_submission, spec, run_id, HONEST, coord.engine, coord.engine.tokenizer,
                                       resolve_tasks(spec.data.tasks).train, 0, 0)
        async with ClientSession() as http, http.post(f"{coord.url}/ingest/1/submissions", data=blob) as r:
            assert r.status == 200
            sid = (await r.json())["id"]
        node = ValidatorNode(coord.signed, VALIDATOR, ValidatorOptions(data_dir=tmp_path / "validator", gossip=None, http_port=None))
        await node.start()
        runner = asyncio.create_task(node.run())
        try:
            end = asyncio.get_running_loop().time() + VERDICT_WAIT_S
            while coord.store.get(sid).state in PENDING:
                assert not runner.done() and asyncio.get_running_loop().time() < end, f"no verdict; validator state: {node.state}"
                await asyncio.sleep(0.1)
            reputation = node.status()["reputation"]
        finally:
            node.request_stop()
            await asyncio.wait_for(runner, timeout=30)
            await node.stop()
        stored = coord.store.get(sid)
        assert (stored.state, stored.reason) == ("rejected", "resources")
        assert calls == [sid, sid]  # one retry after the lease expired
        assert not coord.bans.is_banned(HONEST.peer_id)
        assert reputation == {HONEST.peer_id: {"resources": 1}}


async def test_models_in_memory_are_bounded_by_bytes_and_evicted_before_a_load(tmp_path: Path, monkeypatch) -> None:
    """At a real shape one float32 model is ≈ 2 GB: the validator keeps the models of the async
    window only while their parameters fit ``MODEL_CACHE_BYTES``, and frees one before loading the next,
    its heap pages handed back to the kernel first (node/memory.py: else they sit beside the next one)."""
    import node.policy as policy
    import node.validator.role as role

    tok = embedded_tokenizer()
    model = build_model(embedded_config(len(tok)), seed=0)
    save_model(model, tok, tmp_path / "ckpt")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    node = ValidatorNode(make_spec("http://127.0.0.1:9"), VALIDATOR, ValidatorOptions(data_dir=tmp_path / "v", gossip=None, http_port=None))
    held_at_load: list[int] = []
    real_load = role.load_model

    events: list[str] = []

    def load_model(*args, **kw):
        held_at_load.append(len(node.models.steps()))
        events.append("load")
        return real_load(*args, **kw)

    async def fetch(step: int) -> Path:
        return tmp_path / "ckpt"

    monkeypatch.setattr(role, "load_model", load_model)
    monkeypatch.setattr(policy, "release_free_memory", lambda: events.append("release") or True)
    monkeypatch.setattr(node.follower, "fetch", fetch)
    monkeypatch.setattr(node.follower, "latest_step", 10)
    try:
        assert node.models.max_bytes == role.MODEL_CACHE_BYTES
        node.models.max_bytes = size + size // 2  # room for one
        for step in (0, 1, 2):
            await node._prepare(step)
        assert node.models.steps() == [2] and held_at_load == [0, 0, 0]
        assert events == ["load", "release", "load", "release", "load"]
        node.models.max_bytes = 100 * size  # room for many: the retention rule (keep_steps) bounds them
        keep = node.spec.shardcast.keep_steps
        for step in (3, 4, 5, 6):
            await node._prepare(step)
        assert node.models.steps() == list(range(7 - keep, 7)) and max(held_at_load[3:]) == keep - 1
    finally:
        node.judgements.close()
