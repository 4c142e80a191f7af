"""The coordinator's console: one line per trainer step for whoever watches ``intellect-train``
(the log has the same numbers at INFO; this is the CLI's own output, not a log record)."""

from __future__ import annotations

from trainer.train import StepMetrics


class StepConsole:
    """Prints each trainer step's line to stdout (``rich``, so it does not interleave with a progress bar)."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=False, soft_wrap=True)

    def step(self, m: StepMetrics, utilization: float) -> None:
        """Print one step: reward, pass rate, loss, gradient norm, clipping, entropy, mismatch KL,
        importance-ratio range, tokens/s, staleness, utilization."""
        self.console.print(
            f"[bold]step {m.step}[/bold]  reward {m.reward_mean:.3f}  pass {m.pass_rate:.3f}  loss {m.loss:+.4f}  "
            f"grad {m.grad_norm:.3f}  clipped {m.clipped_frac:.3f}  entropy {m.entropy_mean:.3f}  mismatch KL {m.mismatch_kl:.4f}  "
            f"ratio {m.is_ratio_min:.2f}-{m.is_ratio_max:.2f}  {m.tokens_per_s:.0f} tok/s  "
            f"staleness {m.staleness}  utilization {utilization:.2f}",
            highlight=False,
        )
