"""Reward functions, one implementation shared by the worker and the validator.

* ``compute.py`` — :func:`compute_reward`, the entry point: task reward by type, then the
  length penalty; :func:`compute_rewards`, the same for many (a run's environment scores them in batches).
* ``math.py`` — ``verifiable_math``: final answer after ``</think>``, last ``\\boxed{}`` (GSM8K
  number fallback), structural pre-checks, ``math-verify``.
* ``verifier.py`` / ``_math_worker.py`` — killable math-verify processes (wall and memory limits).
* ``code.py`` — ``prime_rl_code``: last fenced block, run against all tests.
* ``sandbox.py`` / ``_sandbox_child.py`` — the bubblewrap sandbox and the harness inside it
  (``sandbox_status()`` is the cheap availability check).
* ``asserts.py`` — assert tests split into sandbox-evaluated operands and parent-side checks.
* ``length.py`` — r = r_task − λ·|len − target| (INTELLECT-2, λ = 0.0003).
* ``base.py`` — :class:`RewardError`, :class:`RewardLimitExceeded`, :class:`RewardLimits`,
  :class:`SandboxLimits`, :class:`RewardResult`.
"""

from protocol.rewards.base import RewardError, RewardLimitExceeded, RewardLimits, RewardResult, SandboxLimits
from protocol.rewards.compute import compute_reward, compute_rewards
from protocol.rewards.length import INTELLECT2_LENGTH_PENALTY_LAMBDA, length_penalty

__all__ = [
    "INTELLECT2_LENGTH_PENALTY_LAMBDA",
    "RewardError",
    "RewardLimitExceeded",
    "RewardLimits",
    "RewardResult",
    "SandboxLimits",
    "compute_reward",
    "compute_rewards",
    "length_penalty",
]
