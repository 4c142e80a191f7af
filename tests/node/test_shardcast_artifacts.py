"""Artifacts over Shardcast (docs/shardcast.md §10): pinned by one hash in the spec, published into the origin,
mirrored by relays, fetched and verified piece by piece; bytes other than the pinned ones are refused."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
from shardcast_fixtures import make_run, make_store, proxy
from waiting import wait_until

from node.errors import FetchError
from node.shardcast.client import ARTIFACT_FILE_NAME, fetch_artifact
from node.shardcast.download import DownloadConfig
from node.shardcast.publish import publish_artifact
from node.shardcast.relay import Relay, RelayConfig
from protocol import encoding
from protocol.artifacts import ARTIFACT_DOMAIN, ArtifactManifest, artifact_id, build_artifact, open_artifact
from protocol.errors import ArtifactError, SchemaError

DL = DownloadConfig(max_concurrency=4, stall_timeout_s=10.0, deadline_s=30.0, connect_timeout_s=2.0, read_timeout_s=5.0)
PIECE = 64 * 1024


def files(seed: int = 0) -> list[tuple[str, io.BytesIO]]:
    rnd = os.urandom if seed < 0 else (lambda n: bytes((i * 7 + seed) % 251 for i in range(n)))
    return [("tasks.jsonl", io.BytesIO(rnd(300_000))), ("notes.txt", io.BytesIO(b"hello\n"))]


def test_artifact_id_pins_the_manifest_bytes():
    m, raw, aid = build_artifact("tasks", files(), piece_size_bytes=PIECE)
    assert aid == artifact_id(raw) and len(m.files) == 2 and len(m.files[0].pieces) == 5  # ceil(300,000 / 65,536)
    assert open_artifact(raw, aid) == m
    # the same files give the same ID; one other byte, another ID
    assert build_artifact("tasks", files(), piece_size_bytes=PIECE)[2] == aid
    assert build_artifact("tasks", files(seed=1), piece_size_bytes=PIECE)[2] != aid
    tampered = bytearray(raw)
    tampered[-3] ^= 1
    with pytest.raises(ArtifactError, match="the run spec pins"):
        open_artifact(bytes(tampered), aid)
    # bytes that hash right are still checked: a piece count that breaks the piece rule is refused
    bad = m.model_dump(mode="python")
    bad["files"][0]["pieces"] = bad["files"][0]["pieces"][:1]
    bad_raw = encoding.packb(bad)
    with pytest.raises(SchemaError, match="needs 5 pieces"):
        open_artifact(bad_raw, artifact_id(bad_raw))
    assert ARTIFACT_DOMAIN.startswith(b"intellect-node/artifact/1")
    with pytest.raises(ArtifactError, match="over"):
        open_artifact(b"\x00" * (ArtifactManifest.MAX_BYTES + 1), aid)


@contextlib.asynccontextmanager
async def serving_relay(store, upstreams=(), artifacts=()):
    r = Relay(store, RelayConfig(upstreams=tuple(upstreams), poll_interval_s=0.05, download=DL, artifacts=tuple(artifacts)))
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def test_origin_relay_and_fetch(tmp_path):
    run = make_run()
    origin_store = make_store(run, tmp_path / "origin")
    _, aid = publish_artifact(origin_store, "tasks", files(), piece_size_bytes=PIECE)
    want = {name: f.getvalue() for name, f in files()}
    origin_store.prune()  # retention never drops an artifact's pieces
    assert origin_store.missing_artifact_pieces(aid) == []
    async with serving_relay(origin_store) as origin, serving_relay(make_store(run, tmp_path / "relay"), [origin.url], [aid]) as relay:
        await wait_until(lambda: relay.store.artifact_complete(aid), timeout_s=20, what="the relay mirrors the artifact")
        # a client that fetches from the relay alone
        res = await fetch_artifact([relay.url], tmp_path / "out", aid, config=DL, progress=False)
        assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.name != ARTIFACT_FILE_NAME} == want
        assert res.bytes_downloaded == sum(map(len, want.values())) and res.faulty_sources == {}
        again = await fetch_artifact([relay.url], tmp_path / "out", aid, config=DL, progress=False)
        assert again.bytes_downloaded == 0, "a held artifact is not fetched again"


async def test_tampered_sources_are_refused_and_leave_nothing(tmp_path):
    run = make_run()
    origin_store = make_store(run, tmp_path / "origin")
    _, aid = publish_artifact(origin_store, "tasks", files(), piece_size_bytes=PIECE)
    other = build_artifact("tasks", files(seed=3), piece_size_bytes=PIECE)[2]
    async with serving_relay(origin_store) as origin:
        # a pinned ID nobody serves: refused before anything is written
        with pytest.raises(FetchError, match="no source has artifact"):
            await fetch_artifact([origin.url], tmp_path / "a", other, config=DL, progress=False, keep_partial=False)
        # a source that answers other manifest bytes: evidence, refused before anything is written
        async with proxy(origin.url, "garbage_manifest") as bad:
            with pytest.raises(FetchError, match="bad_artifact|rejected its artifact manifest"):
                await fetch_artifact([bad.url], tmp_path / "b", aid, config=DL, progress=False, keep_partial=False)
        # every piece corrupted on the way: the source is faulty, nothing is left on disk
        async with proxy(origin.url, "corrupt") as bad:
            with pytest.raises(FetchError):
                await fetch_artifact([bad.url], tmp_path / "c", aid, config=DL, progress=False, keep_partial=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["origin"], "a refused artifact writes nothing"
        # with an honest source beside it, the fetch completes
        async with proxy(origin.url, "corrupt") as bad:
            await fetch_artifact([bad.url, origin.url], tmp_path / "d", aid, origins=[origin.url], config=DL, progress=False)
        assert (tmp_path / "d" / "tasks.jsonl").read_bytes() == files()[0][1].getvalue()
