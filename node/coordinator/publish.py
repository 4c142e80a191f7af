"""Rank 0's policy publishing: a written policy directory → the origin store (signed manifest, and a
delta from the previous step for bf16 policies) → a signed checkpoint announcement.

``docs/shardcast.md`` (§2 manifests, §9 deltas) and ``docs/protocol.md`` (``checkpoint_announcement/1``).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from node.shardcast import ShardcastStore, publish_checkpoint
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import CheckpointAnnouncement
from protocol.runspec import SignedRunSpec
from protocol.step_dirs import step_dir, step_dirs
from protocol.window import retained_steps
from trainer.checkpoint import write_base_policy
from trainer.errors import TrainerError

logger = logging.getLogger(__name__)

RECHECK_GRACE_STEPS = 1
"""Written policies the coordinator keeps beyond a node's ``shardcast.keep_steps``: a cheat verdict
on a rollout of the window's oldest step can arrive after the next publish, and the ban rule's
re-check needs that policy (without it the re-check is a benign ``unknown_checkpoint``: no ban)."""


class PolicyPublisher:
    """Publishes each policy step the training loop writes, and remembers the newest.

    Args:
        origin: the coordinator's Shardcast origin store.
        key: the coordinator key (signs manifests and announcements).
        signed: the signed run spec.
        policies_dir: where the loop writes ``step-<N>`` model directories.
        origin_url: the URL announcements name (the coordinator's public HTTP URL).
        on_published: called with ``(step, announcement envelope bytes, seconds spent publishing)``.
    """

    def __init__(self, origin: ShardcastStore, key: NodeKey, signed: SignedRunSpec, policies_dir: Path, origin_url: str,
                 on_published: Callable[[int, bytes, float], None]) -> None:
        self.origin = origin
        self.key = key
        self.signed = signed
        self.spec = signed.spec
        self.policies_dir = Path(policies_dir)
        self.origin_url = origin_url
        self.on_published = on_published
        self.published_step = -1
        """The newest policy step published (−1 before the base is)."""
        self.publish_s: dict[int, float] = {}
        """Step → seconds from a written policy to its signed manifest in the origin."""
        self.published_at: dict[int, float] = {}
        """Step → wall clock (Unix seconds) when it was announced."""
        self.sizes: dict[int, tuple[int, int | None]] = {}
        """Step → (bytes of the full checkpoint, bytes of its delta from the previous step or ``None``)."""

    def start(self, step: int, base_dir: Path | None) -> None:
        """At start: policy 0 is the base as it is (no gather). On resume, the newest policy the
        origin holds up to the saved ``step`` is announced again (with ``rl.publish_every`` > 1 the
        saved step may not have been published: the loop publishes before it saves the state).

        Raises:
            TrainerError: a resumed run whose origin holds no policy up to ``step``.
        """
        held = [s for s in self.origin.held_steps() if s <= step]
        if held:
            self.publish(max(held), [])
        elif step == 0 and base_dir is not None:
            out = step_dir(self.policies_dir, 0)
            shutil.rmtree(out, ignore_errors=True)
            self.publish(0, write_base_policy(base_dir, out))
        else:
            raise TrainerError(f"resumed at step {step} but the origin store holds no policy up to that step (was the origin directory "
                               "removed?)")

    def publish(self, step: int, files: list[Path]) -> None:
        """Publish the policy of ``step`` written to ``files``, then announce it. A step the origin
        already holds (published before a restart) is announced as it went out."""
        t0 = time.monotonic()
        env = self.origin.manifest(step)
        if env is None:
            # bf16 policies also go out as a delta from the previous published step (docs/shardcast.md §9)
            deltas = self.spec.publishes_deltas and self.published_step >= 0
            env = publish_checkpoint(self.origin, files, step=step, key=self.key, piece_size_bytes=self.spec.shardcast.piece_size_bytes,
                                     delta_from=self.published_step if deltas else None)
            self._prune(step)
        elif files:
            logger.warning("policy step %d was published before a restart; its manifest stays as it went out", step)
        self.published_step = step
        self.publish_s[step] = time.monotonic() - t0
        delta = self.origin.delta(step)
        self.sizes[step] = (sum(f.size_bytes for f in env.body.files), delta.body.size_bytes if delta is not None else None)
        self.published_at[step] = time.time()
        ann = seal(self.key, self.signed.run_id, CheckpointAnnouncement(step=step, manifest_id=env.id, checkpoint_hash=env.body.checkpoint_hash,
                                                                        origin_url=self.origin_url))
        self.on_published(step, ann, self.publish_s[step])
        logger.info("published policy step %d", step, extra={"step": step})

    def policy_dir(self, step: int) -> Path | None:
        """The written policy of ``step`` (for the ban re-check and evaluation), if still kept."""
        path = step_dir(self.policies_dir, step)
        return path if (path / "config.json").is_file() else None

    def _prune(self, step: int) -> None:
        """Remove written policies outside the retention rule (:func:`protocol.window.retained_steps`)
        with ``shardcast.keep_steps`` + :data:`RECHECK_GRACE_STEPS`; ``step`` is always kept."""
        dirs = step_dirs(self.policies_dir)
        keep = retained_steps((s for s, _ in dirs), self.spec.shardcast.keep_steps + RECHECK_GRACE_STEPS, in_use=step)
        for s, p in dirs:
            if s not in keep:
                shutil.rmtree(p, ignore_errors=True)
