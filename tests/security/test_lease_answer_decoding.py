"""What a validator reads from an ingest's lease answer (``protocol/ingest_api.py`` ``LeaseAnswerReader``).

A lease answer comes from whatever answers at the ingest URL: a tree where a submission belongs is
refused before it is built (tracemalloc peak), sizes and types that lie are refused naming what was
wrong, and a bin claiming 4 GiB stops at the reader's buffer.
"""

from __future__ import annotations

import msgpack
import pytest
from alloc_helpers import PEAK_LIMIT, peak

from protocol.errors import DecodeError
from protocol.ingest_api import LeaseAnswerReader
from protocol.messages import Submission


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

        error, top = peak(read)
        assert isinstance(error, DecodeError) and "array or map" in str(error), error
        assert top < PEAK_LIMIT, top


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
