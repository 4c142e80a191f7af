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

``math-verify`` bounds its time with ``signal.alarm``, which works only on the main thread. Off
the main thread its timeouts are switched off and time is bounded only by refusing answers
longer than ``max_answer_chars``; callers that need a hard bound should score in a process pool
(the pool's workers run rewards on their main thread, where the alarm works).
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

from protocol.rewards.base import RewardLimits

logger = logging.getLogger(__name__)

__all__ = ["extract_boxed", "extract_math_answer", "math_reward"]

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


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces) or ``\\boxed x``.

    Returns:
        The content, or ``None`` when there is no complete box.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
            i += 1
    spaced: list[str] = _BOXED_SPACE_RE.findall(text)
    return spaced[-1] if spaced else None


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


def _verify(gold: str, answer: str, timeout_s: int | None) -> bool:
    from math_verify import parse, verify  # heavy (sympy): imported on first math reward

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_s)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout_s))


def math_reward(completion: str, ground_truth: str, limits: RewardLimits) -> tuple[float, str]:
    """Score a math completion.

    Args:
        completion: the generated text.
        ground_truth: the task's answer (LaTeX or a number, unboxed).
        limits: ``math_timeout_s`` (main thread only) and ``max_answer_chars``.

    Returns:
        ``(1.0 or 0.0, detail)``.
    """
    answer = extract_math_answer(completion, ground_truth)
    if answer is None:
        return 0.0, "no final answer found"
    if len(answer) > limits.max_answer_chars:
        return 0.0, f"answer longer than {limits.max_answer_chars} characters"
    gold_n, answer_n = _as_number(ground_truth), _as_number(answer)
    if gold_n is not None and answer_n is not None:
        ok = gold_n == answer_n
        return (1.0 if ok else 0.0), f"number {answer!r} {'=' if ok else '≠'} {ground_truth!r}"
    on_main = threading.current_thread() is threading.main_thread()
    try:
        ok = _verify(ground_truth, answer, limits.math_timeout_s if on_main else None)
    except Exception as e:  # noqa: BLE001 - a malformed answer scores 0, whatever sympy raises
        logger.debug("math_verify failed on %r: %s", answer[:100], e)
        return 0.0, f"answer {answer[:100]!r} could not be verified: {type(e).__name__}"
    return (1.0 if ok else 0.0), f"math_verify {answer[:100]!r} {'=' if ok else '≠'} {ground_truth[:100]!r}"
