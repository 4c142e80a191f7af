"""Reputation-weighted spot checks (validator/spot.py, the ledger's verified history): the share each
worker gets, a selection the worker cannot predict, and a cheater under spot checks banned within the
stated bound, simulated with the real policy, ledger and keyed selection."""

from __future__ import annotations

import hashlib
import itertools
import random
from pathlib import Path

import pytest

from protocol.identity import NodeKey
from validator.judgements import Judgements
from validator.spot import (
    SPOT_DOMAIN,
    SpotCheckPolicy,
    expected_accepted_cheats,
    is_doubt,
    selected,
    submissions_to_catch,
)

VALIDATOR = NodeKey.from_seed(b"v" * 32)
OTHER_VALIDATOR = NodeKey.from_seed(b"o" * 32)


def test_share_is_full_for_new_workers_then_falls_to_the_floor() -> None:
    policy = SpotCheckPolicy(full_checks=20, min_share=0.05)
    assert [policy.share(v) for v in (0, 1, 19, 20)] == [1.0, 1.0, 1.0, 1.0]
    assert policy.share(40) == 0.5 and policy.share(200) == 0.1
    assert policy.share(400) == 0.05 and policy.share(10**6) == 0.05
    shares = [policy.share(v) for v in range(1000)]
    assert all(a >= b for a, b in itertools.pairwise(shares))  # more verified history never raises the share
    assert SpotCheckPolicy(min_share=1.0).share(10**6) == 1.0
    for bad in ({"full_checks": 0}, {"min_share": 0.0}, {"min_share": 1.5}):
        with pytest.raises(ValueError):
            SpotCheckPolicy(**bad)  # type: ignore[arg-type]


def test_doubt_reasons() -> None:
    assert is_doubt("sampling") and is_doubt("reward") and is_doubt("toploc") and is_doubt("limit_hit")
    assert not is_doubt("ok") and not is_doubt("stale_policy") and not is_doubt("reward_error") and not is_doubt("resources")


def test_selection_is_keyed_by_the_validator_and_unpredictable_to_the_worker() -> None:
    """The decision is the validator's signature of the stored submission's ID: the same for a
    re-leased submission, at the share's rate, independent between validators; a worker that keeps
    only the envelopes a public hash says are unchecked (grinding its nonce) gains nothing."""
    rng = random.Random(1)
    sids = [rng.randbytes(32) for _ in range(4000)]
    share = 0.25
    picked = [selected(VALIDATOR.sign, s, share) for s in sids]
    assert picked == [selected(VALIDATOR.sign, s, share) for s in sids]  # deterministic: a re-lease decides the same
    assert 900 <= sum(picked) <= 1100  # 4000 × 0.25 = 1000, binomial sd ≈ 27
    other = [selected(OTHER_VALIDATOR.sign, s, share) for s in sids]
    both = sum(a and b for a, b in zip(picked, other))
    assert 180 <= both <= 320  # independent: ≈ 4000 × 0.25² = 250
    # a grinding worker: of its 4000 candidate envelopes it submits those a hash of public data
    # (the validator's public key, the domain, the ID) would leave unchecked
    def public_guess(sid: bytes) -> bool:
        h = hashlib.sha256(VALIDATOR.public_key + SPOT_DOMAIN + sid).digest()
        return int.from_bytes(h[:8], "big") < share * 2**64

    ground = [p for s, p in zip(sids, picked) if not public_guess(s)]
    assert len(ground) > 2800
    assert 0.21 <= sum(ground) / len(ground) <= 0.29  # still checked at the share's rate
    assert all(selected(VALIDATOR.sign, s, 1.0) for s in sids[:10])  # share 1: always


def test_ledger_history_counts_full_accepts_and_resets_on_doubt(tmp_path: Path) -> None:
    ledger = Judgements(tmp_path / "v.sqlite")
    try:
        w = "12D3KooWworker"
        assert ledger.verified(w) == 0
        ledger.record(w, 0, "a", "ok", full=True)
        ledger.record(w, 1, "b", "ok", full=True)
        ledger.record(w, 1, "b", "ok", full=True)  # the same submission judged again: counted once
        ledger.record(w, 2, "c", "ok", full=False)  # a light check verifies nothing
        ledger.record(w, 3, "d", "stale_policy", full=True)  # the coordinator's clock: no doubt
        assert ledger.verified(w) == 2
        ledger.record(w, 4, "e", "logprobs", full=True)
        assert ledger.verified(w) == 0
        ledger.record(w, 5, "f", "ok", full=True)
        ledger.record(w, 6, "g", "limit_hit", full=False)  # a reward that differs: doubt, even from a light check
        assert ledger.verified(w) == 0
        ledger.record(w, 7, "h", "ok", full=True)
    finally:
        ledger.close()
    reopened = Judgements(tmp_path / "v.sqlite")
    try:
        assert reopened.verified(w) == 1  # survives a restart
        assert reopened.verified("someone else") == 0
    finally:
        reopened.close()


def test_stated_bounds() -> None:
    """The formulas docs/validator.md quotes."""
    assert submissions_to_catch(0.01, 0.05) == 13_813  # c = 1 %, f = 5 %: caught within 13,813 submissions with 99.9 %
    assert submissions_to_catch(0.01, 1.0) == 688
    assert submissions_to_catch(1.0, 1.0) == 1
    assert submissions_to_catch(1.0, 0.05, 0.999) == 135
    assert expected_accepted_cheats(0.05) == pytest.approx(19.0)
    assert expected_accepted_cheats(1.0) == 0.0
    with pytest.raises(ValueError):
        submissions_to_catch(0.0, 0.5)


def _simulate_cheater(ledger: Judgements, policy: SpotCheckPolicy, worker: str, rng: random.Random, cheat_fraction: float,
                      honest_first: bool, limit: int) -> tuple[int, int]:
    """One worker under the real policy, ledger and keyed selection: honest until its share reaches
    the floor (if ``honest_first``), then cheating in a fraction ``c`` of its submissions, each
    caught when checked in full. Returns (cheating phase submissions until the ban, cheating
    submissions accepted before it); ``(limit + 1, …)`` if never caught."""
    counter = 0
    while honest_first and policy.share(ledger.verified(worker)) > policy.min_share:
        sid = rng.randbytes(32)
        full = selected(VALIDATOR.sign, sid, policy.share(ledger.verified(worker)))
        ledger.record(worker, counter, sid.hex(), "ok", full=full)
        counter += 1
    accepted_cheats = 0
    for n in range(1, limit + 1):
        sid = rng.randbytes(32)
        full = selected(VALIDATOR.sign, sid, policy.share(ledger.verified(worker)))
        cheat = rng.random() < cheat_fraction
        if cheat and full:
            ledger.record(worker, counter, sid.hex(), "sampling", full=True)  # the cheat verdict the re-check reproduces: banned
            return n, accepted_cheats
        ledger.record(worker, counter, sid.hex(), "ok", full=full)
        accepted_cheats += cheat
        counter += 1
    return limit + 1, accepted_cheats


@pytest.mark.slow
@pytest.mark.parametrize("honest_first", [False, True], ids=["cheats-from-the-start", "builds-history-first"])
def test_a_cheater_under_spot_checks_is_banned_within_the_stated_bound(tmp_path: Path, honest_first: bool) -> None:
    """30 simulated cheaters (c = 10 %) against one validator with full_checks 4 and min_share 0.1:
    each is caught — and so banned once the re-check reproduces it — within the 99.9 % bound at the
    floor share, and the cheating submissions accepted before the catch average (1 − f) / f."""
    policy = SpotCheckPolicy(full_checks=4, min_share=0.1)
    c = 0.1
    bound = submissions_to_catch(c, policy.min_share, 0.999)  # 688: the worst case, a worker at the floor
    rng = random.Random(7 if honest_first else 8)
    ledger = Judgements(tmp_path / "v.sqlite")
    try:
        runs = [_simulate_cheater(ledger, policy, f"12D3KooWcheater{i}", rng, c, honest_first, 2 * bound) for i in range(30)]
    finally:
        ledger.close()
    assert all(n <= bound for n, _ in runs), sorted(n for n, _ in runs)[-3:]
    mean_accepted = sum(a for _, a in runs) / len(runs)
    expected = expected_accepted_cheats(policy.min_share)  # 9 at the floor (fewer for a cheater caught while still new)
    assert mean_accepted <= expected + 3 * (expected * (expected + 1) / len(runs)) ** 0.5
    if honest_first:
        assert mean_accepted >= expected - 3 * (expected * (expected + 1) / len(runs)) ** 0.5
