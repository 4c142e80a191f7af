"""Shared types of the reward functions: errors, limits and results."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ProtocolError

__all__ = ["RewardError", "RewardLimits", "RewardResult", "SandboxLimits"]

GIB = 1024**3
MIB = 1024**2


class RewardError(ProtocolError):
    """A reward that cannot be computed because its *inputs* are unusable (a task of an unknown
    type, negative lengths, a sandbox that cannot start). A wrong or malformed completion is
    never an error: it scores 0."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits for running one candidate program (the code reward).

    Attributes:
        cpu_time_s: CPU seconds per child process (RLIMIT_CPU; SIGXCPU, then SIGKILL 1 s later).
        wall_time_s: wall-clock seconds per child process; on expiry its process group is killed.
        total_wall_time_s: wall-clock seconds for all child processes of one completion (stdin/
            stdout tasks start one per test case); once spent, the remaining cases fail.
        memory_bytes: address-space limit per child (RLIMIT_AS), in bytes.
        output_bytes: largest file the child may write, its stdout and stderr included
            (RLIMIT_FSIZE), in bytes; a child that writes more is killed (SIGXFSZ).
        tmp_root: folder under which each child's temporary working folder is made; ``None``
            for the system default (``tempfile.gettempdir()``).
    """

    cpu_time_s: int = 10
    wall_time_s: float = 15.0
    total_wall_time_s: float = 60.0
    memory_bytes: int = 2 * GIB
    output_bytes: int = 16 * MIB
    tmp_root: str | None = None

    def __post_init__(self) -> None:
        if self.cpu_time_s < 1 or self.wall_time_s <= 0 or self.total_wall_time_s <= 0:
            raise RewardError("sandbox time limits must be positive (cpu_time_s ≥ 1 s)")
        if self.memory_bytes < 64 * MIB or self.output_bytes < 1024:
            raise RewardError("sandbox needs memory_bytes ≥ 64 MiB and output_bytes ≥ 1 KiB")


@dataclass(frozen=True, slots=True)
class RewardLimits:
    """Resource bounds of reward computation.

    Attributes:
        math_timeout_s: seconds for each ``math_verify`` parse and comparison; only enforced on
            the main thread (``signal.alarm``), see :func:`protocol.rewards.math.math_reward`.
        max_answer_chars: longest extracted math answer that is parsed at all; longer answers
            score 0 (bounds sympy's time where no alarm is available).
        sandbox: limits of the code sandbox.
    """

    math_timeout_s: int = 5
    max_answer_chars: int = 1000
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)


@dataclass(frozen=True, slots=True)
class RewardResult:
    """The reward of one completion.

    Attributes:
        task_reward: r_task, 1.0 for a correct answer or all tests passing, else 0.0.
        reward: r_task − λ·|length − target| (just r_task without a target length).
        detail: a short human-readable reason (for logs and verdicts; not compared).
    """

    task_reward: float
    reward: float
    detail: str
