"""Shared types of the reward functions: errors, limits and results."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ProtocolError

__all__ = ["LIMIT_KINDS", "RewardError", "RewardLimitExceeded", "RewardLimits", "RewardResult", "SandboxLimits"]

GIB = 1024**3
MIB = 1024**2


class RewardError(ProtocolError):
    """A reward that cannot be computed because its *inputs* are unusable (a task of an unknown
    type, negative lengths) or the scoring machinery is missing (no bubblewrap, a sandbox that
    cannot start). A wrong or malformed completion is never an error: it scores 0."""


LIMIT_KINDS = ("wall", "cpu", "memory", "output")
"""Resource limits a reward computation can hit (see :attr:`RewardResult.limit_hit`)."""


class RewardLimitExceeded(RewardError):
    """Scoring hit a resource limit (``kind`` in :data:`LIMIT_KINDS`) before the completion's
    reward was known for sure. Raised by :meth:`RewardResult.raise_if_limited`, never by
    :func:`~protocol.rewards.compute_reward` itself (which returns the 0 reward and sets
    ``limit_hit``). Wall and CPU limits depend on the scoring machine's load, so a verdict based
    on one is not evidence against the worker.

    Attributes:
        kind: which limit, one of :data:`LIMIT_KINDS`.
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"reward limit {kind!r} hit: {detail}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits for running one candidate program (the code reward).

    Attributes:
        cpu_time_s: CPU seconds per child process (RLIMIT_CPU; SIGXCPU, then SIGKILL 1 s later).
        wall_time_s: wall-clock seconds per sandbox run; on expiry the sandbox's whole pid
            namespace is killed.
        total_wall_time_s: wall-clock seconds for all child processes of one completion (stdin/
            stdout tasks start one per test case); once spent, the remaining cases fail.
        memory_bytes: address-space limit per process (RLIMIT_AS), in bytes. Without cgroups the
            sandbox's total is at most ``processes × memory_bytes + tmpfs_bytes``.
        output_bytes: most bytes the program may write to stdout, and to stderr (pipes this
            process drains; past it the sandbox is killed, limit ``"output"``), and the largest
            file it may write in its tmpfs (RLIMIT_FSIZE), in bytes.
        processes: processes and threads the sandbox's user may run at once (RLIMIT_NPROC,
            counted in the sandbox's own user namespace, so concurrent sandboxes do not share
            it); bwrap's init and the harness count, leaving ``processes − 2`` to the program.
        open_files: open file descriptors per process (RLIMIT_NOFILE).
        tmpfs_bytes: everything the sandbox can write, in bytes (tmpfs pages are memory): its
            working folder ``/tmp`` gets 7/8, ``/dev/shm`` 1/8 (at least 1 MiB each); the root
            and ``/dev`` are read-only.
        tmp_root: unused since the sandbox's folder is a tmpfs inside it; kept so existing
            configurations still load.
    """

    cpu_time_s: int = 10
    wall_time_s: float = 15.0
    total_wall_time_s: float = 60.0
    memory_bytes: int = 1 * GIB
    output_bytes: int = 16 * MIB
    processes: int = 8
    open_files: int = 64
    tmpfs_bytes: int = 64 * MIB
    tmp_root: str | None = None

    def __post_init__(self) -> None:
        if self.cpu_time_s < 1 or self.wall_time_s <= 0 or self.total_wall_time_s <= 0:
            raise RewardError("sandbox time limits must be positive (cpu_time_s ≥ 1 s)")
        if self.memory_bytes < 64 * MIB or self.output_bytes < 1024:
            raise RewardError("sandbox needs memory_bytes ≥ 64 MiB and output_bytes ≥ 1 KiB")
        if not (1 <= self.processes <= 4096 and 16 <= self.open_files <= 65536 and self.tmpfs_bytes >= MIB):
            raise RewardError("sandbox needs 1–4096 processes, 16–65536 open files and tmpfs_bytes ≥ 1 MiB")


@dataclass(frozen=True, slots=True)
class RewardLimits:
    """Resource bounds of reward computation.

    Attributes:
        math_timeout_s: wall seconds for one ``math_verify`` check (parse both sides and
            compare) in a verifier process, which is killed and replaced when it runs over.
        math_memory_bytes: address-space limit of each verifier process (RLIMIT_AS), in bytes.
        max_answer_chars: longest extracted math answer that is parsed at all; longer answers
            score 0 before any parsing.
        sandbox: limits of the code sandbox.
    """

    math_timeout_s: int = 5
    math_memory_bytes: int = 1 * GIB
    max_answer_chars: int = 1000
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)


@dataclass(frozen=True, slots=True)
class RewardResult:
    """The reward of one completion.

    Attributes:
        task_reward: r_task, 1.0 for a correct answer or all tests passing, else 0.0.
        reward: r_task − λ·|length − target| (just r_task without a target length).
        detail: a short human-readable reason (for logs and verdicts; not compared).
        limit_hit: ``None`` when the reward is the completion's own; otherwise the resource
            limit (one of :data:`LIMIT_KINDS`) that stopped scoring before a test failed, so the
            0 reward may be this machine's (load, memory) rather than the completion's. A
            completion can hit a limit on purpose (an endless loop), so a limit is never a pass.
        outcome: for code rewards, a SHA-256 (hex) of what the program observably did (each
            run's exit status, its stdout or its test records, up to the first failing test);
            ``None`` for math. Two scorings of one completion with different outcomes show a
            program whose result is not a function of its input (``validator.rewards``). Local
            to the scoring node: never sent, never compared between nodes.
        env_fault: environment tasks only: ``None``, or what went wrong in the run's environment's
            own reward code (``protocol.envs.sandboxed.ENV_FAULTS``: it crashed, ran over a limit,
            or returned no score in [0, 1]); the reward is then 0 and says nothing about the
            completion: the environment's fault, never the worker's.
    """

    task_reward: float
    reward: float
    detail: str
    limit_hit: str | None = None
    outcome: str | None = None
    env_fault: str | None = None

    def raise_if_limited(self) -> None:
        """Raise :class:`RewardLimitExceeded` when scoring hit a limit.

        Raises:
            RewardLimitExceeded: if ``limit_hit`` is set.
        """
        if self.limit_hit is not None:
            raise RewardLimitExceeded(self.limit_hit, self.detail)
