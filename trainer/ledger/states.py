"""The life of a submission on the coordinator, as a state machine (``docs/architecture.md`` "The submission ledger").

::

    (admitted) ──store──▶ stored ──lease──▶ leased ──┬─accept──▶ accepted ──consume──▶ consumed ──retire──▶ retired
                             ▲                │      │             │  ▲                  │
                             └──lease expires─┘      │             │  └────unconsume─────┘ (resume)
                                                     │             ├──────────retire──────────────────▶ retired
                                                     │             └─withdraw──▶ rejected (its worker banned before a step trained it)
                                                     ├─reject──▶ rejected   (a cheat reason reproduced: the worker is banned)
                                                     ├─expire──▶ rejected   (left the async window unjudged: stale_policy)
                                                     └─ban─────▶ rejected   (its worker was banned)
       stored ──displace──▶ displaced ──restore──▶ stored   (probation's share full: a lighter prefix took its place;
                                                             restored when the same bytes are posted again)

* **admitted** — the ingest checked it (signature, window, counter, quotas) and counts it, while
  its file and index row are being written; it exists only in memory (``store.py``'s staging).
* **stored** / **leased** — durable and waiting for a verdict; *leased* while a validator holds
  it (until ``lease_until_ms``; afterwards it may be leased again). Together: *pending*.
* **accepted** — a validator accepted it: trainable while its policy step is inside the async
  window of the step being assembled (*fresh*, :mod:`protocol.window`; not a stored state).
* **rejected** — final: a validator rejected it, it left the window unjudged, or its worker was
  banned (pending work is rejected, accepted work no step has trained on yet is *withdrawn*). A
  cheat reason bans the worker only when reproduced, the audit's flag by itself (``ban_rule.py``).
* **displaced** — a stored submission never leased, of a worker on probation, whose place in
  probation's share of the disk quota a submission from an address prefix holding less of that
  share took (``ledger.py``, ``docs/protocol.md`` "Quotas"); its file is gone. No verdict, no
  evidence against its worker: it counts toward no ban and no rejection, and its counter was never
  judged, so it stays free (the same bytes posted again are *restored* to ``stored``; another
  submission may use the counter).
* **consumed** — a trainer step trained on (or dropped) every group of it; its file is kept
  until a later step's state is saved, so a resume can train it again (*unconsume*).
* **retired** — done, its file gone: consumed and superseded, left the window before a step used
  it, or unreadable (never trained).

Only the transitions in :data:`TRANSITIONS` exist; :class:`~trainer.ledger.store.SubmissionStore`
applies each as one guarded update (a row not in a transition's source states is left alone).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["PENDING", "TRANSITIONS", "State", "Transition", "public_state"]


class State(StrEnum):
    """A stored submission's state (the index's ``state`` column)."""

    STORED = "stored"
    LEASED = "leased"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    CONSUMED = "consumed"
    RETIRED = "retired"
    DISPLACED = "displaced"


PENDING = frozenset({State.STORED, State.LEASED})
"""Waiting for a verdict: what the pending quotas count and validators lease."""


class Transition(StrEnum):
    """A named change of state (``docs/architecture.md``)."""

    LEASE = "lease"
    ACCEPT = "accept"
    REJECT = "reject"
    EXPIRE = "expire"
    BAN = "ban"
    CONSUME = "consume"
    UNCONSUME = "unconsume"
    RETIRE = "retire"
    WITHDRAW = "withdraw"
    DISPLACE = "displace"
    RESTORE = "restore"


TRANSITIONS: dict[Transition, tuple[frozenset[State], State]] = {
    Transition.LEASE: (PENDING, State.LEASED),
    Transition.ACCEPT: (PENDING, State.ACCEPTED),
    Transition.REJECT: (PENDING, State.REJECTED),
    Transition.EXPIRE: (PENDING, State.REJECTED),
    Transition.BAN: (PENDING, State.REJECTED),
    Transition.CONSUME: (frozenset({State.ACCEPTED}), State.CONSUMED),
    Transition.UNCONSUME: (frozenset({State.CONSUMED}), State.ACCEPTED),
    Transition.RETIRE: (frozenset({State.ACCEPTED, State.CONSUMED}), State.RETIRED),
    Transition.WITHDRAW: (frozenset({State.ACCEPTED}), State.REJECTED),
    Transition.DISPLACE: (frozenset({State.STORED}), State.DISPLACED),
    Transition.RESTORE: (frozenset({State.DISPLACED}), State.STORED),
}
"""Each transition's source states and target state."""

_PUBLIC = {State.STORED: "pending", State.LEASED: "pending", State.ACCEPTED: "accepted", State.CONSUMED: "accepted",
           State.RETIRED: "accepted", State.REJECTED: "rejected", State.DISPLACED: "displaced"}


def public_state(state: State) -> str:
    """What the ingest's answers and ``/status`` call ``state``: ``pending``, ``accepted``, ``rejected``
    (the verdict's outcome; consumption is counted apart) or ``displaced`` (no verdict: its place
    was taken; the same bytes posted again are stored again, never answered as a duplicate)."""
    return _PUBLIC[state]
