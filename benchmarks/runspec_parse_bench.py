"""How long a node takes to refuse (or read) a run spec of a hostile shape: ``tomllib`` alone vs ``parse_run_spec``.

``tomllib``'s work per key grows with the key's depth (``protocol/toml_depth.py``): one long dotted key is
quadratic, a deep table header makes every line under it cost its depth. ``parse_run_spec`` scans the
nesting first (``MAX_SPEC_DEPTH``) and refuses such text before parsing it. Per shape this prints the
text's size, ``tomllib.loads`` alone (what ``parse_run_spec`` did before the scan), the scan alone and
``parse_run_spec`` (scan + parse + schema), and their ratio. The shapes within ``MAX_SPEC_DEPTH`` show
what the scan costs on text ``tomllib`` reads anyway, up to the 1 MiB limit.

    python benchmarks/runspec_parse_bench.py                 # every shape
    python benchmarks/runspec_parse_bench.py --only dotted   # shapes whose name contains "dotted"
"""

from __future__ import annotations

import argparse
import time
import tomllib
from collections.abc import Callable

from protocol.errors import RunSpecError
from protocol.runspec import MAX_SPEC_BYTES, MAX_SPEC_DEPTH, parse_run_spec
from protocol.toml_depth import first_nesting_over


def _fill(line: Callable[[int], str], size: int = MAX_SPEC_BYTES - 4096) -> str:
    out, n, i = [], 0, 0
    while n < size:
        out.append(line(i))
        n += len(out[-1])
        i += 1
    return "".join(out)


def _deep(parts: int) -> str:
    return "x" + ".x" * (parts - 1)


SHAPES: dict[str, Callable[[], str]] = {
    "dotted key, 15,000 parts (30 KB)": lambda: _deep(15_000) + " = 1\n",
    "dotted key, 20,000 parts (40 KB)": lambda: _deep(20_000) + " = 1\n",
    "header of 1,000 parts, 1 MiB of short lines": lambda: f"[{_deep(1_000)}]\n" + _fill(lambda i: f"k{i}=1\n"),
    f"header of {MAX_SPEC_DEPTH - 1} parts, 1 MiB of short lines": lambda: f"[{_deep(MAX_SPEC_DEPTH - 1)}]\n" + _fill(lambda i: f"k{i}=1\n"),
    f"1 MiB of dotted keys of {MAX_SPEC_DEPTH} parts": lambda: _fill(lambda i: f"{_deep(MAX_SPEC_DEPTH - 1)}.k{i} = 1\n"),
    "1 MiB of `k = i` lines": lambda: _fill(lambda i: f"k{i} = {i}\n"),
    "1 MiB of URL strings with dots": lambda: _fill(lambda i: f'u{i} = "https://a.b.c.d/x.y.z?q=1.2.3#f"\n'),
    "array of 500,000 integers": lambda: "k = [" + "1," * ((MAX_SPEC_BYTES - 4096) // 2) + "]\n",
    "arrays 30 deep, 1 MiB of lines": lambda: _fill(lambda i: f"k{i} = " + "[" * 30 + "]" * 30 + "\n"),
}


def _time(f: Callable[[], object]) -> tuple[float, str]:
    t0 = time.perf_counter()
    try:
        f()
        outcome = "ok"
    except (RunSpecError, tomllib.TOMLDecodeError, RecursionError, ValueError) as e:
        outcome = type(e).__name__
    return time.perf_counter() - t0, outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run only shapes whose name contains this")
    args = ap.parse_args()
    print(f"{'shape':48s} {'KiB':>6s} {'tomllib s':>10s} {'scan s':>8s} {'parse_run_spec s':>17s} {'ratio':>7s}  outcome")
    for name, make in SHAPES.items():
        if args.only not in name:
            continue
        text = make()
        t_toml, _ = _time(lambda: tomllib.loads(text))  # noqa: B023
        t_scan, _ = _time(lambda: first_nesting_over(text, MAX_SPEC_DEPTH))  # noqa: B023
        t_spec, outcome = _time(lambda: parse_run_spec(text, require_signature=True))  # noqa: B023
        print(f"{name:48s} {len(text) / 1024:6.0f} {t_toml:10.3f} {t_scan:8.3f} {t_spec:17.3f} {t_toml / t_spec:6.1f}x  {outcome}",
              flush=True)


if __name__ == "__main__":
    main()
