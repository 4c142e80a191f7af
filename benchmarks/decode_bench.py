"""Cost of refusing hostile envelopes: the envelope decoder (outer fields, signature over the raw
bytes, then the body under its schema's limits) against a whole-message decode with every
container limit = the message size (what the ingest did before issue 12).

    python benchmarks/decode_bench.py --repeat 5

Prints milliseconds per envelope (median of ``--repeat``) and the ratio, per case. "old decode" is
only the old first step (msgpack with every limit = the size, then the canonical walk); "new open"
is the whole of :func:`open_envelope` (signature and schema included), so for honest input the
new column is the larger one:

* honest — a real-shape submission of ≈ 1.2 MiB (should cost about the same both ways);
* forged — 380 KiB of empty maps in the body, signature wrong (refused before the body is built);
* signed-flood — 65,536 empty maps where rollouts belong, correctly signed with a free key.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgpack

from protocol import encoding
from protocol.envelope import DOMAIN, open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask

RUN = bytes(32)


def _forge(key: NodeKey, body: object, good_sig: bool) -> bytes:
    unsigned = {"v": 1, "type": "submission/1", "run": RUN, "signer": key.public_key, "ts_ms": int(time.time() * 1000),
                "nonce": os.urandom(16), "body": body}
    sig = key.sign(DOMAIN + encoding.packb(unsigned)) if good_sig else bytes(64)
    return encoding.packb({**unsigned, "sig": sig})


def _old_decode(data: bytes) -> None:
    """The previous first step: everything decoded with limits = size, then the canonical walk."""
    n = len(data)
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=n, max_str_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    encoding.packb(obj)


def _new_decode(data: bytes) -> None:
    try:
        open_envelope(data, run_id=RUN, expect=Submission)
    except ProtocolError:
        pass


def _time_ms(fn, data: bytes, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(data)
        out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    key = NodeKey.generate()
    tokens = 150_000
    r = Rollout(task=0, sample=0, seed=1, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00" * tokens,
                logprobs=b"\x00\x00\x00\x00" * tokens, finish="length", task_reward=0.0, reward=0.0, proofs=[b"\x00" * 258] * (tokens // 32 + 1))
    honest = seal(key, RUN, Submission(worker=key.peer_id, policy_step=0, counter=0,
                                       tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)], rollouts=[r]))
    cases = {
        "honest": honest,
        "forged": _forge(key, {"rollouts": [{}] * 380_000}, good_sig=False),
        "signed-flood": _forge(key, {"rollouts": [{}] * 65_536, "worker": key.peer_id}, good_sig=True),
    }
    print(f"{'case':<14}{'bytes':>10}{'old decode ms':>15}{'new open ms':>13}{'ratio':>9}")
    for name, data in cases.items():
        old = _time_ms(_old_decode, data, args.repeat)
        new = _time_ms(_new_decode, data, args.repeat)
        print(f"{name:<14}{len(data):>10}{old:>15.1f}{new:>13.1f}{old / new:>9.1f}")


if __name__ == "__main__":
    main()
