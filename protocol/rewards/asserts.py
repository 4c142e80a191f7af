"""Assert-based code tests, judged by the parent: split each ``assert`` into operands the
sandbox evaluates and a comparison the parent does on plain values.

A test such as ``assert min_cost([[1, 2]], 1, 1) == 8`` is rewritten, before it reaches the
sandbox, into ``__intellect_report__(SITE, lambda: __intellect_plain__(min_cost(...)))``: the
candidate's process evaluates the operand and prints its value as tagged JSON (see
:mod:`protocol.rewards._sandbox_child`); the expected literal ``8`` never leaves the parent,
which decodes the value into exact built-in types and evaluates ``== 8`` itself. So an object
whose ``__eq__`` lies cannot pass, and a program that forges its own records cannot know the
hidden expected values.

Decomposition of an assert's test expression (the message is dropped):

* ``and`` / ``or`` / ``not`` and comparisons (``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``,
  ``in``, ``not in``, and ``is`` / ``is not`` against ``None``/``True``/``False``, chains
  included) are evaluated by the parent, with Python's short-circuit order;
* their operands are *literals* (``ast.literal_eval`` succeeds; kept by the parent), calls of
  built-ins the parent evaluates itself on its operands (``abs``, ``round``, ``len``, ``sorted``,
  ``set``, ``list``, ``sum``, ``min``, ``max``, ``any``, ``all``…, ``math.isclose``; unless the
  task's own code rebinds the name, or an argument is a lambda or generator: an iterable
  argument is materialised as a list in the sandbox), or *leaves* evaluated in the sandbox; any
  other test expression is one leaf judged by truth. (A program that shadowed ``abs`` passed
  ``abs(candidate(x) - y) < 1e-6`` with a wrong answer while ``abs`` ran in the sandbox.)

Inside a leaf every call result and every name passes through ``__intellect_plain__`` (except
callees and values passed straight as call arguments, whose call's result is wrapped instead),
which replaces data by exact built-in copies and refuses other objects, so test code such as
``abs(f(x) - 0.5) < 1e-6`` computes on honest floats. What a leaf
computes from the candidate's own helpers (HumanEval/32 evaluates the prompt's ``poly``, which
the candidate defines) stays the candidate's; a program that imitates the harness can forge
leaves whose expected value is not a hidden literal (such as truth-only leaves).

Source: the assert forms of HumanEval (``check(candidate)``) and MBPP (``assert f(x) == y``).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from protocol.rewards.base import RewardError

__all__ = ["AssertPlan", "Verdict", "decode_value", "judge_assert_records", "judge_call_records", "plan_asserts"]

REPORT = "__intellect_report__"
PLAIN = "__intellect_plain__"
ITEMS = "__intellect_items__"

# Built-in functions a test applies to the candidate's values: the parent calls them itself on the
# decoded values, so a program that shadows ``abs`` (or patches ``math.isclose``) changes nothing.
# Those that consume an iterable get their argument materialised in the sandbox first (a
# candidate may return a generator), as a list.
_NUMERIC_CALLS: dict[str, Any] = {"abs": abs, "round": round, "math.isclose": math.isclose, "math.fabs": math.fabs}
_ITERABLE_CALLS: dict[str, Any] = {"sorted": sorted, "set": set, "frozenset": frozenset, "list": list, "tuple": tuple, "sum": sum,
                                   "min": min, "max": max, "any": any, "all": all}
_SIZED_CALLS: dict[str, Any] = {"len": len}
_PARENT_CALLS: dict[str, Any] = {**_NUMERIC_CALLS, **_ITERABLE_CALLS, **_SIZED_CALLS}
MAX_SITES = 10_000
MAX_DECODE_DEPTH = 80

_OPS = {
    ast.Eq: ("==", operator.eq),
    ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt),
    ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge),
    ast.In: ("in", lambda a, b: a in b),
    ast.NotIn: ("not in", lambda a, b: a not in b),
    ast.Is: ("is", operator.is_),
    ast.IsNot: ("is not", operator.is_not),
}
_OP_FN = dict(_OPS.values())
Verdict = Literal["pass", "fail", "incomplete"]
_SINGLETONS = (None, True, False)


@dataclass(frozen=True, slots=True)
class AssertPlan:
    """The sandbox's half and the parent's half of a task's assert tests.

    Attributes:
        prelude, setup_code: run before (prelude) and after (setup) the candidate, rewritten.
        snippets: the rewritten test snippets, in order.
        sites: per assert (index = site number), the parent's tree: ``("lit", value)``,
            ``("leaf", k)``, ``("truth", node)``, ``("not", node)``, ``("and"|"or", [node, ...])``,
            ``("cmp", [op, ...], [node, ...])``, ``("call", name, [node, ...], {kw: node})``.
    """

    prelude: str
    setup_code: str
    snippets: tuple[str, ...]
    sites: tuple[Any, ...]


def _is_literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


class _WrapValues(ast.NodeTransformer):
    """Route call results and names of a leaf through ``__intellect_plain__`` (not callees)."""

    def _wrap(self, node: ast.expr) -> ast.expr:
        call = ast.Call(func=ast.Name(id=PLAIN, ctx=ast.Load()), args=[node], keywords=[])
        return ast.copy_location(call, node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        # A bare name or call passed as an argument is the test's input to a function whose
        # result is wrapped; built-ins read data through protocols that cannot lie about a
        # float's or int's own value, so arguments stay as they are (MBPP passes tree nodes).
        node.args = [self._visit_argument(a) for a in node.args]
        for kw in node.keywords:
            kw.value = self._visit_argument(kw.value)
        node.func = self._visit_callee(node.func)
        return self._wrap(node)

    def _visit_argument(self, arg: ast.expr) -> ast.expr:
        if isinstance(arg, ast.Name):
            return arg
        if isinstance(arg, ast.Call):
            arg.args = [self._visit_argument(a) for a in arg.args]
            for kw in arg.keywords:
                kw.value = self._visit_argument(kw.value)
            arg.func = self._visit_callee(arg.func)
            return arg
        if isinstance(arg, (ast.List, ast.Tuple, ast.Set)):
            arg.elts = [self._visit_argument(e) for e in arg.elts]
            return arg
        if isinstance(arg, ast.Dict):
            arg.keys = [None if k is None else self._visit_argument(k) for k in arg.keys]
            arg.values = [self._visit_argument(v) for v in arg.values]
            return arg
        if isinstance(arg, ast.Starred):
            return arg
        return self.visit(arg)  # type: ignore[no-any-return]

    def _visit_callee(self, func: ast.expr) -> ast.expr:
        # the callee itself and the object a method is looked up on are not compared
        if isinstance(func, ast.Attribute):
            func.value = self._visit_callee(func.value)
            return func
        if isinstance(func, ast.Name):
            return func
        return self.visit(func)  # type: ignore[no-any-return]

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self._wrap(node) if isinstance(node.ctx, ast.Load) else node

    def visit_Lambda(self, node: ast.Lambda) -> ast.Lambda:
        return node  # its body runs with its own arguments, inside a call that is wrapped


class _Rewriter(ast.NodeTransformer):
    def __init__(self, sites: list[Any], own_names: frozenset[str] = frozenset()) -> None:
        self.sites = sites
        self.own_names = own_names  # names the task's own code binds: not the built-ins then

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        leaves: list[ast.expr] = []
        tree = self._split(node.test, leaves, top=True)
        site = len(self.sites)
        if site >= MAX_SITES:
            raise RewardError(f"more than {MAX_SITES} asserts in one task")
        self.sites.append(tree)
        thunks: list[ast.expr] = [
            ast.Lambda(
                args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
                body=_WrapValues().visit(leaf),
            )
            for leaf in leaves
        ]
        call = ast.Call(func=ast.Name(id=REPORT, ctx=ast.Load()), args=[ast.Constant(site), *thunks], keywords=[])
        return ast.copy_location(ast.Expr(value=call), node)

    def _operand(self, node: ast.expr, leaves: list[ast.expr]) -> Any:
        ok, value = _is_literal(node)
        if ok:
            return ("lit", value)
        name = self._parent_call(node)
        if name is not None:
            assert isinstance(node, ast.Call)
            materialise = name in _ITERABLE_CALLS and len(node.args) == 1 and not _is_literal(node.args[0])[0]
            args = [self._operand(ast.Call(func=ast.Name(id=ITEMS, ctx=ast.Load()), args=[a], keywords=[]) if materialise else a, leaves)
                    for a in node.args]
            kwargs = {kw.arg: self._operand(kw.value, leaves) for kw in node.keywords if kw.arg is not None}
            call = ("call", name, args, kwargs)
            if _has_leaf(call):
                return call
            # only literals: no check of the candidate's values but a call of the function under
            # test that is named like a built-in (MBPP/126 defines ``sum``): the sandbox calls it
        leaves.append(node)
        return ("leaf", len(leaves) - 1)

    def _parent_call(self, node: ast.expr) -> str | None:
        """The name of the built-in the parent evaluates for this call, if it may."""
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        if isinstance(f, ast.Name):
            name = f.id
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "math":
            name = f"math.{f.attr}"
        else:
            return None
        if name not in _PARENT_CALLS or name.split(".")[0] in self.own_names:
            return None
        values = [*node.args, *(kw.value for kw in node.keywords)]
        if any(kw.arg is None for kw in node.keywords) or any(isinstance(v, (ast.Starred, ast.Lambda)) for v in values):
            return None  # key functions run where they were written
        if any(isinstance(v, ast.GeneratorExp) for v in values) and not (name in _ITERABLE_CALLS and len(values) == 1):
            return None  # a generator is only materialised as the one iterable argument
        return name

    def _split(self, e: ast.expr, leaves: list[ast.expr], top: bool = False) -> Any:
        if isinstance(e, ast.BoolOp):
            kind = "and" if isinstance(e.op, ast.And) else "or"
            return (kind, [self._split(v, leaves) for v in e.values])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return ("not", self._split(e.operand, leaves))
        if isinstance(e, ast.Compare) and self._decomposable(e):
            operands = [self._operand(o, leaves) for o in (e.left, *e.comparators)]
            return ("cmp", [_OPS[type(op)][0] for op in e.ops], operands)
        return ("truth", self._operand(e, leaves))

    @staticmethod
    def _decomposable(e: ast.Compare) -> bool:
        operands = [e.left, *e.comparators]
        for i, op in enumerate(e.ops):
            if isinstance(op, (ast.Is, ast.IsNot)):
                pair = (operands[i], operands[i + 1])
                if not any(isinstance(o, ast.Constant) and any(o.value is x for x in _SINGLETONS) for o in pair):
                    return False  # identity of two computed objects: judged in the sandbox
        return True


_PARSE_LOCK = threading.Lock()
"""``ast.parse`` one thread at a time: CPython 3.11 keeps the AST constructor's recursion depth per
interpreter, so two threads parsing at once can fail with ``SystemError: AST constructor recursion depth
mismatch`` (python/cpython#106905; seen in the suite's two-thread canonical-solution test)."""


def _parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with _PARSE_LOCK:
        return ast.parse(source, filename=filename)


def _bound_names(sources: list[str]) -> frozenset[str]:
    """Names that the task's own code binds (definitions, assignments, imports)."""
    names: set[str] = set()
    for source in sources:
        try:
            tree = _parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # reported by plan_asserts
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    names.discard("math")  # ``import math`` binds the module whose functions the parent has too
    return frozenset(names)


def plan_asserts(assert_tests: tuple[str, ...] | list[str], setup_code: str, prelude: str) -> AssertPlan:
    """Rewrite a task's assert tests into the sandbox's half and the parent's half.

    Args:
        assert_tests: the test snippets (HumanEval: one ``check`` function and its call; MBPP: one
            ``assert`` per snippet).
        setup_code: code run after the candidate, before the snippets (MBPP's
            ``test_setup_code``).
        prelude: code run before the candidate (HumanEval's prompt imports).

    Returns:
        The plan (see :class:`AssertPlan`).

    Raises:
        RewardError: if a snippet is not valid Python or has more than ``MAX_SITES`` asserts.
    """
    sites: list[Any] = []
    rewriter = _Rewriter(sites, _bound_names([prelude, setup_code, *assert_tests]))

    def rewrite(source: str, where: str) -> str:
        if not source:
            return ""
        try:
            tree = _parse(source, where)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise RewardError(f"task {where} does not parse: {type(e).__name__}") from None
        return ast.unparse(ast.fix_missing_locations(rewriter.visit(tree)))

    prelude_out = rewrite(prelude, "prelude")
    setup_out = rewrite(setup_code, "setup_code")
    snippets = tuple(rewrite(s, f"test {i}") for i, s in enumerate(assert_tests))
    return AssertPlan(prelude=prelude_out, setup_code=setup_out, snippets=snippets, sites=tuple(sites))


def decode_value(x: Any, depth: int = 0) -> Any:
    """Rebuild exact built-in values from the sandbox's tagged JSON.

    Raises:
        ValueError: on a malformed or too deeply nested value.
    """
    if depth > MAX_DECODE_DEPTH:
        raise ValueError("value nested too deeply")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)):
        raise ValueError("malformed value")
    tag, items = x
    d = depth + 1
    try:
        if tag == "B":
            return bytes.fromhex(items)
        if tag == "C":
            return complex(float(items[0]), float(items[1]))
        if not isinstance(items, list):
            raise ValueError("malformed container")  # noqa: TRY004 - documented: every malformed value is a ValueError
        if tag == "L":
            return [decode_value(i, d) for i in items]
        if tag == "T":
            return tuple(decode_value(i, d) for i in items)
        if tag == "S":
            return {decode_value(i, d) for i in items}
        if tag == "F":
            return frozenset(decode_value(i, d) for i in items)
        if tag == "D":
            return {decode_value(k, d): decode_value(v, d) for k, v in items}
        if tag == "Q":
            return deque(decode_value(i, d) for i in items)
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"malformed value: {type(e).__name__}") from None
    raise ValueError(f"unknown value tag {tag!r}")


class _Failed(Exception):
    pass


def _eval(node: Any, leaves: list[Any]) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "leaf":
        k = node[1]
        if not (isinstance(leaves, list) and k < len(leaves)):
            raise _Failed("operand missing")
        entry = leaves[k]
        if not (isinstance(entry, list) and len(entry) == 2):
            raise _Failed("malformed operand")
        if entry[0] != "v":
            raise _Failed(str(entry[1])[:200])
        try:
            return decode_value(entry[1])
        except ValueError as e:
            raise _Failed(str(e)) from None
    if kind == "call":
        args = [_eval(a, leaves) for a in node[2]]
        kwargs = {k: _eval(v, leaves) for k, v in node[3].items()}
        return _PARENT_CALLS[node[1]](*args, **kwargs)
    if kind == "truth":
        return bool(_eval(node[1], leaves))
    if kind == "not":
        return not _eval(node[1], leaves)
    if kind in ("and", "or"):
        value: Any = None
        for child in node[1]:
            value = _eval(child, leaves)
            if bool(value) is (kind == "or"):
                return value
        return value
    ops, operands = node[1], node[2]
    left = _eval(operands[0], leaves)
    for op, operand in zip(ops, operands[1:]):
        right = _eval(operand, leaves)
        if not _OP_FN[op](left, right):
            return False
        left = right
    return True


def _has_leaf(node: Any) -> bool:
    kind = node[0]
    if kind == "leaf":
        return True
    if kind == "lit":
        return False
    if kind == "call":
        return any(_has_leaf(c) for c in [*node[2], *node[3].values()])
    if kind in ("truth", "not"):
        return _has_leaf(node[1])
    if kind in ("and", "or"):
        return any(_has_leaf(c) for c in node[1])
    return any(_has_leaf(c) for c in node[2])


def judge_assert_records(plan: AssertPlan, records: list[dict[str, Any]]) -> tuple[Verdict, str]:
    """Whether the sandbox's records show every assert of ``plan`` holding.

    Every report of a site must hold, every site that checks a value from the sandbox must have
    been reached at least once (a program cannot stop early after forging its end), and the
    harness must have reached its end (``{"done": true}``).

    Args:
        plan: the task's plan.
        records: the decoded JSON records, in order.

    Returns:
        ``(verdict, detail)``: ``"pass"``, ``"fail"`` (a check failed or the program raised), or
        ``"incomplete"`` (no check failed, but the run stopped before all ran).
    """
    hit = [0] * len(plan.sites)
    checked = 0
    for rec in records:
        if "e" in rec and "s" not in rec:
            return "fail", f"after {checked} checks: {str(rec['e'])[:200]}"
        site = rec.get("s")
        if site is None:
            continue
        if not (isinstance(site, int) and not isinstance(site, bool) and 0 <= site < len(plan.sites)):
            return "fail", "malformed record"
        try:
            ok = bool(_eval(plan.sites[site], rec.get("v")))  # type: ignore[arg-type]
        except _Failed as e:
            return "fail", f"assert {site}: {e}"
        except (TypeError, ValueError, ArithmeticError, RecursionError, MemoryError) as e:
            return "fail", f"assert {site}: {type(e).__name__}"
        if not ok:
            return "fail", f"assert {site} failed"
        hit[site] += 1
        checked += 1
    if not any(rec.get("done") is True for rec in records):
        return "incomplete", f"tests did not finish ({checked} checks passed)"
    # an assert made of literals only (``assert False`` after a call expected to raise) may be
    # skipped; one that checks the program's values must have run
    missing = [i for i, n in enumerate(hit) if n == 0 and _has_leaf(plan.sites[i])]
    if missing:
        return "fail", f"assert {missing[0]} never ran"
    return "pass", f"{checked} checks passed"


def _jsonish(v: Any) -> Any:
    """``json.loads(json.dumps(v))`` on a decoded value (tuples → lists, keys → strings)."""
    return json.loads(json.dumps(v, allow_nan=True))


def judge_call_records(outputs: list[Any], records: list[dict[str, Any]]) -> tuple[Verdict, str]:
    """Whether a call-based run's records match the expected outputs (APPS rule: the JSON
    round trip of the value equals the expected one, or its single element).

    Returns:
        ``(verdict, detail)`` as for :func:`judge_assert_records`.
    """
    got: dict[int, Any] = {}
    for rec in records:
        if "e" in rec and "i" not in rec:
            return "fail", f"after {len(got)} cases: {str(rec['e'])[:200]}"
        i = rec.get("i")
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(outputs) and i not in got:
            if "e" in rec:
                return "fail", f"case {i}: {str(rec['e'])[:200]}"
            try:
                got[i] = _jsonish(decode_value(rec.get("v")))
            except (ValueError, TypeError, RecursionError):
                return "fail", f"case {i}: not a JSON value"
    for i, expected in enumerate(outputs):
        if i not in got:
            return "incomplete", f"case {i}: no output"
        out = got[i]
        if isinstance(out, float) and math.isnan(out):
            return "fail", f"case {i}: wrong answer"
        if not (out == expected or (isinstance(expected, list) and len(expected) == 1 and out == expected[0])):
            return "fail", f"case {i}: wrong answer"
    if not any(rec.get("done") is True for rec in records):
        return "incomplete", "cases ran but the program did not finish"
    return "pass", f"all {len(outputs)} tests passed"
