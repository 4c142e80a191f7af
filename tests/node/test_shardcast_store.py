"""Shardcast store and publish: atomic content-addressed files, manifest checks, retention."""

from __future__ import annotations

import hashlib
import io

import pytest
from shardcast_fixtures import make_run, make_store, publish, write_checkpoint

from node.errors import ShardcastError, StoreError
from node.shardcast.publish import checkpoint_files, publish_checkpoint
from protocol.envelope import seal
from protocol.errors import SignatureError, WrongRunError
from protocol.identity import NodeKey
from protocol.shardcast import build_manifest, iter_pieces


def _store_files(store):
    return sorted(p.relative_to(store.root) for p in store.root.rglob("*") if p.is_file())


def test_publish_stores_every_piece_and_a_complete_step(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    ckpt = write_checkpoint(tmp_path / "model.safetensors", 1.0)
    env = publish(run, store, ckpt, 5)
    assert store.held_steps() == [5] and store.steps() == [5]
    data = ckpt.read_bytes()
    for ref in iter_pieces(env.body):
        assert store.piece_path(ref.piece_id).read_bytes() == data[ref.offset_bytes : ref.offset_bytes + ref.size_bytes]
    assert env.body.checkpoint_hash == hashlib.sha256(data).digest()
    assert not list((store.root / "tmp").iterdir()), "no temporary files left behind"
    # the same content again is a no-op; other content for the same step is refused
    assert publish(run, store, ckpt, 5).id == env.id
    with pytest.raises(ShardcastError, match="different content"):
        publish(run, store, write_checkpoint(tmp_path / "other.safetensors", 1.0, seed=9), 5)
    # a second store on the same directory (another process) sees the same state
    assert make_store(run, tmp_path / "node").held_steps() == [5]


def test_publish_refuses_a_non_coordinator_key_and_pickles(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    ckpt = write_checkpoint(tmp_path / "model.safetensors", 0.2)
    with pytest.raises(ShardcastError, match="not the coordinator"):
        publish_checkpoint(store, [ckpt], step=1, key=NodeKey.generate(), piece_size_bytes=65536)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ShardcastError, match="pickle"):
        checkpoint_files(tmp_path / "d")
    with pytest.raises(ShardcastError, match="no checkpoint"):
        checkpoint_files(tmp_path / "missing")
    assert store.steps() == []


@pytest.mark.parametrize("why", ["foreign_key", "other_run"])
def test_bad_manifest_rejected_and_nothing_stored(tmp_path, why):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    m = build_manifest(1, [("f", io.BytesIO(b"q" * 1000))], piece_size_bytes=65536)
    raw = seal(NodeKey.generate(), run.run_id, m) if why == "foreign_key" else seal(run.key, make_run().run_id, m)
    with pytest.raises(SignatureError if why == "foreign_key" else WrongRunError):
        store.add_manifest(raw)
    assert store.steps() == [] and _store_files(store) == []


def test_retention_keeps_last_k_and_shared_pieces(tmp_path):
    run = make_run(keep_steps=2)
    store = make_store(run, tmp_path / "node")
    envs = {}
    for step in (1, 2, 3):
        envs[step] = publish(run, store, write_checkpoint(tmp_path / f"s{step}.safetensors", 0.5, seed=step, shared_prefix_seed=42), step)
    assert store.held_steps() == [2, 3]
    ids = {s: {r.piece_id for r in iter_pieces(e.body)} for s, e in envs.items()}
    shared = ids[1] & ids[2]
    assert shared, "the checkpoints share their first tensor's pieces"
    for pid in ids[1] - ids[2] - ids[3]:
        assert not store.piece_path(pid).exists()
    for pid in ids[2] | ids[3]:
        assert store.piece_path(pid).exists()
    assert not (store.root / "manifests" / "1.manifest").exists()


def test_incomplete_newer_steps_are_kept(tmp_path):
    run = make_run(keep_steps=1)
    origin = make_store(run, tmp_path / "origin", keep_steps=3)
    mirror = make_store(run, tmp_path / "mirror")
    e1 = publish(run, origin, write_checkpoint(tmp_path / "a.safetensors", 0.3, seed=1), 1)
    e2 = publish(run, origin, write_checkpoint(tmp_path / "b.safetensors", 0.3, seed=2), 2)
    mirror.add_manifest(e1.raw)

    def copy(env):
        for ref in iter_pieces(env.body):
            w = mirror.piece_writer(ref.piece_id, ref.size_bytes)
            w.write(origin.piece_path(ref.piece_id).read_bytes())
            w.commit()
        return mirror.check_complete(env.body.step)

    assert copy(e1)
    mirror.add_manifest(e2.raw)  # step 2 being filled
    assert mirror.steps() == [1, 2] and mirror.held_steps() == [1]
    assert mirror.prune() == [], "step 1 is the newest complete step, step 2 is newer and incomplete"
    assert copy(e2)
    assert mirror.prune() == [1] and mirror.steps() == [2]


def test_piece_writer_refuses_bad_bytes(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    pid = hashlib.sha256(b"right").digest()
    w = store.piece_writer(pid, 5)
    w.write(b"wrong")
    assert not w.digest_matches()
    with pytest.raises(StoreError):
        w.commit()
    assert not store.has_piece(pid) and not list((store.root / "tmp").iterdir())


def test_store_skips_corrupt_manifest_files(tmp_path, caplog):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    (store.root / "manifests" / "9.manifest").write_bytes(b"not a manifest")
    assert make_store(run, tmp_path / "node").steps() == []


def test_refresh_finds_steps_another_process_published_in_step_order(tmp_path):
    run = make_run(keep_steps=8)
    server_side = make_store(run, tmp_path / "node")
    publisher = make_store(run, tmp_path / "node")  # e.g. `shardcast publish` into a served store
    for step in (10, 2, 9):
        publish(run, publisher, write_checkpoint(tmp_path / f"m{step}.safetensors", 0.1, seed=step), step)
    (server_side.root / "manifests" / "notes.manifest").write_bytes(b"not a step")  # other names skipped
    assert server_side.refresh() == [2, 9, 10]  # by step, not by file name ("10" < "2")
    assert server_side.refresh() == [] and server_side.steps() == [2, 9, 10]


def _durable_store(run, data_dir):
    from node.shardcast.store import ShardcastStore

    return ShardcastStore(data_dir, run_id=run.run_id, authorities=run.authorities, keep_steps=3, fsync=True)


def _markers(store):
    return sorted(store.root.glob("unsynced.*"))


def test_fsync_is_batched_and_the_marker_goes_with_the_sync(tmp_path):
    run = make_run()
    store = _durable_store(run, tmp_path / "node")
    data = [bytes([i]) * 1000 for i in range(3)]
    for d in data:
        w = store.piece_writer(hashlib.sha256(d).digest(), len(d))
        w.write(d)
        w.commit()
        assert store.has_piece(hashlib.sha256(d).digest()), "a verified piece is servable before the sync"
    assert len(_markers(store)) == 1, "unflushed pieces are announced by one durable marker"
    store.sync()
    assert _markers(store) == []
    # publishing syncs before the manifest appears, and leaves no marker
    env = publish(run, store, write_checkpoint(tmp_path / "c.safetensors", 0.5), 1)
    assert store.is_complete(1) and _markers(store) == [] and env.body.step == 1


def test_unclean_shutdown_reverifies_pieces(tmp_path):
    run = make_run()
    store = _durable_store(run, tmp_path / "node")
    env = publish(run, store, write_checkpoint(tmp_path / "c.safetensors", 0.5), 1)
    refs = list(iter_pieces(env.body))
    good, bad = refs[0].piece_id, refs[1].piece_id
    # as if the machine went down before the background fsync: a marker from another boot,
    # one piece file with garbage in it
    (store.root / "unsynced.4242.1").write_text("4242 another-boot\n")
    store.piece_path(bad).write_bytes(b"\0" * refs[1].size_bytes)
    again = _durable_store(run, tmp_path / "node")
    assert again.has_piece(good) and not again.has_piece(bad), "a piece that does not hash to its ID is never served"
    assert again.steps() == [1] and again.held_steps() == [], "the step is incomplete until the piece is fetched again"
    assert _markers(again) == []


def test_crashed_process_marker_from_this_boot_is_dropped_without_rehashing(tmp_path, monkeypatch):
    from node.shardcast import store as store_mod

    run = make_run()
    store = _durable_store(run, tmp_path / "node")
    publish(run, store, write_checkpoint(tmp_path / "c.safetensors", 0.5), 1)
    (store.root / "unsynced.1.1").write_text(f"{2**22 + 12345} {store_mod._boot_id()}\n")  # pid above pid_max: gone
    monkeypatch.setattr(store_mod.ShardcastStore, "verify_pieces", lambda self: pytest.fail("no re-hash after a process crash"))
    again = _durable_store(run, tmp_path / "node")
    assert again.held_steps() == [1] and _markers(again) == []


def test_publish_refuses_a_manifest_fetchers_would_refuse(tmp_path, monkeypatch):
    """A manifest over the fetch limit (protocol.shardcast.MANIFEST_FETCH_LIMIT_BYTES) is not published."""
    import node.shardcast.publish as pub

    run = make_run()
    store = make_store(run, tmp_path / "node")
    monkeypatch.setattr(pub, "MANIFEST_FETCH_LIMIT_BYTES", 1024)  # 2 MiB at 64 KiB pieces: 32 piece IDs ≈ 1.2 KB
    with pytest.raises(ShardcastError, match="larger shardcast.piece_size_bytes"):
        publish(run, store, write_checkpoint(tmp_path / "m.safetensors", 2.0), 1)
    assert store.steps() == []
