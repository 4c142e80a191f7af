"""Child side of the code sandbox: runs one candidate program against its tests.

Executed as ``python -s -P -c <this file's source>`` by :mod:`protocol.rewards.sandbox`, never
imported. Its working directory is a fresh temporary folder holding ``spec.json``::

    {"mode": "stdio" | "call" | "assert", "code": str, "tests": {...}, "nonce": str,
     "result_fd": int, "cpu_time_s": int, "memory_bytes": int, "output_bytes": int}

Order: read and delete the spec, set resource limits, disable sockets, install an audit hook
(no writes outside the folder, no processes, no sockets, no ctypes, no signals to other
processes, no raising of limits), then run the candidate. ``call`` and ``assert`` modes report
``{"nonce", "passed", "total", "error"}`` as one JSON line on ``result_fd``; ``stdio`` mode runs
the program as ``__main__`` with the real stdin/stdout and reports through its exit status.
Everything here is standard library only.
"""

# ruff: noqa: S102 - running the candidate's code is this file's purpose

import ctypes  # noqa: F401 - imported before the audit hook: its import dlopens the main program
import json
import os
import resource
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

_BLOCKED_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.call_function",
        "ctypes.cdata",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "resource.setrlimit",
        "resource.prlimit",
        "os.chroot",
        "os.setxattr",
        "os.removexattr",
    }
)
# event -> (indices of path arguments that must stay inside the working folder,
#           indices of dir_fd arguments that must be None)
_PATH_EVENTS = {
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.chflags": ((0,), ()),
    "os.utime": ((0,), (3,)),
    "os.truncate": ((0,), ()),
    "os.rename": ((0, 1), (2, 3)),
    "os.link": ((0, 1), (2, 3)),
    "os.symlink": ((1,), (2,)),
    "os.mkfifo": ((0,), (2,)),
    "os.mknod": ((0,), (3,)),
    "shutil.rmtree": ((0,), ()),
    "shutil.move": ((0, 1), ()),
    "shutil.copyfile": ((1,), ()),
    "shutil.copytree": ((1,), ()),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _make_hook(root: str) -> Callable[[str, tuple[Any, ...]], None]:
    realpath, join, isabs, fspath = os.path.realpath, os.path.join, os.path.isabs, os.fspath
    prefix = root + os.sep

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True
        try:
            p: str | bytes = fspath(path)
        except TypeError:
            return False
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        if not isabs(p):
            p = join(os.getcwd(), p)
        resolved: str = realpath(p)
        return resolved == root or resolved.startswith(prefix)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if path is None or inside(path):
                return
            if writing:
                raise PermissionError(f"sandbox: writing outside the working folder: {path!r}")
            if mode is None and os.path.isdir(path):
                # os.open of an outside folder would give a dir_fd that "open" events can't see
                raise PermissionError(f"sandbox: os.open of a folder outside: {path!r}")
        elif event in _BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event in _PATH_EVENTS:
            paths, dir_fds = _PATH_EVENTS[event]
            for i in paths:
                if i < len(args) and not inside(args[i]):
                    raise PermissionError(f"sandbox: {event} outside the working folder: {args[i]!r}")
            for i in dir_fds:
                if i < len(args) and args[i] not in (None, -1):  # CPython reports "none" as -1
                    raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")

    return hook


def _disable_sockets() -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise PermissionError("sandbox: network access is not allowed")

    class NoSocket(socket.socket):
        connect = connect_ex = bind = sendto = listen = refuse

    socket.socket = NoSocket  # type: ignore[misc]
    for name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "socketpair"):
        setattr(socket, name, refuse)


def _set_limits(spec: dict[str, Any]) -> None:
    cpu = int(spec["cpu_time_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (int(spec["memory_bytes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(spec["output_bytes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _normalise(value: Any) -> Any:
    """JSON round trip: tuples become lists, and custom ``__eq__`` objects lose their tricks."""
    return json.loads(json.dumps(value, allow_nan=False))


def _run_call(ns: dict[str, Any], tests: dict[str, Any]) -> tuple[int, str]:
    fn_name = tests["fn_name"]
    sol = ns.get("Solution")
    if isinstance(sol, type) and hasattr(sol, fn_name):
        fn = getattr(sol(), fn_name)
    elif callable(ns.get(fn_name)):
        fn = ns[fn_name]
    else:
        return 0, f"no function {fn_name!r} defined"
    passed = 0
    for args, expected in zip(tests["inputs"], tests["outputs"]):
        try:
            out = _normalise(fn(*args))
        except Exception as e:  # noqa: BLE001 - the candidate's failure is the result
            return passed, f"case {passed}: {type(e).__name__}: {e}"[:500]
        ok = out == expected or (isinstance(expected, list) and len(expected) == 1 and out == expected[0])
        if not ok:
            return passed, f"case {passed}: wrong answer"
        passed += 1
    return passed, ""


def _run_assert(ns: dict[str, Any], tests: dict[str, Any]) -> tuple[int, str]:
    passed = 0
    if tests.get("setup_code"):
        exec(compile(tests["setup_code"], "<setup_code>", "exec"), ns)
    for snippet in tests["assert_tests"]:
        try:
            exec(compile(snippet, f"<test {passed}>", "exec"), ns)
        except BaseException as e:  # noqa: BLE001 - SystemExit from a test is a failure too
            return passed, f"test {passed}: {type(e).__name__}: {e}"[:500]
        passed += 1
    return passed, ""


def _main() -> None:
    spec_path = os.path.join(os.getcwd(), "spec.json")
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    os.remove(spec_path)
    nonce, result_fd, mode, tests = spec["nonce"], spec["result_fd"], spec["mode"], spec["tests"]
    total = len(tests["inputs"]) if mode == "call" else len(tests.get("assert_tests", ()))
    _set_limits(spec)
    _disable_sockets()
    sys.addaudithook(_make_hook(os.path.realpath(os.getcwd())))
    del spec_path

    if mode == "stdio":
        ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(spec["code"], "<solution>", "exec"), ns)
        except SystemExit as e:
            if e.code not in (None, 0):
                sys.stderr.write(f"SystemExit({e.code!r})\n")
                sys.stdout.flush()
                os._exit(1)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)

    ns = {"__name__": "__solution__", "__builtins__": __builtins__}  # not run as __main__
    passed, error = 0, ""
    try:
        if tests.get("prelude"):
            exec(compile(tests["prelude"], "<prelude>", "exec"), ns)
        exec(compile(spec["code"], "<solution>", "exec"), ns)
        passed, error = _run_call(ns, tests) if mode == "call" else _run_assert(ns, tests)
    except BaseException as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"[:500]
    line = json.dumps({"nonce": nonce, "passed": passed, "total": total, "error": error})
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001, S110 - a broken stdout must not hide the result
        pass
    os.write(result_fd, (line + "\n").encode("utf-8"))
    os._exit(0)


_main()
