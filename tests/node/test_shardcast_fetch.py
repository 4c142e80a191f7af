"""Shardcast fetch against honest and misbehaving sources (the issue's faults list)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from shardcast_fixtures import PIECE, make_run, make_store, proxy, publish, serving, write_checkpoint
from waiting import wait_until

from node.errors import FetchError
from node.shardcast.client import MANIFEST_FILE_NAME, fetch_checkpoint
from node.shardcast.download import DownloadConfig
from protocol.envelope import seal
from protocol.errors import SignatureError
from protocol.identity import NodeKey
from protocol.models import iter_weights
from protocol.runspec import dump_run_spec

FAST = DownloadConfig(max_concurrency=6, stall_timeout_s=20.0, deadline_s=60.0, connect_timeout_s=2.0, read_timeout_s=5.0)


@pytest.fixture
def origin(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "origin")
    ckpt = write_checkpoint(tmp_path / "model.safetensors", 2.0)
    env = publish(run, store, ckpt, 1)
    return run, store, ckpt, env


async def _fetch(run, sources, out, **kw):
    return await fetch_checkpoint(sources, out, run_id=run.run_id, authorities=run.authorities, config=kw.pop("config", FAST), progress=False, **kw)


async def test_fetch_from_two_sources_and_load(origin, tmp_path):
    run, store, ckpt, env = origin
    mirror = make_store(run, tmp_path / "mirror")
    async with serving(store) as a, serving(mirror) as b:
        res = await _fetch(run, [a.url, b.url], tmp_path / "out", step=None)
    assert res.step == 1 and res.faulty_sources == {}
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
    assert (tmp_path / "out" / MANIFEST_FILE_NAME).read_bytes() == env.raw
    assert res.bytes_downloaded == ckpt.stat().st_size and res.source_bytes[a.url] == res.bytes_downloaded
    assert {name for name, _ in iter_weights(tmp_path / "out")} == {"a.weight", "b.weight"}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    # fetching again into the same directory is a no-op; into a foreign non-empty one is refused
    async with serving(store) as a:
        again = await _fetch(run, [a.url], tmp_path / "out", step=1)
        assert again.bytes_downloaded == 0
        (tmp_path / "junk").mkdir()
        (tmp_path / "junk" / "x").write_text("x")
        with pytest.raises(FetchError, match="holds something else"):
            await _fetch(run, [a.url], tmp_path / "junk", step=1)


@pytest.mark.parametrize("mode", ["corrupt", "oversize", "oversize_chunked"])
async def test_bad_relay_is_named_and_fetch_completes(origin, tmp_path, mode, caplog):
    run, store, ckpt, _ = origin
    async with serving(store) as good, proxy(good.url, mode) as bad:
        res = await _fetch(run, [bad.url, good.url], tmp_path / "out", step=1)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
    assert list(res.faulty_sources) == [bad.url]
    assert res.faulty_sources[bad.url].split(":")[0] in ("bad_hash", "bad_length", "oversized")
    assert res.source_bytes[bad.url] == 0
    assert any(bad.url in r.getMessage() and "faulty" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["truncate", "garbage_manifest", "huge_manifest"])
async def test_malformed_responses_fall_back(origin, tmp_path, mode):
    run, store, ckpt, _ = origin
    async with serving(store) as good, proxy(good.url, mode) as bad:
        res = await _fetch(run, [bad.url, good.url], tmp_path / "out", step=1)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
    if mode == "truncate":
        assert res.faulty_sources == {}, "a dropped connection is not evidence"
        assert res.wasted_bytes > 0 or res.source_bytes[bad.url] == 0
    else:
        assert list(res.faulty_sources) == [bad.url]


async def test_every_source_bad_fails_cleanly(origin, tmp_path):
    run, store, _, _ = origin
    async with serving(store) as good, proxy(good.url, "corrupt") as bad:
        with pytest.raises(FetchError, match="every source served bad data") as e:
            await _fetch(run, [bad.url], tmp_path / "out", step=1)
    assert list(e.value.faulty_sources) == [bad.url]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("why", ["foreign_key", "other_run"])
async def test_forged_manifest_rejected_nothing_stored(tmp_path, why):
    run = make_run()
    other = make_run()
    ckpt = write_checkpoint(tmp_path / "m.safetensors", 0.5)
    if why == "foreign_key":  # a store that trusts another key serves a manifest for our run ID
        forger = make_store(run, tmp_path / "forger")
        forger.authorities = type(run.authorities)(coordinator=other.key.public_key, validators=frozenset())
        from node.shardcast.publish import publish_checkpoint

        publish_checkpoint(forger, [ckpt], step=1, key=other.key, piece_size_bytes=PIECE)
    else:
        forger = make_store(other, tmp_path / "forger")
        publish(other, forger, ckpt, 1)
    async with serving(forger) as bad:
        with pytest.raises(FetchError, match="no source has a valid manifest") as e:
            await _fetch(run, [bad.url], tmp_path / "out", step=1)
    assert ("coordinator" if why == "foreign_key" else "run") in str(e.value)
    assert list(e.value.faulty_sources) == [bad.url]
    assert list(tmp_path.glob("*out*")) == [] and not list(tmp_path.glob(".*partial"))


async def test_relay_killed_mid_transfer(origin, tmp_path):
    run, store, ckpt, _ = origin
    async with serving(store) as up, proxy(up.url, delay_s=0.004) as a, proxy(up.url, delay_s=0.004) as b:
        task = asyncio.create_task(_fetch(run, [a.url, b.url], tmp_path / "out", step=1))
        await wait_until(lambda: a.pieces_completed >= 3 and b.pieces_completed >= 3, timeout_s=20)
        await a.kill()
        res = await asyncio.wait_for(task, 60)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
    assert res.faulty_sources == {}, "a dead relay is not a faulty one"
    assert res.source_bytes[b.url] > res.source_bytes[a.url]


@pytest.mark.slow
async def test_killed_fetch_resumes_without_redownloading(origin, tmp_path):
    """A real `intellect-node fetch` process is SIGKILLed mid-way; the restart downloads only the rest."""
    run, store, ckpt, env = origin
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(dump_run_spec(run.signed))
    total = ckpt.stat().st_size
    async with serving(store) as up, proxy(up.url, delay_s=0.01) as slow:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; from node.cli import main; sys.exit(main())", "fetch", "--run", str(spec_path), "--step", "1", "--source", slow.url,
            "--out", str(tmp_path / "out"), "--concurrency", "2",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        try:
            await wait_until(lambda: slow.pieces_completed >= 8, timeout_s=30)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), 10)
        assert not (tmp_path / "out").exists()
        served_before = slow.piece_bytes_sent
        async with proxy(up.url) as counter:
            res = await _fetch(run, [counter.url], tmp_path / "out", step=1)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
    assert res.pieces_resumed >= 8
    assert res.bytes_resumed + res.bytes_downloaded == total
    assert counter.piece_bytes_sent == res.bytes_downloaded, "only the missing pieces crossed the wire"
    assert counter.piece_bytes_sent <= total - 8 * PIECE
    assert served_before > 0


async def test_retention_during_fetch_of_kept_step(tmp_path):
    run = make_run(keep_steps=2)
    store = make_store(run, tmp_path / "origin")
    for step in (1, 2):
        publish(run, store, write_checkpoint(tmp_path / f"s{step}.safetensors", 2.0, seed=step, shared_prefix_seed=5), step)
    want = (tmp_path / "s2.safetensors").read_bytes()
    async with serving(store) as up, proxy(up.url, delay_s=0.003) as slow:
        task = asyncio.create_task(_fetch(run, [slow.url], tmp_path / "out", step=2))
        await wait_until(lambda: slow.pieces_completed >= 4, timeout_s=20)
        publish(run, store, write_checkpoint(tmp_path / "s3.safetensors", 2.0, seed=3, shared_prefix_seed=5), 3)
        assert store.steps() == [2, 3], "step 1 pruned while step 2 is being fetched"
        res = await asyncio.wait_for(task, 60)
    assert res.step == 2 and (tmp_path / "out" / "s2.safetensors").read_bytes() == want


async def test_no_source_has_step(origin, tmp_path):
    run, store, _, _ = origin
    async with serving(store) as a:
        with pytest.raises(FetchError, match="step 9"):
            await _fetch(run, [a.url], tmp_path / "out", step=9)
    with pytest.raises(FetchError, match="no source has a valid manifest"):
        await _fetch(run, ["http://127.0.0.1:9"], tmp_path / "out", step=1)


def test_forged_envelope_body_equal_but_wrong_signer_rejected_by_store(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    env = publish(run, store, write_checkpoint(tmp_path / "m.safetensors", 0.2), 1)
    other = make_store(run, tmp_path / "other")
    with pytest.raises(SignatureError, match="coordinator"):
        other.add_manifest(seal(NodeKey.generate(), run.run_id, env.body))
    assert other.steps() == [] and not any(Path(other.root).rglob("*.manifest"))
