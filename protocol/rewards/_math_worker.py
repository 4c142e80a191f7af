"""A math-verify process (run as a script by :mod:`protocol.rewards.verifier`; never imported).

Reads one JSON request per line on stdin, ``{"gold": str, "answer": str, "timeout_s": float}``
(both unboxed), and answers one line on stdout: ``{"ok": bool}``, ``{"ok": false, "error":
"TypeName"}`` or ``{"limit": "memory"}``. Its address space is limited to ``argv[1]`` bytes; it
exits when stdin closes (its parent is gone). Time is bounded by the parent, which kills this
process when a check runs over; as a backstop (a parent that died mid-check), faulthandler's
watchdog thread, which needs no GIL, ends the process 5 s after a check's own limit.
"""

import faulthandler
import json
import os
import resource
import sys


def main() -> None:
    memory_bytes = int(sys.argv[1])
    from math_verify import parse, verify  # heavy (sympy): imported once per process

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            faulthandler.dump_traceback_later(float(req.get("timeout_s", 60)) + 5, exit=True, file=devnull)
            gold = parse("\\boxed{" + req["gold"] + "}", parsing_timeout=None)
            answer = parse("\\boxed{" + req["answer"] + "}", parsing_timeout=None)
            ok = bool(gold and answer and verify(gold, answer, timeout_seconds=None))
            resp: dict[str, object] = {"ok": ok}
        except MemoryError:
            resp = {"limit": "memory"}
        except Exception as e:  # noqa: BLE001 - a malformed answer scores 0, whatever sympy raises
            resp = {"ok": False, "error": type(e).__name__}
        faulthandler.cancel_dump_traceback_later()
        out.write(json.dumps(resp).encode("utf-8") + b"\n")
        out.flush()


main()
