import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.encoding import packb, unpackb
from protocol.errors import DecodeError

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@pytest.mark.slow
@given(values)
@settings(max_examples=300, deadline=None)
def test_round_trip_is_canonical(v):
    data = packb(v)
    assert unpackb(data, 1 << 20) == v
    assert packb(unpackb(data, 1 << 20)) == data


def test_map_order_is_independent_of_insertion():
    assert packb({"b": 1, "a": 2}) == packb({"a": 2, "b": 1})


def test_rejects_non_canonical_forms():
    # int written in a longer form than needed
    with pytest.raises(DecodeError, match="canonical"):
        unpackb(b"\xcd\x00\x01", 100)
    # unsorted map
    with pytest.raises(DecodeError, match="canonical"):
        unpackb(msgpack.packb({"b": 1, "a": 2}), 100)
    # float32 instead of float64
    with pytest.raises(DecodeError, match="canonical"):
        unpackb(msgpack.packb(1.5, use_single_float=True), 100)
    # a str that is not UTF-8
    with pytest.raises(DecodeError):
        unpackb(b"\xa2\xff\xfe", 100)


def test_rejects_nan_nonstr_keys_trailing_and_oversize():
    for bad in (math.nan, math.inf, {1: 2}, object()):
        with pytest.raises(DecodeError):
            packb(bad)
    with pytest.raises(DecodeError, match="trailing"):
        unpackb(packb(1) + b"\x00", 100)
    with pytest.raises(DecodeError, match="exceeds"):
        unpackb(packb(b"x" * 200), 100)
    with pytest.raises(DecodeError, match="empty"):
        unpackb(b"", 100)
    with pytest.raises(DecodeError):
        unpackb(b"\xc1", 100)  # never-used byte
    with pytest.raises(DecodeError):
        unpackb(b"\xd4\x01\x02", 100)  # ext type
    with pytest.raises(DecodeError):
        unpackb(b"\x91" * 5000 + b"\x00", 10000)  # nesting
