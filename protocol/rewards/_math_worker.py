"""A math-verify process (run as a script by :mod:`protocol.rewards.verifier`; never imported).

Reads one JSON request per line on stdin, ``{"gold": str, "answer": str}`` (both unboxed), and
answers one line on stdout: ``{"ok": bool}``, ``{"ok": false, "error": "TypeName"}`` or
``{"limit": "memory"}``. Its address space is limited to ``argv[1]`` bytes; it dies with its
parent (PR_SET_PDEATHSIG) and exits when stdin closes. Time is bounded by the parent, which
kills this process when a check runs over (``signal.alarm`` would need the main thread of the
*caller*; here it is not needed).
"""

import ctypes
import json
import os
import resource
import signal
import sys


def main():
    memory_bytes = int(sys.argv[1])
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(0)
    from math_verify import parse, verify  # heavy (sympy): imported once per process

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            gold = parse("\\boxed{" + req["gold"] + "}", parsing_timeout=None)
            answer = parse("\\boxed{" + req["answer"] + "}", parsing_timeout=None)
            ok = bool(gold and answer and verify(gold, answer, timeout_seconds=None))
            resp = {"ok": ok}
        except MemoryError:
            resp = {"limit": "memory"}
        except Exception as e:  # noqa: BLE001 - a malformed answer scores 0, whatever sympy raises
            resp = {"ok": False, "error": type(e).__name__}
        out.write(json.dumps(resp).encode("utf-8") + b"\n")
        out.flush()


main()
