"""Round-3 hostile-peer attacks on what peers send: rosters, views, signed bodies, lease answers and
run specs. Each builds its attack in a few hundred KiB and asserts the decoder refuses it before it
has built what the bytes describe (tracemalloc peak) and with an error naming what was wrong."""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from ingest_attack_helpers import RUN, SPEC, forge

from protocol import encoding
from node.p2p.presence import unpack_view
from protocol.content import content_id
from protocol.envelope import DOMAIN, open_envelope
from protocol.errors import DecodeError, RunSpecError
from protocol.identity import NodeKey
from protocol.ingest_api import LeaseAnswerReader
from protocol.messages import Submission
from protocol.presence import (
    DELTA,
    FULL,
    ROSTER_MAX_ENTRIES,
    pack_roster,
    pack_roster_delta,
    read_roster_answer,

)
from protocol.rollout import submission_decode_limits
from protocol.runspec import parse_run_spec

PEAK_LIMIT = 4 << 20
"""Most bytes an attack below may make the decoder allocate (each describes ≥ 16 MiB of Python objects)."""


def _peak(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """What ``fn`` raised and the peak bytes it allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        error: BaseException | None = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return error, peak


def _empty_arrays(n_bytes: int, fanout: int = 4096) -> bytes:
    """A msgpack tree of arrays of at most ``fanout`` elements with empty arrays for leaves, about
    ``n_bytes`` long: one Python list per byte."""
    level = b"\x90"
    while True:
        n = min(fanout, max(1, n_bytes // len(level)))
        level = b"\xdc" + struct.pack(">H", n) + level * n
        if n < fanout or len(level) >= n_bytes:
            return level


def test_roster_answers_of_empty_arrays_are_refused_before_they_are_built() -> None:
    # a hostile hub signs the ID of whatever it serves: a FULL roster that hashes right, or a DELTA,
    # made of empty arrays within every length and size bound (8 MiB of them: 1.2 GB and 11 s on the
    # fetcher's trio loop before the fix)
    body = _empty_arrays(256 << 10)
    for answer, rid in ((bytes([FULL]) + body, bytes(content_id(body))), (bytes([DELTA]) + body, bytes(32))):
        error, peak = _peak(lambda: read_roster_answer(rid, answer, {}))
        assert isinstance(error, DecodeError) and "arrays and maps" in str(error), error
        assert peak < PEAK_LIMIT, peak
    error, peak = _peak(lambda: unpack_view(_empty_arrays(256 << 10, fanout=200)))
    assert isinstance(error, DecodeError) and "arrays and maps" in str(error), error
    assert peak < PEAK_LIMIT


def test_roster_deltas_that_lie_are_refused() -> None:
    w = [NodeKey.from_seed(bytes([i]) * 32) for i in range(1, 4)]
    envs = [forge(k, "node_record/1", {"peer_id": k.peer_id}) for k in w]
    rid, _ = pack_roster(envs[:2])
    held = {bytes(content_id(e)): e for e in envs[:2]}
    want_id, _ = pack_roster(envs[1:])
    good = pack_roster_delta(envs[:2], envs[1:])
    assert read_roster_answer(want_id, good, held) == {bytes(content_id(e)): e for e in envs[1:]}
    assert len(held) == 2  # the held copy is never modified
    cases = {
        "not held": bytes([DELTA]) + encoding.packb([[bytes(32)], []]),
        "already held": bytes([DELTA]) + encoding.packb([[], [envs[0]]]),
        "does not hash": bytes([DELTA]) + encoding.packb([[], [envs[2]]]),  # claims want_id, leaves envs[0] in
        "32-byte IDs": bytes([DELTA]) + encoding.packb([[b"short"], []]),
        r"\[gone, new\]": bytes([DELTA]) + encoding.packb([[], [], 1]),
        "unknown roster answer form": b"\x07" + good[1:],
        "no roster was held": good,
    }
    for why, answer in cases.items():
        with pytest.raises(DecodeError, match=why):
            read_roster_answer(want_id, answer, None if why == "no roster was held" else held)
    # adding more entries than a roster holds: the decoder's array bound, before any is hashed
    many = b"\x01" + b"\x92\x90\xdd" + struct.pack(">I", ROSTER_MAX_ENTRIES + 1) + b"\xc4\x01x" * (ROSTER_MAX_ENTRIES + 1)
    with pytest.raises(DecodeError, match="max_array_len|4096"):
        read_roster_answer(want_id, many, held)
    # a huge count with a tiny body
    with pytest.raises(DecodeError):
        read_roster_answer(want_id, b"\x01\x92\x90\xdd\xff\xff\xff\xff", held)
    assert rid != want_id


def _forge_raw(key: NodeKey, type_tag: str, body: bytes) -> bytes:
    """A signed envelope around canonical body bytes ``body`` (as ``forge``, without building the body in Python)."""
    mark = b"\xab" * 16
    sealed = forge(key, type_tag, mark)
    outer = msgpack.unpackb(sealed)
    unsigned = {k: v for k, v in outer.items() if k != "sig"}
    splice = encoding.packb(mark)
    signed_bytes = encoding.packb(unsigned).replace(splice, body)
    return encoding.packb({**unsigned, "sig": key.sign(DOMAIN + signed_bytes)}).replace(splice, body)


def test_signed_bodies_of_empty_arrays_are_refused_before_they_are_built() -> None:
    # any free key signs a submission; arrays nested under the run's array bound (16 here) still
    # made 1 list per byte: 32 MiB → ≈ 2.4 GB in the ingest (its bounds) or a validator (the schema's)
    tree = b"\x90"
    for _ in range(5):  # 16⁵ = 1 M empty lists in 1.2 MB
        tree = b"\xdc\x00\x10" + tree * 16
    blob = _forge_raw(NodeKey.generate(), "submission/1", b"\x81\xa6worker" + tree)
    # under the run's bounds (the ingest, a validator): an honest submission's 189 containers; under
    # the schema's alone, 173,067 (≈ 11 MB, vs. 70 MB for the 1 M lists these bytes describe)
    for limits, peak_limit in ((submission_decode_limits(SPEC), PEAK_LIMIT), (None, 16 << 20)):
        error, peak = _peak(lambda: open_envelope(blob, run_id=RUN, expect=Submission, body_limits=limits))
        assert isinstance(error, DecodeError) and "arrays and maps" in str(error), error
        assert peak < peak_limit, peak


def test_lease_answer_with_a_tree_where_a_submission_belongs_is_refused_at_once() -> None:
    def tree(depth: int) -> bytes:
        return b"\x90" if depth == 0 else b"\x94" + tree(depth - 1) * 4

    for where in ("submissions", "trainer_step"):
        t = tree(9)  # 350 KiB, 350k lists
        sub = t if where == "submissions" else b"\xc4\x01x"
        step = t if where == "trainer_step" else b"\x00"
        data = b"\x82" + msgpack.packb("submissions") + b"\x91" + sub + msgpack.packb("trainer_step") + step

        def read(data: bytes = data) -> None:
            reader = LeaseAnswerReader(4)
            for i in range(0, len(data), 1 << 16):
                reader.feed(data[i:i + (1 << 16)])
            reader.result()

        error, peak = _peak(read)
        assert isinstance(error, DecodeError) and "array or map" in str(error), error
        assert peak < PEAK_LIMIT, peak


def test_decoder_container_budget_never_refuses_what_the_limits_allow() -> None:
    # an honest submission's largest container count still decodes, and generic values too
    limits = submission_decode_limits(SPEC)
    assert limits.max_containers >= 1 + 1 + SPEC.data.tasks_per_submission * SPEC.rl.group_size * 2
    assert encoding.unpackb(encoding.packb([[1], [2], {"a": []}]), 1 << 10) == [[1], [2], {"a": []}]
    tight = encoding.DecodeLimits(16, 16, 16, 16, 4, max_containers=3)
    assert encoding.unpackb(encoding.packb([[], []]), 1 << 10, tight) == [[], []]
    with pytest.raises(DecodeError, match="more than 3 arrays and maps"):
        encoding.unpackb(encoding.packb([[], [], []]), 1 << 10, tight)


@pytest.mark.parametrize("text, why", [
    ("x = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("x = " + "{a=" * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ("[run]\nseed = " + "9" * 5000, "4300 digits"),
    ("#" * (2 << 20), "over the 1048576-byte limit"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_mant_err_mean = inf\n", "toploc.max_mant_err_mean"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_mant_err_median = nan\n", "toploc.max_mant_err_median"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = nan\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = -1e-4\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = inf\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_near_tie_fraction = 1.5\n", "toploc.max_near_tie_fraction"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_near_tie_fraction = nan\n", "toploc.max_near_tie_fraction"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_cap = inf\n", "rl.is_cap"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_cap = 1.0\n", "rl.is_cap"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = 'clip'\n", "rl.is_correction"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = 'mask'\nold_logprobs = 'behavior'\n", "needs old_logprobs"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = ['mask']\n", "rl.is_correction"),
])
def test_run_spec_decoder_bounds_its_work_and_names_the_field(text: str, why: str) -> None:
    text = text.replace("{c}", NodeKey.from_seed(b"c" * 32).peer_id)
    with pytest.raises(RunSpecError, match=why):
        parse_run_spec(text, require_signature=False)


@pytest.mark.integration
async def test_a_dribbled_presence_frame_ends_its_attachment_and_a_huge_length_is_refused_unread() -> None:
    """Live on 127.0.0.1: a worker sends its record, then the length of an 8 KiB frame and one byte
    of it every 0.1 s; its hub drops it once no whole frame came for the beat timeout (3 s at a
    0.2 s heartbeat) and answers its own callers meanwhile. A peer whose frame length says 4 GiB is
    cut off at the 4 length bytes."""
    import sys
    from pathlib import Path

    import trio

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
    from p2p_helpers import Run, shared_bridge, swarm  # noqa: I001 - the p2p test factories live in tests/node
    from test_p2p_presence import banned, counter, open_presence, raw_host, worker_record
    from waiting import wait_until

    from protocol.presence import RECORD, WORKER_FRAME_MAX_BYTES, frame

    run = Run(heartbeat_s=0.2)
    async with shared_bridge() as bridge, swarm(run, [("relay", None)], bridge=bridge) as (relay,):
        hub = relay.presence.hub
        assert hub is not None
        async with raw_host(bridge) as (w_key, w):
            stream = await open_presence(bridge, w, relay)
            await bridge.run(stream.write, frame(RECORD, worker_record(w_key, run)), timeout_s=5)
            await wait_until(lambda: w_key.peer_id in relay.peers, 10.0, "the dribbler attached")
            await bridge.run(stream.write, WORKER_FRAME_MAX_BYTES.to_bytes(4, "big"), timeout_s=5)

            async def dribble(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                task_status.started(None)
                with trio.move_on_after(15):
                    for _ in range(WORKER_FRAME_MAX_BYTES):
                        await stream.write(b"\x01")
                        await trio.sleep(0.1)

            task = await bridge.start_task(dribble, timeout_s=5)
            try:
                started = time.monotonic()
                await wait_until(lambda: w_key.peer_id not in hub.attached(), 12.0, "the dribbler detached")
                assert time.monotonic() - started < 3 * hub.beat_timeout_s
                assert await counter(relay, "beat_timeouts") >= 1
            finally:
                await task.cancel()
        async with raw_host(bridge) as (m_key, m):
            stream = await open_presence(bridge, m, relay)
            await bridge.run(stream.write, b"\xff\xff\xff\xff", timeout_s=5)
            await wait_until(lambda: banned(relay, m_key), 10.0, "the 4 GiB frame's sender cut off")
            assert await counter(relay, "refused_malformed") == 1


_S, _TS = msgpack.packb("submissions"), msgpack.packb("trainer_step")


@pytest.mark.parametrize("data, why", [
    (b"\x82" + _S + b"\xdd\xff\xff\xff\xff\xc4\x01x", "more than the 4 asked for"),  # a huge count, a tiny body
    (b"\x82" + _S + b"\x91\xc6\x00\x00\x10\x00" + b"x" * 10, "cut short"),  # a bin that says more than follows
    (b"\x83" + _S + b"\x90" + _TS + b"\x00" + msgpack.packb("x") + b"\x00", "is not"),
    (b"\x82" + _TS + b"\x00" + _S + b"\x90", "where 'submissions' belongs"),
    (b"\x82" + _S + b"\x90" + _TS + b"\xc3", "not an int"),
    (b"\x82" + _S + b"\x90" + _TS + b"\xcf" + b"\xff" * 8, "not an int"),
    (b"\x82" + _S + b"\x90" + _TS + b"\xcb\x7f\xf8" + bytes(6), "not an int"),  # NaN
    (b"\x82" + _S + b"\x90" + _TS + b"\x00" + bytes(5), "trailing bytes"),
    (b"\x82" + _S + b"\x91\xd4\x01\x00", "max_ext_len"),
])
def test_lease_answers_that_lie_about_sizes_or_types_are_refused(data: bytes, why: str) -> None:
    reader = LeaseAnswerReader(4)
    with pytest.raises(DecodeError, match=why):
        reader.feed(data)
        reader.result()


def test_a_lease_answer_bin_claiming_4_gib_stops_at_the_reader_buffer() -> None:
    reader = LeaseAnswerReader(4)
    reader.feed(b"\x82" + _S + b"\x91\xc6\xff\xff\xff\xff")
    fed = 0
    with pytest.raises(DecodeError, match="BufferFull"):
        while fed < (64 << 20):
            reader.feed(bytes(1 << 20))
            fed += 1 << 20
    assert fed <= Submission.MAX_BYTES + (2 << 20)
