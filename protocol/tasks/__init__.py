"""Tasks in the INTELLECT-2 schema: loading, converting public sets, hashing, derivation, prompts.

A :class:`Task` is one row of INTELLECT-2's RL dataset (PrimeIntellect/INTELLECT-2-RL-Dataset):
``problem_id``, ``task_type`` (``verifiable_math`` or ``prime_rl_code``; ``environment`` for the
tasks of a run's own environment, :mod:`protocol.envs`, never in a task file), ``prompt`` and
``verification_info``, a JSON *string* whose content depends on the type:

* math: ``{"ground_truth": "70"}`` (LaTeX or a plain number, unboxed);
* environment: ``{"environment": "<its content hash>", "row": {...}}``, the row its ``score`` receives;
* code: ``{"test_cases": "<JSON string>"}`` where the inner JSON string is one of

  - stdin/stdout (INTELLECT-2, no ``fn_name``): ``{"inputs": [str, ...], "outputs": [str, ...]}``,
    the program reads ``inputs[i]`` on stdin and must print ``outputs[i]``;
  - call-based (INTELLECT-2, with ``fn_name``): ``{"inputs": [[arg, ...], ...], "outputs":
    [value, ...], "fn_name": "f"}``, ``f(*inputs[i])`` (or ``Solution().f`` when the program
    defines ``class Solution``) must return ``outputs[i]``;
  - assert-based (an intellect-node extension for HumanEval and MBPP, which ship assertions, not
    input/output pairs): ``{"assert_tests": [str, ...], "setup_code"?: str, "prelude"?: str}``.
    ``prelude`` runs before the solution (the imports a HumanEval prompt gives the model),
    ``setup_code`` after it (MBPP's ``test_setup_code``, which may use the solution's classes),
    then every snippet of ``assert_tests`` in the same namespace; a snippet passes when it runs
    without raising. HumanEval is one snippet, its ``check`` function followed by
    ``check(<entry_point>)``, exactly as the human-eval harness runs it; MBPP is one snippet per
    assertion of ``test_list`` (``challenge_test_list`` is left out, as in MBPP's own evaluation).

The tasks a worker solves are not its choice: :func:`derive_task_indices` maps (run seed, peer
ID, policy step, submission counter) to dataset indices, and a validator recomputes it.
:func:`dataset_hash` pins the dataset's content in the run spec.

What lives where (one concern per module; every name is importable from ``protocol.tasks``):

* ``schema``     — :class:`Task`, :class:`CodeTests`, :class:`TaskError`, :func:`math_task`, :func:`code_task` (pure).
* ``files``      — :func:`load_tasks` and the public-set converters :func:`convert` (**reads files**).
* ``derivation`` — :func:`dataset_hash`, :func:`derive_task_indices` (pure).
* ``prompts``    — :func:`build_prompt_text`, :func:`build_messages` (pure).
"""

from protocol.tasks.derivation import (
    MAX_PEER_ID_BYTES,
    TASK_DERIVATION_DOMAIN,
    canonical_task_line,
    dataset_hash,
    derive_task_indices,
)
from protocol.tasks.files import (
    CODE_INSTRUCTION,
    CONVERTER_FILES,
    CONVERTER_NAMES,
    CONVERTER_SPLITS,
    EVALUATION_ONLY,
    MATH_INSTRUCTION,
    convert,
    load_tasks,
    task_set_help,
    training_split_warning,
)
from protocol.tasks.prompts import LENGTH_CONTROL_TEMPLATE, build_messages, build_prompt_text
from protocol.tasks.schema import ENV_TASK_TYPE, TASK_TYPES, CodeTests, Task, TaskError, TaskType, code_task, math_task

__all__ = [
    "CODE_INSTRUCTION",
    "CONVERTER_FILES",
    "CONVERTER_NAMES",
    "CONVERTER_SPLITS",
    "ENV_TASK_TYPE",
    "EVALUATION_ONLY",
    "LENGTH_CONTROL_TEMPLATE",
    "MATH_INSTRUCTION",
    "MAX_PEER_ID_BYTES",
    "TASK_DERIVATION_DOMAIN",
    "TASK_TYPES",
    "CodeTests",
    "Task",
    "TaskError",
    "TaskType",
    "build_messages",
    "build_prompt_text",
    "canonical_task_line",
    "code_task",
    "convert",
    "dataset_hash",
    "derive_task_indices",
    "load_tasks",
    "math_task",
    "task_set_help",
    "training_split_warning",
]
