"""The node's overrides of py-libp2p: listed once, applied once and explicitly, refused on another py-libp2p."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.errors import GossipError, Libp2pMismatchError
from node.p2p import libp2p_patches

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_p2p_package_changes_nothing_in_py_libp2p_until_apply() -> None:
    """Before: importing node.p2p.transport / router / host re-pointed py-libp2p's module names, set an
    environment default and added log filters as a side effect of the import."""
    script = """
import logging, os
import node.p2p.service, node.p2p.host, node.p2p.transport, node.p2p.router, node.p2p.topics, node.p2p.liveness
from libp2p.pubsub import gossipsub, pubsub
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.stream_muxer import muxer_multistream
from libp2p.stream_muxer.yamux import yamux
from node.p2p import libp2p_patches
from node.p2p.transport import BoundedYamux

assert muxer_multistream.Yamux is yamux.Yamux and pubsub.RpcQueue is RpcQueue, "patched at import"
assert gossipsub.env_to_send_in_RPC is env_to_send_in_RPC
assert yamux.MAX_WINDOW_SIZE == 16 * 1024 * 1024 and pubsub.SUBSCRIPTION_CHANNEL_SIZE == 32
assert "PY_YAMUX_RELEASE_ON_READ" not in os.environ
assert not logging.getLogger("libp2p.network.swarm").filters
libp2p_patches.apply()
libp2p_patches.apply()  # once: a second call changes nothing
assert muxer_multistream.Yamux is BoundedYamux and pubsub.RpcQueue is not RpcQueue
from node.p2p.router import sender_record
assert gossipsub.env_to_send_in_RPC is sender_record and pubsub.env_to_send_in_RPC is sender_record
assert yamux.MAX_WINDOW_SIZE == 256 * 1024 and pubsub.SUBSCRIPTION_CHANNEL_SIZE == 1024
assert "PY_YAMUX_RELEASE_ON_READ" not in os.environ  # credit is returned by our stream class instead
assert len(logging.getLogger("libp2p.network.swarm").filters) == 1
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "PY_YAMUX_RELEASE_ON_READ"}
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_every_override_names_what_it_replaces_in_the_pinned_py_libp2p() -> None:
    libp2p_patches.check()  # the installed libp2p is the pinned one, and every target is there
    targets = [o.target for o in libp2p_patches.OVERRIDES]
    assert len(targets) == len({(o.target, o.ours) for o in libp2p_patches.OVERRIDES})
    for o in libp2p_patches.OVERRIDES:
        assert o.why and o.ours and o.kind in ("module name", "method", "instance attribute", "instance class", "log filter")


def test_another_py_libp2p_version_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libp2p_patches.metadata, "version", lambda name: "0.9.0")
    with pytest.raises(Libp2pMismatchError) as info:
        libp2p_patches.check()
    assert isinstance(info.value, GossipError)
    assert info.value.installed == "0.9.0" and info.value.pinned == "0.8.1"
    assert "0.9.0" in str(info.value) and "libp2p==0.8.1" in str(info.value) and "libp2p_patches.py" in str(info.value)


def test_a_missing_name_an_override_replaces_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed private method would leave a rule silently unapplied: refused, naming it."""
    from libp2p.stream_muxer.yamux import yamux

    monkeypatch.delattr(yamux.Yamux, "_read_data_body")
    monkeypatch.delattr(yamux, "read_exactly")
    with pytest.raises(Libp2pMismatchError) as info:
        libp2p_patches.check()
    assert set(info.value.missing) == {"libp2p.stream_muxer.yamux.yamux.Yamux._read_data_body", "libp2p.stream_muxer.yamux.yamux.read_exactly"}
    assert "Yamux._read_data_body" in str(info.value)


def test_an_attribute_py_libp2p_no_longer_sets_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance attribute an override relies on is checked in the constructor's code."""
    from libp2p.pubsub.gossipsub import GossipSub

    def init(self: object) -> None:  # a GossipSub.__init__ that no longer sets graft_flood_threshold
        self.mesh = {}  # type: ignore[attr-defined]
        self.scorer = None  # type: ignore[attr-defined]

    monkeypatch.setattr(GossipSub, "__init__", init)
    with pytest.raises(Libp2pMismatchError) as info:
        libp2p_patches.check()
    assert info.value.missing == ["libp2p.pubsub.gossipsub.GossipSub.__init__.graft_flood_threshold"]


def test_adopt_refuses_an_object_of_another_class() -> None:
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    from node.p2p.transport import _WindowedStream

    with pytest.raises(TypeError, match="expected py-libp2p's YamuxStream"):
        libp2p_patches.adopt(object(), YamuxStream, _WindowedStream)
