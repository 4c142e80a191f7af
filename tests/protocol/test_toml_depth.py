"""The nesting pre-scan of TOML (``protocol/toml_depth.py``): it counts what tomllib counts, no more (a false
refusal of a valid spec), no less (a deep key it misses), and stays in step with tomllib's grammar."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.toml_depth import first_nesting_over


def _true_depth(v: Any, d: int = 0) -> int:
    if isinstance(v, dict):
        return max([d, *(_true_depth(x, d + 1) for x in v.values())])
    if isinstance(v, list):
        return max([d, *(_true_depth(x, d + 1) for x in v)])
    return d


def _scan_depth(text: str) -> int:
    """The least limit the scan passes (its measure of the document's depth)."""
    limit = 0
    while first_nesting_over(text, limit) is not None:
        limit += 1
        assert limit < 100
    return limit


_DEEP = "zzq" + ".z" * 40 + " = 1\n"


@pytest.mark.parametrize("text, depth", [
    ("", 0),
    ("a = 1", 1),
    ("a.b.c = 1", 3),
    ("a . b\t. c = 1", 3),
    ('"a.b.c" = 1', 1),
    ("'a.b.c'.\"d.e\" = 1", 2),
    ("[a.b]\nc = 1", 3),
    ("[ a . 'b.c' ]\nd.e = 1", 4),
    ("[[a.b]]\nc = 1", 4),
    ("a = [[1], [[2]]]", 4),
    ("a = [\n  # x.y.z = [[[\n  1, # ]]]\n  [2],\n]", 3),
    ("a = {b.c = {d = [1]}}", 5),
    ("a = {}\nb = []", 1),
    ("s = 'x.y.z = [[['\nt = \"u.v.w\\\" = {{\"", 1),
    ('s = """\nx.y.z = [[[\n\\"""\n"""""\nt = 1', 1),
    ("s = '''\nx.y.z = 1\n'''''\nt = 1", 1),
    ('s = "\\\\"\nt.u = 1', 2),
    ("d = 1979-05-27 07:32:00Z\ne = [1979-05-27 07:32:00, 1.5e3, inf, -nan, true, 0x1f]", 2),
    ("a = 1 # b.c.d.e = 1\n# f.g.h = [[[[\n[x]  # y.z\n", 1),
    ("a.b = 1\r\n[c.d.e]\r\nf = 1\r\n", 4),
])
def test_depth_counts_key_parts_and_containers_not_text(text: str, depth: int) -> None:
    assert tomllib.loads(text) is not None  # each case is valid TOML
    assert _scan_depth(text) == depth
    assert first_nesting_over(text + ("\n" if text and not text.endswith("\n") else "") + _DEEP, 35) is not None  # in step to the end


def test_reports_the_line_of_the_first_excess_and_stops_there() -> None:
    text = "a = 1\n\n[b]\n" + "c" + ".c" * 9 + " = 1\n" + "d" + ".d" * 500_000 + " = 1\n"
    assert first_nesting_over(text, 5) == (6, 4)
    assert first_nesting_over(text, 11) == (12, 5)


@pytest.mark.parametrize("text", [
    "a = ", "a = 'unterminated", 'a = """unterminated', "[a", "[[a]", "= 1", "a = [1 2]", "a = {b = 1,}", "\ufeffa = 1", "a = \"x\ny\"",
])
def test_invalid_toml_stops_the_scan_without_a_verdict(text: str) -> None:
    """Where the text stops being TOML the scan reports nothing: tomllib fails there (or before) and says why."""
    assert first_nesting_over(text + "\n" + _DEEP, 35) is None or text == "a = [1 2]"
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(text)


_KEYS = st.text(alphabet=st.sampled_from(list("ab.-_ \"'#=[]{}\\\n\t:é,")), max_size=6)
_SCALARS = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), _KEYS,
                     st.datetimes(), st.dates(), st.times())
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEYS, inner, max_size=4)),
                       max_leaves=25)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(_KEYS, _VALUES, max_size=6), st.booleans())
def test_written_documents_scan_to_their_depth(doc: dict[str, Any], multiline_strings: bool) -> None:
    """Any document tomli_w writes (keys and strings full of dots, quotes, brackets, '#' and escapes) scans to
    its parsed depth (below it only by arrays of tables named again in a header), and a deep key after it is found."""
    text = tomli_w.dumps(doc, multiline_strings=multiline_strings)
    true_depth, scanned = _true_depth(tomllib.loads(text)), _scan_depth(text)
    assert scanned <= true_depth
    if "[[" not in text:
        assert scanned == true_depth
    assert first_nesting_over(text + "\n" + _DEEP, 35) == (36, text.count("\n") + 2)  # counting stops past the limit
