"""Prompts (pure): a task as the chat messages an engine generates from, with INTELLECT-2's
length-control instruction (paper §3.3; prime-rl's ``length_prompt_location``).
"""

from __future__ import annotations

from typing import Literal

from protocol.tasks.schema import Task, TaskError

LENGTH_CONTROL_TEMPLATE = "Think for {n} tokens before giving a response."
"""INTELLECT-2's length-control instruction (paper §3.3; prime-rl ``length_prompt_location``)."""


def _length_instruction(target_length: int | None) -> str | None:
    if target_length is None:
        return None
    if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length < 1:
        raise TaskError(f"target_length must be a positive number of tokens, got {target_length!r}")
    return LENGTH_CONTROL_TEMPLATE.format(n=target_length)


def build_prompt_text(task: Task, target_length: int | None) -> str:
    """The user prompt with INTELLECT-2's length-control suffix.

    ``task.prompt + " " + "Think for N tokens before giving a response."`` (prime-rl's
    ``length_prompt_location = "instruction"``); the task's prompt unchanged when
    ``target_length`` is ``None``.

    Args:
        task: the task.
        target_length: N, in tokens (drawn from the run spec's target lengths), or ``None``.

    Returns:
        The prompt text.

    Raises:
        TaskError: if ``target_length`` is not a positive integer.
    """
    suffix = _length_instruction(target_length)
    return task.prompt if suffix is None else f"{task.prompt} {suffix}"


def build_messages(
    task: Task,
    target_length: int | None,
    system_prompt: str | None = None,
    length_prompt_location: Literal["instruction", "system_prompt"] = "instruction",
) -> list[dict[str, str]]:
    """Chat messages for the engine, which applies the tokenizer's chat template.

    Args:
        task: the task.
        target_length: tokens for the length-control instruction, or ``None`` for none.
        system_prompt: an optional system message.
        length_prompt_location: ``"instruction"`` appends the instruction to the user message
            (:func:`build_prompt_text`); ``"system_prompt"`` puts it in the system message (after
            ``system_prompt`` if given), as prime-rl's option of the same name.

    Returns:
        ``[{"role": "system", ...}?, {"role": "user", "content": ...}]``.

    Raises:
        TaskError: on a bad ``target_length`` or ``length_prompt_location``.
    """
    if length_prompt_location not in ("instruction", "system_prompt"):
        raise TaskError(f"unknown length_prompt_location {length_prompt_location!r}")
    messages: list[dict[str, str]] = []
    if length_prompt_location == "instruction":
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": build_prompt_text(task, target_length)})
        return messages
    suffix = _length_instruction(target_length)
    system = "\n\n".join(s for s in (system_prompt, suffix) if s)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": task.prompt})
    return messages
