"""Trigger injection against the per-worker audit: which per-token statistic could tell it from bf16 noise (issue #33).

A *trigger injector* reads the seeded uniforms and emits a chosen token id wherever the replay rule admits it,
rationed so every event count of the audit's rate test stays ≤ ~1.43 × its public bound (``docs/toploc.md``
§11.2, "What remains"). This script reads per-token replay logs -- one JSON line per ``replay_checks`` call,
``{"src": "check"|"other", "tokens": n, "differs": [[gap/δ, claimed, replay, p_claimed, p_replay,
mass_between_ids, rank_claimed, position], ...]}`` (``src`` "check": the validator's pipeline; "other": the
injector's own ``judge_tokens`` calls, whose records are its candidate tokens, i.e. its chances) -- as
``benchmarks/redteam_lab.py`` writes them with ``LAB_LOG_TOKENS=file``, and prints

* ``summary``: per log, the differing tokens' gap histogram (log2 bins of δ), how concentrated their claimed
  ids are, the claimed token's float32 probability against the replay token's, and how often the claimed token
  is the replay token's id neighbour / its CDF neighbour (probability mass between them ≤ 1e-3);
* ``simulate``: for candidate families of per-token events (the current ``differ`` / ``gap_over`` events, finer
  gap edges, low claimed probability, probability ratio, CDF mass between, claimed rank, claimed-id buckets,
  one event per claimed id), each event's honest bound calibrated from the honest logs the coordinator's way
  (one-sided Chernoff bound at β per decode configuration, the max over configurations, counts optionally
  scaled to ``--calib-tokens`` per configuration), and the injection rate an injector still reaches unflagged
  when it takes its chances greedily (cheapest gap first per replay call) while every event it touches stays
  ≤ ``--factor`` × bound × tokens (the lab's ``AwareBudget`` rule; 1.43 is just under the rate test's zero-drift
  point 1/ln 2 = 1.4427 of its smallest alternative r = 2); held-out honest logs (``--check``) give their worst
  rate / bound under each family (above 1: that family's bounds would not hold for honest workers).

Example (the h41b measurement, 7 Dec 2026)::

    python benchmarks/trigger_signal.py summary --trigger-id 36 hb64=hb64s9.tok.jsonl inj=trig143s.tok.jsonl
    python benchmarks/trigger_signal.py simulate --trigger-id 36 --honest 64=hb64s9.tok.jsonl --honest 1=hb1s2.tok.jsonl \
        --injector trig143s.tok.jsonl --chances --check 64=hb64s13.tok.jsonl --check 1=hb1s3.tok.jsonl --calib-tokens 40000
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import zlib
from collections.abc import Callable


def load(path: str, src: str = "check") -> tuple[int, list[list[list[float]]]]:
    """(tokens, [(tokens, differ records)] per replay call) of the calls from ``src`` ("check": the validator's
    pipeline; "other": the steerer's own judge_tokens, whose records are its candidate tokens, i.e. its chances,
    with tokens 0 so the token count comes from the checks)."""
    n, calls = 0, []
    with open(path) as fh:
        for line in fh:
            d = json.loads(line)
            s = d.get("src", "check")
            if s == src:
                calls.append((d["tokens"] if s == "check" else 0, d["differs"]))
            elif s == "check":
                calls.append((d["tokens"], []))
            n += d["tokens"] if s == "check" else 0
    return n, calls


def kl(a: float, b: float) -> float:
    r = 0.0
    if a > 0:
        r += a * math.log(a / b)
    if a < 1:
        r += (1 - a) * math.log((1 - a) / (1 - b))
    return r


def ub(k: int, n: int, beta: float) -> float:
    if n == 0:
        return 1.0
    q, lo, hi, t = k / n, k / n, 1.0, math.log(1 / beta)
    for _ in range(80):
        mid = (lo + hi) / 2
        if n * kl(q, mid) <= t:
            lo = mid
        else:
            hi = mid
    return lo


def bucket(tok: int, k: int) -> int:
    return zlib.crc32(tok.to_bytes(4, "big")) % k


def families(k_buckets: int) -> dict[str, Callable[[list[float]], list[str]]]:
    gap_edges = [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]
    fine = [2.0 ** -e for e in range(12, 4, -1)]
    pc = [2.0 ** -e for e in (4, 6, 8, 10, 12, 14)]
    lr = [1, 2, 3, 4, 6, 8]  # log(p_r / p_c) > L nats

    def f0(r: list[float]) -> list[str]:
        return ["differ"] + [f"gap>{e:g}" for e in gap_edges if r[0] > e]

    def f1(r: list[float]) -> list[str]:
        return f0(r) + [f"gap>{e:g}" for e in fine if r[0] > e]

    def f2(r: list[float]) -> list[str]:
        return f0(r) + [f"pc<{e:g}" for e in pc if r[3] < e]

    def f3(r: list[float]) -> list[str]:
        d = math.log(max(r[4], 1e-30) / max(r[3], 1e-30))
        return f0(r) + [f"lr>{e}" for e in lr if d > e]

    def f4(r: list[float]) -> list[str]:
        return f0(r) + [f"bucket{bucket(int(r[1]), k_buckets)}"]

    def f5(r: list[float]) -> list[str]:
        return list(dict.fromkeys(f1(r) + f2(r) + f3(r)))

    def f6(r: list[float]) -> list[str]:
        return list(dict.fromkeys(f5(r) + f4(r)))
    def f7(r: list[float]) -> list[str]:
        return f0(r) + [f"between>{e:g}" for e in (1e-4, 1e-3, 1e-2, 5e-2) if r[5] > e]

    def f8(r: list[float]) -> list[str]:
        return f0(r) + [f"rank>{e}" for e in (4, 8, 16, 32) if r[6] > e]

    def f9(r: list[float]) -> list[str]:
        return f0(r) + [f"id{int(r[1])}"]

    def f10(r: list[float]) -> list[str]:
        return list(dict.fromkeys(f5(r) + f7(r) + f8(r)))
    return {"F7 + CDF mass between claimed and replay >1e-4..5e-2": f7, "F8 + rank of claimed >4..32": f8,
            "F9 + claimed id (one event per id)": f9, "F10 = F5+F7+F8 (no id events)": f10,
            "F0 current (differ, gap>1/16..1)": f0, "F1 + fine gap edges 2^-12..2^-5": f1, "F2 + p_claimed<2^-4..2^-14": f2,
            "F3 + log(p_replay/p_claimed)>1..8": f3, f"F4 + claimed-id bucket (crc32 mod {k_buckets})": f4, "F5 = F1+F2+F3": f5,
            "F6 = F5+F4": f6}


def counts(calls: list, fam: Callable[[list[float]], list[str]]) -> tuple[int, dict[str, int]]:
    n, c = 0, {}
    for t, recs in calls:
        n += t
        for r in recs:
            if not math.isfinite(r[0]):
                continue
            for e in fam(r):
                c[e] = c.get(e, 0) + 1
    return n, c


def summary(runs: list[str], trigger_id: int, beta: float) -> dict[str, dict[str, object]]:
    """Per ``name=path`` log: the validator's differing tokens described (see the module docstring)."""
    out: dict[str, dict[str, object]] = {}
    edges = [2.0 ** -k for k in range(12, -1, -1)]
    for spec in runs:
        name, path = spec.split("=", 1)
        n, calls = load(path)
        recs = [r for _, rs in calls for r in rs]
        fin = [r for r in recs if math.isfinite(r[0])]
        gh = collections.Counter()
        for r in fin:
            g = r[0]
            b = next((e for e in edges if g <= e), "over1")
            gh[str(b) if b != "over1" else ">1"] += 1
        ids = collections.Counter(int(r[1]) for r in recs)
        top = ids.most_common(5)
        lr = [math.log(max(r[3], 1e-30) / max(r[4], 1e-30)) for r in recs]
        pc = [r[3] for r in recs]
        adj = sum(1 for r in recs if abs(r[1] - r[2]) == 1)
        between0 = sum(1 for r in recs if r[5] <= 1e-3)
        trig = sum(1 for r in recs if int(r[1]) == trigger_id)
        hhi = sum((c / max(1, len(recs))) ** 2 for c in ids.values())

        def q(xs: list[float], p: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")
        out[name] = {
            "tokens": n, "differ": len(recs), "differ_rate": round(len(recs) / max(1, n), 5),
            "trigger_differs": trig, "trigger_differ_rate": round(trig / max(1, n), 6),
            "trigger_differ_ub(1e-6)": round(ub(trig, n, beta), 6),
            "gap_hist(<=edge, fraction of delta)": {k: gh[k] for k in [str(e) for e in edges] + [">1"] if gh[k]},
            "distinct_claimed_ids": len(ids), "top_claimed_ids": top, "hhi": round(hhi, 4),
            "log(p_claimed/p_replay) q10/50/90": [round(q(lr, x), 3) for x in (0.1, 0.5, 0.9)],
            "p_claimed q10/50/90": [round(q(pc, x), 5) for x in (0.1, 0.5, 0.9)],
            "id_adjacent(|c-r|==1)": adj, "mass_between<=1e-3": between0,
            "rank_claimed q10/50/90": [q([r[6] for r in recs], x) for x in (0.1, 0.5, 0.9)],
        }
    return out


def simulate(a: argparse.Namespace) -> dict[str, dict[str, object]]:
    """The injection each event family still allows (see the module docstring)."""
    by_cfg: dict[str, list] = {}
    for spec in a.honest:
        cfg, path = spec.split("=", 1)
        by_cfg.setdefault(cfg, []).extend(load(path)[1])
    _, inj = load(a.injector, "other" if a.chances else "check")
    out = {}
    for name, fam in families(a.buckets).items():
        bounds: dict[str, float] = {}
        events = set()
        cc = {}
        for cfg, calls in by_cfg.items():
            n, c = counts(calls, fam)
            cc[cfg] = (n, c)
            events |= set(c)
        # every event the injector could touch needs a bound: events never seen honestly get the k = 0 bound
        inj_events = set()
        for _, recs in inj:
            for r in recs:
                if math.isfinite(r[0]):
                    inj_events |= set(fam(r))
        for e in events | inj_events:
            b = 0.0
            for cfg, (n, c) in cc.items():
                k = c.get(e, 0)
                if a.calib_tokens:
                    k, n = round(k * a.calib_tokens / n), a.calib_tokens
                b = max(b, ub(k, n, a.beta))
            bounds[e] = b
        # greedy ration, in log order, only the trigger's chances (the injector wants the trigger)
        tokens = taken = 0
        got: dict[str, int] = {}
        for t, recs in inj:
            tokens += t
            for r in sorted(recs, key=lambda r: r[0]):
                if not math.isfinite(r[0]) or r[0] > 1.0 or int(r[1]) != a.trigger_id or tokens == 0:
                    continue
                evs = fam(r)
                if all(got.get(e, 0) + 1 <= a.factor * bounds[e] * tokens for e in evs):
                    for e in evs:
                        got[e] = got.get(e, 0) + 1
                    taken += 1
        binding = sorted(((e, round(got[e] / (a.factor * bounds[e] * tokens), 2)) for e in got), key=lambda x: -x[1])[:4]
        held = {}
        for spec in a.check:
            cfg, path = spec.split("=", 1)
            n, c = counts(load(path)[1], fam)
            worst = max(((e, c.get(e, 0) / n / bounds[e]) for e in bounds if e in c), key=lambda x: x[1], default=("", 0))
            held[cfg] = (worst[0], round(worst[1], 3))
        out[name] = {"injected": taken, "tokens": tokens, "injection_rate": round(taken / max(1, tokens), 6),
                     "binding(events, count/(factor*bound*tokens))": binding,
                     "held_out_honest_worst(rate/bound)": held}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", help="describe the differing tokens of each log")
    s.add_argument("--trigger-id", type=int, required=True)
    s.add_argument("--beta", type=float, default=1e-6)
    s.add_argument("runs", nargs="+", help="name=path of a token log")
    m = sub.add_parser("simulate", help="injection allowed unflagged under each candidate event family")
    m.add_argument("--honest", action="append", required=True, help="config=path (several per config are pooled)")
    m.add_argument("--injector", required=True, help="token log of the injector")
    m.add_argument("--chances", action="store_true", help="take the injector's chances from its judge_tokens records (src other)")
    m.add_argument("--trigger-id", type=int, required=True)
    m.add_argument("--beta", type=float, default=1e-6, help="the calibration's confidence (audit.baseline_confidence)")
    m.add_argument("--factor", type=float, default=1.43, help="the injector's ration: each event <= factor x bound")
    m.add_argument("--calib-tokens", type=int, default=0, help="scale each config's honest counts to this many tokens (0: as measured)")
    m.add_argument("--buckets", type=int, default=64, help="claimed-id buckets (crc32 mod this) of the bucket family")
    m.add_argument("--check", action="append", default=[], help="config=path of held-out honest logs")
    a = ap.parse_args()
    out = summary(a.runs, a.trigger_id, a.beta) if a.cmd == "summary" else simulate(a)
    for k, v in out.items():
        print(k, json.dumps(v))


if __name__ == "__main__":
    main()
