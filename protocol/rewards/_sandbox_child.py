"""The harness that runs inside the bubblewrap sandbox (standard library only; never imported
by the node). It reports raw outputs; it never decides whether a test passed.

It reads ``/job/spec.json`` (a read-only file bwrap made from the parent's memfd)::

    {"mode": "stdio" | "call" | "assert", "code": str, "record_fd": int,
     "limits": {"cpu_time_s", "memory_bytes", "output_bytes", "processes", "open_files"},
     "call": {"inputs": [[arg, ...], ...], "fn_name": str},                     # call mode
     "assert": {"prelude": str, "setup_code": str, "snippets": [str, ...]}}     # assert mode

sets its resource limits (RLIMIT_CPU, AS, FSIZE, NPROC, NOFILE, CORE = 0), then runs the
candidate. Records are JSON lines written to ``record_fd``:

* call mode: ``{"i": k, "v": value}`` or ``{"i": k, "e": "TypeName"}`` per case;
* assert mode: ``{"s": site, "v": [leaf, ...]}`` per executed assert, where each leaf is
  ``["v", value]`` or ``["e", "TypeName"]`` (the parent rewrote every ``assert`` into a call of
  ``__intellect_report__(site, *thunks)`` and keeps the expected literals to itself);
* every mode: ``{"e": "TypeName: message"}`` when the program or a test raised, ``{"limit":
  "memory"}`` on ``MemoryError``, ``{"limit": "output"}`` on ``EFBIG`` (RLIMIT_FSIZE), and
  ``{"done": true}`` at the end.

Values are encoded in a tagged JSON form: ``None``/``bool``/``int``/``float``/``str`` as
themselves, containers as ``[tag, items]`` with tags ``L`` list, ``T`` tuple, ``S`` set, ``F``
frozenset, ``D`` dict (``[[k, v], ...]``), ``B`` bytes (hex), ``C`` complex, ``Q`` deque.
Subclasses of these types are encoded through the base type's own methods, so an overridden
``__eq__``, ``__iter__`` or ``items`` changes nothing; any other type is refused. The candidate
runs in this process and can write records itself: the parent trusts none of them beyond the
values they carry.
"""

# ruff: noqa: S102 - running the candidate's code is this file's purpose

import collections
import errno
import json
import os
import resource
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

_SPEC_PATH = "/job/spec.json"
_MAX_DEPTH = 64
_MAX_ITEMS = 200_000
_PASS_THROUGH = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type)


class _NotPlain(TypeError):
    pass


def _encode(v: Any, depth: int = 0, budget: list[int] | None = None) -> Any:
    """Tagged JSON-ready form of a plain value (see the module docstring)."""
    if budget is None:
        budget = [_MAX_ITEMS]
    budget[0] -= 1
    if depth > _MAX_DEPTH or budget[0] < 0:
        raise _NotPlain("value too deep or too large")
    t = type(v)
    if v is None or t is bool:
        return v
    if isinstance(v, bool):  # pragma: no cover - bool cannot be subclassed
        return bool(v)
    if isinstance(v, int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, str):
        return str.__str__(v)
    d = depth + 1
    if isinstance(v, list):
        return ["L", [_encode(x, d, budget) for x in list.__iter__(v)]]
    if isinstance(v, tuple):
        return ["T", [_encode(x, d, budget) for x in tuple.__iter__(v)]]
    if isinstance(v, dict):
        return ["D", [[_encode(k, d, budget), _encode(x, d, budget)] for k, x in dict.items(v)]]
    if isinstance(v, frozenset):
        return ["F", [_encode(x, d, budget) for x in frozenset.__iter__(v)]]
    if isinstance(v, set):
        return ["S", [_encode(x, d, budget) for x in set.__iter__(v)]]
    if isinstance(v, (bytes, bytearray)):
        return ["B", bytes(memoryview(v)).hex()]
    if isinstance(v, complex):
        re_, im = complex.__getnewargs__(v)  # type: ignore[attr-defined]  # the base type's own method: a subclass's properties can't lie
        return ["C", [re_, im]]
    if isinstance(v, collections.deque):
        return ["Q", [_encode(x, d, budget) for x in collections.deque.__iter__(v)]]
    raise _NotPlain(f"a {t.__name__} is not a plain value")


def _decode(x: Any) -> Any:
    """Inverse of :func:`_encode`, used to hand tests plain copies of the candidate's values."""
    if not isinstance(x, list):
        return x
    tag, items = x
    if tag == "L":
        return [_decode(i) for i in items]
    if tag == "T":
        return tuple(_decode(i) for i in items)
    if tag == "S":
        return {_decode(i) for i in items}
    if tag == "F":
        return frozenset(_decode(i) for i in items)
    if tag == "D":
        return {_decode(k): _decode(v) for k, v in items}
    if tag == "B":
        return bytes.fromhex(items)
    if tag == "C":
        return complex(items[0], items[1])
    return collections.deque(_decode(i) for i in items)


def _plain(v: Any) -> Any:
    """A value the tests may compare honestly: functions, classes and modules pass through
    unchanged (they are called, not compared); data becomes an exact-type copy; anything
    else (an object whose operators could lie) is refused."""
    if type(v) in _PASS_THROUGH:
        return v
    return _decode(_encode(v))


def _items(v: Any) -> Any:
    """A list of what an iterable operand yields (the parent applies ``sorted``, ``set``, ``sum``…
    to it); other values unchanged."""
    if isinstance(v, (str, bytes, bytearray, list, tuple, dict, set, frozenset, collections.deque)) or not hasattr(v, "__iter__"):
        return v
    out: list[Any] = []
    for x in v:
        out.append(x)
        if len(out) > _MAX_ITEMS:
            raise _NotPlain("iterable too long")
    return out


def _main() -> None:
    with open(_SPEC_PATH, encoding="utf-8") as f:
        spec = json.load(f)
    record_fd = int(spec["record_fd"])
    lim = spec["limits"]
    cpu = int(lim["cpu_time_s"])
    for rlim, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (int(lim["memory_bytes"]),) * 2),
        (resource.RLIMIT_FSIZE, (int(lim["output_bytes"]),) * 2),
        (resource.RLIMIT_NPROC, (int(lim["processes"]),) * 2),
        (resource.RLIMIT_NOFILE, (int(lim["open_files"]),) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(rlim, value)

    write, dumps = os.write, json.dumps

    def record(obj: Any) -> None:
        try:
            line = dumps(obj, allow_nan=True, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as e:
            line = dumps({"e": f"unencodable record: {type(e).__name__}"})
        write(record_fd, (line + "\n").encode("utf-8", "surrogatepass"))

    def fail(e: BaseException) -> NoReturn:
        if isinstance(e, MemoryError):
            record({"limit": "memory"})
        elif isinstance(e, OSError) and e.errno == errno.EFBIG:  # RLIMIT_FSIZE (Python ignores SIGXFSZ)
            record({"limit": "output"})
        else:
            record({"e": f"{type(e).__name__}: {e}"[:300]})
        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001, S110 - a broken stdout must not hide the result
            pass
        os._exit(1)

    mode, code = spec["mode"], spec["code"]
    if mode == "stdio":
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(code, "<solution>", "exec"), ns)
        except SystemExit as e:
            if e.code not in (None, 0):
                sys.stderr.write(f"SystemExit({e.code!r})\n")
                sys.stdout.flush()
                os._exit(1)
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            fail(e)
        sys.stdout.flush()
        record({"done": True})
        os._exit(0)

    def leaf(thunk: Callable[[], Any]) -> list[Any]:
        try:
            return ["v", _encode(thunk())]
        except MemoryError:
            raise
        except BaseException as e:  # noqa: BLE001 - a failing operand is the parent's to judge
            return ["e", f"{type(e).__name__}: {e}"[:200]]

    def report(site: int, *thunks: Callable[[], Any]) -> None:
        record({"s": site, "v": [leaf(t) for t in thunks]})

    ns = {"__name__": "__solution__", "__builtins__": __builtins__,
          "__intellect_report__": report, "__intellect_plain__": _plain, "__intellect_items__": _items}
    try:
        if mode == "call":
            exec(compile(code, "<solution>", "exec"), ns)
            fn_name = spec["call"]["fn_name"]
            sol = ns.get("Solution")
            if isinstance(sol, type) and hasattr(sol, fn_name):
                fn = getattr(sol(), fn_name)
            elif callable(ns.get(fn_name)):
                fn = ns[fn_name]
            else:
                raise NameError(f"no function {fn_name!r} defined")
            for k, args in enumerate(spec["call"]["inputs"]):
                try:
                    record({"i": k, "v": _encode(fn(*args))})
                except MemoryError:
                    raise
                except BaseException as e:  # noqa: BLE001
                    record({"i": k, "e": f"{type(e).__name__}: {e}"[:200]})
        else:
            tests = spec["assert"]
            if tests["prelude"]:
                exec(compile(tests["prelude"], "<prelude>", "exec"), ns)
            exec(compile(code, "<solution>", "exec"), ns)
            ns["__intellect_report__"], ns["__intellect_plain__"], ns["__intellect_items__"] = report, _plain, _items
            if tests["setup_code"]:
                exec(compile(tests["setup_code"], "<setup_code>", "exec"), ns)
            for i, snippet in enumerate(tests["snippets"]):
                exec(compile(snippet, f"<test {i}>", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - SystemExit from the program is a failure too
        fail(e)
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001, S110
        pass
    record({"done": True})
    os._exit(0)


_main()
