"""Shardcast step deltas end to end: real trainer steps (fp32 masters, bf16 published) published with
deltas, fetched and applied by clients and relays, against bad sources, bad deltas and restarts."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from shardcast_fixtures import EvilProxy, StaticSources, make_run, make_store, proxy, serving
from waiting import wait_until

from node.shardcast.delta import MANIFEST_FILE_NAME, apply_into_dir, fetch_step, publish_delta, read_held
from node.shardcast.download import DownloadConfig
from node.shardcast.publish import checkpoint_files, publish_checkpoint
from node.shardcast.relay import Relay, RelayConfig
from protocol.delta import DeltaMismatchError, encode_delta
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import DeltaManifest
from protocol.models import build_model
from protocol.shardcast import build_manifest
from trainer.model import tiny_qwen2_config
from trainer.synthetic import synthetic_batch
from trainer.train import Trainer, TrainerConfig

FAST = DownloadConfig(max_concurrency=4, stall_timeout_s=20.0, deadline_s=60.0, connect_timeout_s=2.0, read_timeout_s=5.0)
STEPS = 4


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> list[Path]:
    """bf16 policy directories of trainer steps 0..3 (GRPO + AdamW at lr 1e-5 on fp32 masters)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("policies")
    cfg = tiny_qwen2_config(vocab_size=1024, hidden_size=128, num_hidden_layers=2, intermediate_size=256)
    trainer = Trainer(build_model(cfg, seed=0), TrainerConfig(learning_rate=1e-5))
    out = []
    for step in range(STEPS):
        if step:
            trainer.train_step(synthetic_batch(step, step - 1))
        d = root / f"step-{step}"
        trainer.save_checkpoint(d, dtype=torch.bfloat16)
        out.append(d)
    return out


def _publish_all(run, store, policies, steps=range(STEPS), delta=True):
    envs = []
    prev = None
    for s in steps:
        envs.append(publish_checkpoint(store, checkpoint_files(policies[s]), step=s, key=run.key,
                                       piece_size_bytes=run.signed.spec.shardcast.piece_size_bytes,
                                       delta_from=prev if delta else None))
        prev = s
    return envs


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    return names == sorted(p.name for p in b.iterdir() if not p.name.startswith(".")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


async def _step(run, sources, out, held, step, **kw):
    return await fetch_step(sources, out, run_id=run.run_id, authorities=run.authorities, held_dir=held, step=step,
                            config=kw.pop("config", FAST), **kw)


@pytest.fixture
def origin(tmp_path, policies):
    run = make_run(keep_steps=4, model_dtype="bfloat16")  # deltas go out for bf16 policies only
    store = make_store(run, tmp_path / "origin")
    _publish_all(run, store, policies)
    return run, store


async def test_chain_of_real_trainer_steps_is_bit_exact(origin, policies, tmp_path):
    run, store = origin
    for s in range(1, STEPS):
        d = store.delta(s)
        assert d is not None and d.body.base_step == s - 1 and 0 < d.body.changed_elements < d.body.total_elements
        assert d.body.size_bytes < sum(f.size_bytes for f in store.manifest(s).body.files) / 2
    async with serving(store) as srv:
        first = await _step(run, [srv.url], tmp_path / "c0", None, 0)
        assert first.via == "full" and _same_files(tmp_path / "c0", policies[0])
        for s in range(1, STEPS):
            res = await _step(run, [srv.url], tmp_path / f"c{s}", tmp_path / f"c{s - 1}", s)
            assert res.via == "delta" and res.deltas_applied == [s], res.fallback_reason
            assert _same_files(tmp_path / f"c{s}", policies[s])
            assert (tmp_path / f"c{s}" / MANIFEST_FILE_NAME).read_bytes() == store.manifest(s).raw
            assert res.bytes_downloaded == store.delta(s).body.size_bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging left behind"


async def test_node_two_steps_behind_catches_up_and_chain_bound(origin, policies, tmp_path):
    run, store = origin
    async with serving(store) as srv:
        await _step(run, [srv.url], tmp_path / "c1", None, 1)
        res = await _step(run, [srv.url], tmp_path / "c3", tmp_path / "c1", 3)
        assert res.via == "delta" and res.deltas_applied == [2, 3]
        assert _same_files(tmp_path / "c3", policies[3])
        far = await _step(run, [srv.url], tmp_path / "c3b", tmp_path / "c1", 3, max_chain=1)
        assert far.via == "full" and "more than 1 deltas" in far.fallback_reason
        assert _same_files(tmp_path / "c3b", policies[3])


class _Recorder(EvilProxy):
    """A proxy that records the paths asked of it, corrupting delta pieces only in ``corrupt`` mode."""

    def __init__(self, upstream: str, mode: str = "ok", delta_pieces: set[str] | None = None, serve_delta_pieces: int | None = None) -> None:
        super().__init__(upstream, "ok")
        self.paths: list[str] = []
        self.bad_mode = mode
        self.delta_pieces = delta_pieces or set()
        self.serve_delta_pieces = serve_delta_pieces  # after this many delta pieces: 404 (a relay that stalls)

    async def _forward(self, request):  # noqa: ANN001, ANN202
        from aiohttp import web

        self.paths.append(request.path)
        is_delta = request.path.rsplit("/", 1)[-1] in self.delta_pieces
        if is_delta and self.serve_delta_pieces is not None:
            if self.serve_delta_pieces <= 0:
                return web.Response(status=404)
            self.serve_delta_pieces -= 1
        self.mode = self.bad_mode if is_delta else "ok"
        return await super()._forward(request)


async def test_corrupt_delta_piece_is_caught_and_its_source_named(origin, policies, tmp_path):
    run, store = origin
    pieces = {p.hex() for p in store.delta(1).body.pieces}
    async with serving(store) as good:
        await _step(run, [good.url], tmp_path / "c0", None, 0)
        bad = _Recorder(good.url, "corrupt", pieces)
        await bad.start()
        try:
            for attempt in range(30):  # the source choice is random: until the bad one served a delta piece
                out = tmp_path / f"c1-{attempt}"
                res = await _step(run, [bad.url, good.url], out, tmp_path / "c0", 1)
                assert res.via == "delta" and _same_files(out, policies[1])
                if res.faulty_sources:
                    assert list(res.faulty_sources) == [bad.url] and res.faulty_sources[bad.url].startswith("bad_hash")
                    break
            else:
                raise AssertionError("the corrupting source was never asked for a delta piece")
        finally:
            await bad.stop()


async def test_forged_delta_manifest_is_evidence(origin, policies, tmp_path):
    run, store = origin
    forged = seal(NodeKey.generate(), run.run_id, store.delta(1).body)
    async with serving(store) as good:
        await _step(run, [good.url], tmp_path / "c0", None, 0)
        liar = EvilProxy(good.url)

        async def forward(request):  # noqa: ANN001, ANN202
            from aiohttp import web

            if "/deltas/" in request.path:
                return web.Response(body=forged)
            return await EvilProxy._forward(liar, request)

        liar._forward = forward  # type: ignore[method-assign]
        await liar.start()
        try:
            res = await _step(run, [liar.url, good.url], tmp_path / "c1", tmp_path / "c0", 1)
        finally:
            await liar.stop()
    assert res.via == "delta" and _same_files(tmp_path / "c1", policies[1])
    assert res.faulty_sources == {liar.url: "bad_delta_manifest"}


async def test_delta_whose_result_does_not_match_is_refused_and_full_fetched(tmp_path, policies):
    run = make_run(keep_steps=4)
    store = make_store(run, tmp_path / "origin")
    envs = _publish_all(run, store, policies, steps=range(2))
    # a coordinator bug: the delta into step 2 is computed from step 0 but names step 1 as its base
    m0, m1 = envs[0].body, envs[1].body
    m2 = build_manifest(2, [(f.name, open(f, "rb")) for f in checkpoint_files(policies[2])], piece_size_bytes=m0.piece_size_bytes,
                        sink=store.sink())
    raw2 = seal(run.key, run.run_id, m2)
    bogus = tmp_path / "bogus.delta"
    with open(bogus, "wb") as f:
        stats = encode_delta(m0, m2, lambda n: open(policies[0] / n, "rb"), lambda n: open(policies[2] / n, "rb"), f)
    data = bogus.read_bytes()
    cut = build_manifest(2, [("delta", open(bogus, "rb"))], piece_size_bytes=m0.piece_size_bytes, sink=store.sink())
    dm = DeltaManifest(step=2, base_step=1, base_manifest_id=envs[1].id, target_manifest_id=hashlib.sha256(raw2).digest(),
                       piece_size_bytes=m0.piece_size_bytes, size_bytes=len(data), raw_size_bytes=stats.raw_size_bytes,
                       pieces=cut.files[0].pieces, delta_hash=cut.checkpoint_hash)
    store.add_delta(seal(run.key, run.run_id, dm))
    store.add_manifest(raw2)
    assert m1.step == 1
    async with serving(store) as srv:
        await _step(run, [srv.url], tmp_path / "c1", None, 1)
        res = await _step(run, [srv.url], tmp_path / "c2", tmp_path / "c1", 2)
    assert res.via == "full" and "refused" in res.fallback_reason and res.faulty_sources == {}
    assert _same_files(tmp_path / "c2", policies[2])


def test_interrupted_or_refused_apply_leaves_nothing_in_place(origin, policies, tmp_path):
    run, store = origin
    c0 = tmp_path / "c0"
    shutil.copytree(policies[0], c0)
    (c0 / MANIFEST_FILE_NAME).write_bytes(store.manifest(0).raw)
    d = store.delta(2).body  # a delta from step 1 applied to step 0's files: refused part-way
    delta_path = tmp_path / "d"
    delta_path.write_bytes(b"".join(store.piece_path(p).read_bytes() for p in d.pieces))
    base = read_held(c0, run.run_id, run.authorities)
    with pytest.raises(DeltaMismatchError):
        apply_into_dir(delta_path, d, base, c0, store.manifest(2), tmp_path / "c2")
    assert not (tmp_path / "c2").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c0", "d", "origin"]


async def test_resume_of_an_interrupted_delta_fetch(tmp_path, policies):
    run = make_run(keep_steps=4)
    store = make_store(run, tmp_path / "origin")
    _publish_all(run, store, policies, steps=range(2))
    d = store.delta(1).body
    assert len(d.pieces) >= 2, "the delta must span several pieces for this test"
    async with serving(store) as good:
        await _step(run, [good.url], tmp_path / "c0", None, 0)
        async with proxy(good.url, "ok", delay_s=0.05) as slow:
            task = asyncio.ensure_future(_step(run, [slow.url], tmp_path / "c1", tmp_path / "c0", 1,
                                               config=DownloadConfig(max_concurrency=1, stall_timeout_s=20.0, deadline_s=60.0)))
            await wait_until(lambda: slow.pieces_completed >= 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert not (tmp_path / "c1").exists()
        res = await _step(run, [good.url], tmp_path / "c1", tmp_path / "c0", 1)
    assert res.via == "delta" and res.bytes_resumed > 0 and res.bytes_resumed + res.bytes_downloaded == d.size_bytes
    assert _same_files(tmp_path / "c1", policies[1])


def _relay(store, upstream: str) -> Relay:
    return Relay(store, RelayConfig(upstreams=(upstream,), poll_interval_s=0.05, download=FAST))


async def test_relay_mirrors_delta_rebuilds_step_and_serves_delta(tmp_path, policies):
    run = make_run(keep_steps=4)
    origin = make_store(run, tmp_path / "origin")
    _publish_all(run, origin, policies, steps=range(1))
    async with serving(origin) as srv:
        rec = _Recorder(srv.url)
        await rec.start()
        relay = _relay(make_store(run, tmp_path / "relay"), rec.url)
        await relay.start()
        try:
            await wait_until(lambda: 0 in relay.held_steps())
            _publish_all(run, origin, policies, steps=[0, 1])
            await wait_until(lambda: 1 in relay.held_steps())
            delta_ids = {p.hex() for p in origin.delta(1).body.pieces}
            asked = {p.rsplit("/", 1)[-1] for p in rec.paths if "/pieces/" in p}
            full1 = {p.hex() for p in origin.manifest(1).body.files[1].pieces} - {p.hex() for p in origin.manifest(0).body.files[1].pieces}
            assert delta_ids <= asked and not (asked & full1), "step 1 was rebuilt from the delta, not fetched"
            assert relay.store.delta(1) is not None
            res = await _step(run, [relay.url], tmp_path / "c1", None, 0)
            res = await _step(run, [relay.url], tmp_path / "c1b", tmp_path / "c1", 1)
            assert res.via == "delta" and _same_files(tmp_path / "c1b", policies[1])
        finally:
            await relay.stop()
            await rec.stop()


async def test_relay_restart_mid_delta(tmp_path, policies):
    run = make_run(keep_steps=4)
    origin = make_store(run, tmp_path / "origin")
    _publish_all(run, origin, policies, steps=range(1))
    async with serving(origin) as srv:
        relay = _relay(make_store(run, tmp_path / "relay"), srv.url)
        await relay.start()
        await wait_until(lambda: 0 in relay.held_steps())
        await relay.stop()
        publish_checkpoint(origin, checkpoint_files(policies[1]), step=1, key=run.key,
                           piece_size_bytes=run.signed.spec.shardcast.piece_size_bytes, delta_from=0)
        pieces = {p.hex() for p in origin.delta(1).body.pieces}
        assert len(pieces) >= 2, "the delta must span several pieces for this test"
        slow = _Recorder(srv.url, "ok", pieces, serve_delta_pieces=1)
        await slow.start()
        relay = _relay(make_store(run, tmp_path / "relay"), slow.url)
        await relay.start()
        try:
            await wait_until(lambda: slow.pieces_completed >= 1)
        finally:
            await relay.stop()  # killed mid-delta
            await slow.stop()
        assert 1 not in relay.held_steps()
        store = make_store(run, tmp_path / "relay")
        assert store.delta(1) is not None
        rec = _Recorder(srv.url)
        await rec.start()
        relay = _relay(store, rec.url)
        await relay.start()
        try:
            await wait_until(lambda: 1 in relay.held_steps())
        finally:
            await relay.stop()
            await rec.stop()
        asked = [p.rsplit("/", 1)[-1] for p in rec.paths if "/pieces/" in p]
        assert set(asked) <= pieces and len(asked) < len(pieces), "resumed: only the missing delta pieces were fetched"
        for ref in origin.manifest(1).body.files:
            for pid in ref.pieces:
                assert store.piece_path(pid).read_bytes() == origin.piece_path(pid).read_bytes()


def test_publish_delta_refuses_incomplete_base(tmp_path, policies):
    run = make_run(keep_steps=4)
    store = make_store(run, tmp_path / "origin")
    envs = _publish_all(run, store, policies, steps=range(1))
    from node.errors import ShardcastError

    with pytest.raises(ShardcastError, match="not complete"):
        publish_delta(store, envs[0].raw, base_step=7, key=run.key)


async def test_policy_follower_takes_deltas(origin, policies, tmp_path, caplog):
    from node.policy import PolicyFollower

    run, store = origin
    caplog.set_level("INFO", logger="node.policy")
    async with serving(store) as srv:
        follower = PolicyFollower(run.signed.spec, tmp_path / "policy", StaticSources([srv.url]))
        try:
            await follower.fetch(0)
            path = await follower.fetch(2)
        finally:
            await follower.close()
    assert _same_files(path, policies[2])
    assert any("policy step 2 from step 0 by 2 delta(s)" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


async def test_follower_prefetches_a_step_and_writes_the_hold_lines(origin, policies, tmp_path, caplog):
    """A worker or validator that learns of a step fetches it at once in the background (by delta
    from the held one); each held step is one parseable hold line (what the devnet's timeline reads)."""
    from node.policy import PolicyFollower
    from node.shardcast.events import parse_held

    run, store = origin
    caplog.set_level("INFO", logger="node.policy")
    async with serving(store) as srv:
        follower = PolicyFollower(run.signed.spec, tmp_path / "policy", StaticSources([srv.url]))
        try:
            await follower.fetch(0)
            follower.prefetch(1)
            first = follower._prefetch
            follower.prefetch(1)  # one fetch at a time: a second call while it runs does nothing
            assert first is not None and follower._prefetch is first
            await wait_until(lambda: follower.have(1))
            await first  # the step is held before the fetch has closed its connections
            follower.prefetch(1)  # held: nothing to do
            assert follower._prefetch is first
        finally:
            await follower.close()
    assert _same_files(follower.path_for(1), policies[1])
    held = [e for e in (parse_held(r.getMessage()) for r in caplog.records) if e is not None]
    assert [(e.step, e.via) for e in held] == [(0, "full"), (1, "delta")]
    assert held[0].bytes == sum(f.size_bytes for f in store.manifest(0).body.files) and held[0].apply_s == 0.0
    assert held[1].bytes == store.delta(1).body.size_bytes and 0 < held[1].apply_s <= held[1].elapsed_s
    assert held[0].at <= held[1].at


class LaggingSources(StaticSources):
    """:class:`StaticSources` whose relays lag (none holds any step) until :attr:`lagging` is cleared;
    it records when each step was first found lagging."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls)
        self.lagging = True
        self.asked: dict[int, list[float]] = {}

    def relays_lagging(self, step: int) -> bool:
        self.asked.setdefault(step, []).append(asyncio.get_running_loop().time())
        return self.lagging


async def test_a_prefetch_waits_for_a_relay_longer_than_a_needed_fetch(origin, policies, tmp_path, monkeypatch):
    """A prefetch (nothing waits on it) waits for a relay to hold the step well past the few seconds a
    needed fetch allows, then takes it once one does; a fetch of that step cuts the wait short.
    Before, prefetches started at the announcement gave up on relays after those seconds and loaded the
    origin: every node at once, from the one upload relays exist to spare."""
    import node.policy as policy
    from node.policy import PolicyFollower

    monkeypatch.setattr(policy, "RELAY_WAIT_S", 0.2)
    monkeypatch.setattr(policy, "PREFETCH_RELAY_WAIT_S", 120.0)
    run, store = origin
    async with serving(store) as srv:
        sources = LaggingSources([srv.url])
        sources.lagging = False
        follower = PolicyFollower(run.signed.spec, tmp_path / "policy", sources)
        try:
            await follower.fetch(0)
            sources.lagging = True
            follower.prefetch(1)
            # waited ten times what a needed fetch waits, and still waiting for a relay
            await wait_until(lambda: len(t := sources.asked.get(1, [])) > 1 and t[-1] - t[0] > 10 * policy.RELAY_WAIT_S)
            assert not follower.have(1) and not follower._prefetch.done()
            sources.lagging = False  # a relay holds it
            first = follower._prefetch
            # the step on disk and its prefetch over (one prefetch runs at a time: prefetch(2) while the first
            # one still finishes after its files landed would be dropped, and step 2 never asked for)
            await wait_until(lambda: follower.have(1) and first.done(), what="step 1 prefetched")
            sources.lagging = True
            follower.prefetch(2)
            await wait_until(lambda: 2 in sources.asked)
            path = await asyncio.wait_for(follower.fetch(2), 60)  # needed now: the relay wait drops to RELAY_WAIT_S
            t = sources.asked[2]
            assert t[-1] - t[0] < policy.PREFETCH_RELAY_WAIT_S / 2
        finally:
            await follower.close()
    assert _same_files(path, policies[2])


async def test_relay_writes_a_hold_line_per_step(tmp_path, policies, caplog):
    from node.shardcast.events import parse_held

    caplog.set_level("INFO", logger="node.shardcast.relay")
    run = make_run(keep_steps=4)
    origin = make_store(run, tmp_path / "origin")
    _publish_all(run, origin, policies, steps=range(1))
    async with serving(origin) as srv:
        relay = _relay(make_store(run, tmp_path / "relay"), srv.url)
        await relay.start()
        try:
            await wait_until(lambda: 0 in relay.held_steps())
            _publish_all(run, origin, policies, steps=[0, 1])
            await wait_until(lambda: 1 in relay.held_steps())
        finally:
            await relay.stop()
    held = {e.step: e for e in (parse_held(r.getMessage()) for r in caplog.records) if e is not None}
    assert held[0].via == "full" and held[0].bytes == sum(f.size_bytes for f in origin.manifest(0).body.files)
    assert held[1].via == "delta" and held[1].bytes == origin.delta(1).body.size_bytes and held[1].apply_s > 0


def test_cli_publish_delta_and_fetch_held(tmp_path, policies, capsys):
    import threading

    from node.cli import main
    from node.shardcast.server import ShardcastServer
    from protocol.runspec import dump_run_spec

    run = make_run(keep_steps=4)
    (tmp_path / "run.toml").write_text(dump_run_spec(run.signed))
    run.key.save(tmp_path / "coord.key")
    common = ["--run", str(tmp_path / "run.toml")]
    assert main(["publish", str(policies[0]), "--step", "0", *common, "--key", str(tmp_path / "coord.key"), "--data-dir", str(tmp_path / "o")]) == 0
    assert main(["publish", str(policies[1]), "--step", "1", *common, "--key", str(tmp_path / "coord.key"), "--data-dir", str(tmp_path / "o"),
                 "--delta-from", "0"]) == 0
    assert "delta 0 → 1:" in capsys.readouterr().out
    store = make_store(run, tmp_path / "o")
    loop = asyncio.new_event_loop()
    server = ShardcastServer(store)
    loop.run_until_complete(server.start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        assert main(["fetch", *common, "--step", "0", "--source", server.url, "--out", str(tmp_path / "c0")]) == 0
        assert main(["fetch", *common, "--step", "1", "--source", server.url, "--out", str(tmp_path / "c1"), "--held", str(tmp_path / "c0")]) == 0
        assert "by 1 delta(s)" in capsys.readouterr().out
        assert _same_files(tmp_path / "c1", policies[1])
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(timeout=10)
        loop.close()
