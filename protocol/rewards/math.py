"""Math reward: the final answer after ``</think>``, checked with ``math-verify``.

Rule (INTELLECT-2 / prime-rl ``verifiable_math``, with GSM8K's integer answers):

1. The answer region is the text after the last ``</think>``; a completion that opens
   ``<think>`` and never closes it has no answer (its reasoning was cut off). Without think
   tags the whole completion is the answer region.
2. The answer is the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) there, braces
   balanced. Without one, and only when the ground truth is an integer, GSM8K's ``#### 42``
   line, else the last number in the region, is taken (thousands commas allowed).
3. If both the answer and the ground truth read as plain numbers (``$``, commas, ``\\text{...}``
   units and a trailing period removed) they are compared exactly (as rationals). Otherwise
   ``math_verify.verify(parse("\\boxed{gold}"), parse("\\boxed{answer}"))`` decides.

Bounds: extraction is linear in the completion's length. Before any parsing, cheap structural
pre-checks (:func:`answer_precheck`) give 0 to answers that are too long, nest braces or
exponents too deeply, carry huge digit runs, exponents or factorials — ``\\boxed{9^{9^{9^{9}}}}``
scores 0 at once. The ``math-verify`` check then runs in a killable verifier process with a
wall and memory limit (:mod:`protocol.rewards.verifier`), never in the caller's thread.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

from protocol.rewards.base import RewardLimits
from protocol.rewards.verifier import verify_answer

logger = logging.getLogger(__name__)

__all__ = ["answer_precheck", "extract_boxed", "extract_math_answer", "math_reward"]

MAX_BRACE_DEPTH = 12
MAX_POWER_DEPTH = 2
MAX_EXPONENT = 100_000
MAX_DIGIT_RUN = 100
MAX_BOXES = 2

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_SPACE_RE = re.compile(r"\\boxed +([^\s$]+)")
_GSM8K_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_INT_RE = re.compile(r"-?\d+")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm)\{[^{}]*\}")


def answer_region(completion: str) -> str | None:
    """The text after the last ``</think>``; ``None`` when ``<think>`` is never closed."""
    if "</think>" in completion:
        return completion.rsplit("</think>", 1)[1]
    if "<think>" in completion:
        return None
    return completion


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of its ``}``, in one pass (backslash escapes skipped)."""
    match: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            match[stack.pop()] = i
        i += 1
    return match


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces) or ``\\boxed x``.

    Linear in ``len(text)`` (one brace-matching pass), whatever the completion holds.

    Returns:
        The content, or ``None`` when there is no complete box.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if starts:
        match = _matching_braces(text)
        for start in reversed(starts):
            end = match.get(start - 1)
            if end is not None:
                return text[start:end]
    spaced: list[str] = _BOXED_SPACE_RE.findall(text)
    return spaced[-1] if spaced else None


_DIGITS_RE = re.compile(r"\d+")
_BIG_FACTORIAL_RE = re.compile(r"\d{4,}\s*!|!\s*!")
_POW_RE = re.compile(r"\^|\*\*")


def _numeric_tower_value(group: str) -> int | None:
    """The value of an exponent made only of digits, ``^``/``**`` and braces, if it is at most
    :data:`MAX_EXPONENT` ``** 2``; ``-1`` if larger; ``None`` if the exponent is not numeric."""
    flat = group.replace("{", " ").replace("}", " ").replace("**", "^")
    parts = [p.strip() for p in flat.split("^")]
    if not parts or not all(p.isdigit() and len(p) <= 12 for p in parts):
        return None
    value = 1
    for p in reversed(parts):  # right-associative tower, capped
        base = int(p)
        if base in (0, 1):
            value = base
            continue
        if value > 64 or base ** value > MAX_EXPONENT**2:
            return -1
        value = base**value
    return value


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i] == " ":
        i += 1
    return i


def answer_precheck(answer: str, max_chars: int) -> str | None:
    """Structural checks that run before any parsing, in time linear in ``len(answer)``.

    Refused (scored 0, deterministically on every machine): more than ``max_chars``
    characters; braces nested deeper than :data:`MAX_BRACE_DEPTH`; more than :data:`MAX_BOXES`
    nested ``\\boxed``; a digit run longer than :data:`MAX_DIGIT_RUN`; powers nested deeper than
    :data:`MAX_POWER_DEPTH` (``a^{b^{c}}``, ``9^9^9``); a numeric exponent above
    :data:`MAX_EXPONENT` (``2^{10^{6}}``, ``9^{9^9}``); factorials of 4+ digit numbers and
    ``!!``.

    Returns:
        ``None`` when the answer may be parsed, else the reason it is refused.
    """
    if len(answer) > max_chars:
        return f"answer longer than {max_chars} characters"
    if answer.count("\\boxed") + answer.count("\\fbox") > MAX_BOXES:
        return "answer nests boxes"
    if any(len(run) > MAX_DIGIT_RUN for run in _DIGITS_RE.findall(answer)):
        return f"answer has a digit run longer than {MAX_DIGIT_RUN}"
    if _BIG_FACTORIAL_RE.search(answer):
        return "answer has a huge factorial"
    match = _matching_braces(answer)
    # Power depth: a power inside a brace group that is an exponent is one level deeper;
    # a power written right after another power's exponent (x^y^z, 2^{10}^{10}: a LaTeX
    # "double superscript") is refused outright.
    outer: list[int] = []  # per open brace: the level outside it
    closes_power: dict[int, int] = {}  # index of an exponent group's "}" -> its power depth
    level, prev_end = 0, -1
    i, n = 0, len(answer)
    while i < n:
        c = answer[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            outer.append(level)
            if len(outer) > MAX_BRACE_DEPTH:
                return f"answer nests braces deeper than {MAX_BRACE_DEPTH}"
            i += 1
            continue
        if c == "}":
            level = outer.pop() if outer else level
            if i in closes_power:
                prev_end = _skip_spaces(answer, i + 1)
            i += 1
            continue
        m = _POW_RE.match(answer, i)
        if m is None:
            i += 1
            continue
        if i == prev_end:
            return "answer has a double superscript (exponent tower)"
        depth = level + 1
        if depth > MAX_POWER_DEPTH:
            return "answer has an exponent tower"
        j = _skip_spaces(answer, m.end())
        if j < n and answer[j] == "{" and j in match:
            value = _numeric_tower_value(answer[j + 1 : match[j]])
            if value is not None and (value < 0 or value > MAX_EXPONENT):
                return f"answer has an exponent above {MAX_EXPONENT}"
            closes_power[match[j]] = depth
            outer.append(level)
            level = depth
            i = j + 1
            continue
        k = j
        while k < n and answer[k].isdigit():
            k += 1
        if k > j and int(answer[j:k]) > MAX_EXPONENT:
            return f"answer has an exponent above {MAX_EXPONENT}"
        if k == j and j < n:  # one character, or one \command
            k = j + 1
            if answer[j] == "\\":
                while k < n and answer[k].isalpha():
                    k += 1
        prev_end = _skip_spaces(answer, k)
        i = k
    return None


def extract_math_answer(completion: str, ground_truth: str) -> str | None:
    """The answer a completion gives, by the module's rule (steps 1–2).

    Args:
        completion: the generated text.
        ground_truth: the task's answer (decides whether number fallbacks apply).

    Returns:
        The answer string, or ``None`` when none can be found.
    """
    region = answer_region(completion)
    if region is None:
        return None
    boxed = extract_boxed(region)
    if boxed is not None:
        return boxed.strip()
    if not _INT_RE.fullmatch(ground_truth.strip().replace(",", "")):
        return None
    gsm: list[str] = _GSM8K_RE.findall(region)
    if gsm:
        return gsm[-1]
    numbers: list[str] = _NUMBER_RE.findall(region)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    """A plain number in ``text`` (``$``, ``\\$``, ``\\text{..}`` units, commas, ``%`` sign and a
    trailing period stripped) as an exact fraction, else ``None``."""
    t = _TEXT_RE.sub("", text)
    t = t.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\%", "").replace("%", "")
    t = t.strip().rstrip(".").strip()
    if not _PLAIN_NUMBER_RE.fullmatch(t):
        return None
    return Fraction(t.replace(",", ""))


def math_reward(completion: str, ground_truth: str, limits: RewardLimits) -> tuple[float, str, str | None]:
    """Score a math completion.

    Args:
        completion: the generated text.
        ground_truth: the task's answer (LaTeX or a number, unboxed).
        limits: ``max_answer_chars``, ``math_timeout_s`` and ``math_memory_bytes``.

    Returns:
        ``(1.0 or 0.0, detail, limit_hit)``: ``limit_hit`` is ``"wall"`` or ``"memory"`` when the
        verifier was cut off, else ``None``.

    Raises:
        RewardError: if no math verifier process can be started.
    """
    answer = extract_math_answer(completion, ground_truth)
    if answer is None:
        return 0.0, "no final answer found", None
    refused = answer_precheck(answer, limits.max_answer_chars)
    if refused is not None:
        return 0.0, refused, None
    gold_n, answer_n = _as_number(ground_truth), _as_number(answer)
    if gold_n is not None and answer_n is not None:
        ok = gold_n == answer_n
        return (1.0 if ok else 0.0), f"number {answer!r} {'=' if ok else '≠'} {ground_truth!r}", None
    ok, limit_hit, why = verify_answer(ground_truth, answer, float(limits.math_timeout_s), limits.math_memory_bytes)
    if limit_hit is not None:
        logger.debug("math check of %r hit the %s limit: %s", answer[:100], limit_hit, why)
        return 0.0, f"answer {answer[:100]!r}: {why}", limit_hit
    if why:
        return 0.0, f"answer {answer[:100]!r} {why}", None
    return (1.0 if ok else 0.0), f"math_verify {answer[:100]!r} {'=' if ok else '≠'} {ground_truth[:100]!r}", None
