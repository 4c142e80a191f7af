"""Hostile code completions against the real reward path (``compute_reward`` → bubblewrap
sandbox → parent-side comparison): each attack of issue #12 items 1–2 as a ```python block.

Every test has positive evidence that the attack ran (a task whose hidden expected value is the
benign outcome passes) and checks the host side directly (files, processes, sockets).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for

from protocol.rewards import RewardError, RewardLimits, SandboxLimits, compute_reward
from protocol.rewards.sandbox import run_python, sandbox_status
from protocol.tasks import code_task

REPO = Path(__file__).resolve().parents[2]
FAST = RewardLimits(sandbox=SandboxLimits(cpu_time_s=3, wall_time_s=10.0, total_wall_time_s=20.0))

pytestmark = pytest.mark.skipif(not sandbox_status()[0], reason=f"no code sandbox here: {sandbox_status()[1]}")


def fenced(code: str) -> str:
    return f"<think>\nplan\n</think>\n```python\n{code}\n```\n"


def score(code: str, asserts: list[str], limits: RewardLimits = FAST, setup: str = ""):
    task = code_task("attack", "attack", {"assert_tests": asserts, "setup_code": setup})
    return compute_reward(task, fenced(code), 10, None, 0.0, limits)


def marked_pids(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd:
            found.append(int(d.name))
    return found


# ----------------------------------------------------------------------------- identity and files


def test_runs_as_nobody_with_nothing_of_the_host_visible():
    code = (
        "import os\n"
        "def f(x):\n"
        f"    seen = [p for p in ({str(REPO)!r}, {str(REPO.parent / 'shared')!r}, '/etc/passwd', '/home', '/var') if os.path.exists(p)]\n"
        "    return (os.getuid(), os.getgid(), seen)\n"
    )
    assert score(code, ["assert f(0) == (65534, 65534, [])"]).task_reward == 1.0
    assert score(code, ["assert f(0)[0] == 0"]).task_reward == 0.0


def test_no_nested_user_namespaces():
    code = (
        "import subprocess\n"
        "def f(x):\n"
        "    return subprocess.run(['/usr/bin/unshare', '--user', '--map-root-user', '/bin/true']).returncode\n"
    )
    assert score(code, ["assert f(0) != 0"]).task_reward == 1.0
    assert score(code, ["assert f(0) == 0"]).task_reward == 0.0


def test_key_files_are_not_readable(tmp_path):
    secret = secrets.token_hex(16)
    keydir = tmp_path / "root-like"
    keydir.mkdir(mode=0o700)
    key = keydir / "node.key"
    key.write_text(secret)
    key.chmod(0o600)
    shared_key = tmp_path / "open.key"  # even a world-readable file outside the binds is absent
    shared_key.write_text(secret)
    shared_key.chmod(0o644)
    code = (
        "import os\n"
        "def f(x):\n"
        "    out = []\n"
        f"    for p in ({str(key)!r}, {str(shared_key)!r}, '/root/.ssh/id_ed25519'):\n"
        "        try:\n"
        "            out.append(open(p).read())\n"
        "        except OSError as e:\n"
        "            out.append(type(e).__name__)\n"
        "    return out\n"
    )
    assert score(code, ["assert f(0) == ['FileNotFoundError'] * 3"]).task_reward == 1.0
    assert score(code, [f"assert {secret!r} in f(0)"]).task_reward == 0.0


def test_writes_never_reach_the_host(tmp_path):
    target = tmp_path / "pwned.txt"
    marker = f"intellect-test-{secrets.token_hex(6)}"
    code = (
        "import os\n"
        "def f(x):\n"
        "    done = []\n"
        f"    for attempt in ('chdir', 'usr', 'tmp'):\n"
        "        try:\n"
        "            if attempt == 'chdir':\n"
        f"                os.chdir({str(tmp_path)!r})\n"
        f"                os.getcwd = lambda: {str(tmp_path)!r}\n"
        "                open('pwned.txt', 'w').write('x')\n"
        "            elif attempt == 'usr':\n"
        "                open('/usr/pwned.txt', 'w').write('x')\n"
        "            else:\n"
        f"                open('/tmp/{marker}', 'w').write('x')\n"
        "            done.append(attempt)\n"
        "        except OSError as e:\n"
        "            done.append(type(e).__name__)\n"
        "    return done\n"
    )
    # chdir into a host folder fails (not there); /usr is read-only; /tmp is the private tmpfs
    assert score(code, ["assert f(0) == ['FileNotFoundError', 'OSError', 'tmp']"]).task_reward == 1.0
    assert not target.exists()
    assert not Path("/usr/pwned.txt").exists()
    assert not (Path("/tmp") / marker).exists()


# ----------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_children_do_not_outlive_the_wall_kill():
    marker = f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(1000)}"
    code = (
        "import os, subprocess, _posixsubprocess, time\n"
        f"subprocess.Popen(['/bin/sleep', '{marker}'], start_new_session=True)\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n"
        "r, w = os.pipe()\n"
        f"_posixsubprocess.fork_exec([b'/bin/sleep', b'{marker}'], [b'/bin/sleep'], True, (w,), None, None,"
        " -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)\n"
        "time.sleep(600)\n"
        "def f(x):\n"
        "    return 1\n"
    )
    limits = RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=3.0))
    r = score(code, ["assert f(0) == 1"], limits)
    assert (r.task_reward, r.limit_hit) == (0.0, "wall")
    wait_for(lambda: not marked_pids(marker), 10.0, "the candidate's processes to be gone")


# x86-64 ptrace injection: the candidate attaches to the sandbox's init (pid 1, its own uid) and
# makes it call prctl(PR_SET_PDEATHSIG, 0), so that killing bwrap no longer kills the namespace
_CLEAR_INIT_PDEATHSIG = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs".split()]
def pt(req, addr=0, data=0):
    ctypes.set_errno(0)
    r = libc.ptrace(req, 1, ctypes.c_void_p(addr), ctypes.c_void_p(data))
    if r == -1 and ctypes.get_errno():
        raise OSError(ctypes.get_errno(), "ptrace %d" % req)
    return r
pt(16)                                   # PTRACE_ATTACH
os.waitpid(1, 0x40000000)                # __WALL
regs = Regs(); pt(12, 0, ctypes.addressof(regs))
saved = Regs.from_buffer_copy(regs)
word = pt(1, regs.rip) & 0xFFFFFFFFFFFFFFFF   # PEEKTEXT
pt(4, regs.rip, (word & ~0xFFFF) | 0x050F)    # a syscall instruction at rip
regs.rax, regs.orig_rax, regs.rdi, regs.rsi = 157, 0xFFFFFFFFFFFFFFFF, 1, 0  # prctl(PR_SET_PDEATHSIG, 0)
pt(13, 0, ctypes.addressof(regs)); pt(9); os.waitpid(1, 0x40000000)
pt(12, 0, ctypes.addressof(regs)); result = regs.rax
pt(4, saved.rip, word); pt(13, 0, ctypes.addressof(saved)); pt(17)  # restore, detach
print("init prctl returned", result, flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the injection is x86-64 code")
def test_a_ptraced_init_does_not_keep_the_namespace_alive():
    marker = f"{secrets.randbelow(10**6) + 3 * 10**6}.{secrets.randbelow(1000)}"
    # the program then becomes a long sleep: the init's main child, holding the namespace open
    code = _CLEAR_INIT_PDEATHSIG + f"os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n"
    try:
        run = run_python("stdio", code, {}, SandboxLimits(cpu_time_s=5, wall_time_s=4.0))
        assert "init prctl returned 0" in run.stdout, run.stderr  # the attack ran
        assert run.limit_hit == "wall"
        assert marked_pids(marker) == []  # run_python returns only once the pid namespace is gone
    finally:
        for pid in marked_pids(marker):  # what a failing run left: the init's main child (the init then exits)
            os.kill(pid, 9)

def test_no_process_survives_a_normal_exit():
    marker = f"{secrets.randbelow(10**6) + 2 * 10**6}.{secrets.randbelow(1000)}"
    code = (
        "import subprocess\n"
        f"subprocess.Popen(['/bin/sleep', '{marker}'], start_new_session=True)\n"
        "def f(x):\n"
        "    return 1\n"
    )
    assert score(code, ["assert f(0) == 1"]).task_reward == 1.0
    wait_for(lambda: not marked_pids(marker), 10.0, "the candidate's processes to be gone")


def test_signals_cannot_reach_the_host():
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        code = (
            "import os, signal\n"
            "def f(x):\n"
            "    out = []\n"
            "    try:\n"
            "        signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n"
            "        out.append('sent')\n"
            "    except OSError as e:\n"
            "        out.append(type(e).__name__)\n"
            f"    for pid in ({os.getpid()}, {sentinel.pid}):\n"
            "        try:\n"
            "            os.kill(pid, signal.SIGKILL)\n"
            "            out.append('killed')\n"
            "        except OSError as e:\n"
            "            out.append(type(e).__name__)\n"
            "    return out\n"
        )
        r = score(code, ["assert f(0)[1:] == ['ProcessLookupError', 'ProcessLookupError']"])
        assert r.task_reward == 1.0, r.detail
        assert sentinel.poll() is None  # the host's processes are not even visible
    finally:
        sentinel.kill()
        sentinel.wait()


def test_fork_bomb_is_bounded_by_nproc():
    marker = f"{secrets.randbelow(10**6) + 3 * 10**6}.{secrets.randbelow(1000)}"
    code = (
        "import os\n"
        "def f(x):\n"
        "    n = 0\n"
        "    for _ in range(10000):\n"
        "        try:\n"
        "            pid = os.fork()\n"
        "        except OSError:\n"
        "            break\n"
        "        if pid == 0:\n"
        f"            os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n"
        "        n += 1\n"
        "    return n\n"
    )
    limits = RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=20.0, processes=8))
    r = score(code, ["assert 1 <= f(0) <= 8"], limits)
    assert r.task_reward == 1.0, r.detail
    wait_for(lambda: not marked_pids(marker), 10.0, "the candidate's processes to be gone")


# ----------------------------------------------------------------------------- forged results


def test_forged_records_do_not_pass():
    # wrong program; it writes every result format it can think of to every fd, then leaves
    code = (
        "import os\n"
        "for fd in range(1, 20):\n"
        "    try:\n"
        "        os.write(fd, b'3/3 passed\\n{\"passed\": 3, \"total\": 3, \"error\": \"\"}\\n{\"done\": true}\\n')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
        "def f(x):\n"
        "    return 0\n"
    )
    r = score(code, ["assert f(2) == 4", "assert f(3) == 9", "assert f(4) == 16"])
    # Which forged line lands on the record channel depends on the fds the run was given; either
    # way the parent judged no assert of the program as passed.
    assert r.task_reward == 0.0 and ("never ran" in r.detail or "did not finish (0 checks passed)" in r.detail), r.detail


def test_frame_and_gc_walks_find_no_expected_value():
    hidden = f"tok-{secrets.token_hex(8)}"
    code = (
        "import gc, sys\n"
        "def search():\n"
        "    pre = 'to' + 'k-'\n"
        "    hit = lambda v: isinstance(v, str) and v.startswith(pre) and len(v) > 8\n"
        "    found = []\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        for d in (frame.f_locals, frame.f_globals):\n"
        "            found += [v for v in d.values() if hit(v)]\n"
        "        found += [c for c in frame.f_code.co_consts if hit(c)]\n"
        "        frame = frame.f_back\n"
        "    for o in gc.get_objects():\n"
        "        vals = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()\n"
        "        found += [v for v in vals if hit(v)]\n"
        "    return found\n"
        "def f(x):\n"
        "    found = search()\n"
        "    return found[0] if found else 'nothing'\n"
    )
    assert score(code, [f"assert f(0) == {hidden!r}"]).task_reward == 0.0
    assert score(code, ["assert f(0) == 'nothing'"]).task_reward == 1.0  # the search ran and found nothing


@pytest.mark.slow
def test_lying_objects_do_not_pass():
    liars = [
        "class Liar:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return Liar()",
        "class Liar(list):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return Liar([0])",
        "class Liar(int):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return Liar(0)",
        "class Liar(float):\n    def __sub__(self, o):\n        return 0.0\n    __rsub__ = __sub__\ndef f(x):\n    return Liar(7.0)",
        "class Liar:\n    def __bool__(self):\n        return True\ndef f(x):\n    return Liar()",
    ]
    asserts = ["assert f(2) == 4", "assert abs(f(2) - 4.0) < 1e-6", "assert f(2)"]
    for code in liars:
        for a in asserts[:2]:
            r = score(code, [a])
            assert r.task_reward == 0.0, (code, a, r.detail)
    assert score(liars[-1], [asserts[2]]).task_reward == 0.0
    honest = "def f(x):\n    return x * x"
    assert all(score(honest, [a]).task_reward == 1.0 for a in asserts)


def test_shadowed_builtins_do_not_pass():
    """A wrong program that rebinds the built-ins tests apply to its values (HumanEval/4 checks
    ``abs(candidate(x) - y) < 1e-6``) or patches ``math.isclose``: the parent evaluates them."""
    honest = (
        "import math\n"
        "def f(x):\n    return x * x\n"
        "def g(x):\n    return (i * i for i in reversed(range(x)))\n"  # a generator: materialised for sorted()
        "def h(x):\n    return list(range(x))\n"
    )
    wrong = (
        "import math, builtins\n"
        "def abs(x):\n    return 0\n"
        "def sorted(x, **k):\n    return [0, 1, 4]\n"
        "def len(x):\n    return 3\n"
        "def any(x):\n    return True\n"
        "builtins.abs, builtins.sorted, builtins.len, builtins.any = abs, sorted, len, any\n"
        "math.isclose = lambda *a, **k: True\n"
        "def f(x):\n    return 7.0\n"
        "def g(x):\n    return []\n"
        "def h(x):\n    return []\n"
    )
    asserts = ["assert abs(f(2) - 4.0) < 1e-6", "assert math.isclose(f(3), 9.0)", "assert sorted(g(3)) == [0, 1, 4]",
               "assert len(h(3)) == 3", "assert any(v == 4 for v in h(5))"]
    for a in asserts:
        assert score(honest, [a]).task_reward == 1.0, a
        r = score(wrong, [a])
        assert r.task_reward == 0.0, (a, r.detail)

# ----------------------------------------------------------------------------- network and resources


def test_network_is_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = (
            "import socket\n"
            "def f(x):\n"
            "    try:\n"
            f"        socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "        return 'connected'\n"
            "    except OSError as e:\n"
            "        return 'refused'\n"
        )
        assert score(code, ["assert f(0) == 'refused'"]).task_reward == 1.0
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected
    finally:
        server.close()


MEMORY_BOMB = RewardLimits(sandbox=SandboxLimits(cpu_time_s=10, wall_time_s=20.0, total_wall_time_s=30.0, memory_bytes=256 * 1024**2))
"""A 256 MiB address space and the default 10 CPU seconds: filling 1 GiB under :data:`FAST`'s 3 s
could run out of CPU first on a busy machine (the kernel's page zeroing and reclaim are charged to
the program: a full-suite run classed the bomb as ``cpu``)."""


def test_memory_bomb_hits_the_memory_limit():
    for code in ("_hog = bytearray(64 * 1024**3)\ndef f(x):\n    return 1",
                 "_hog = []\nwhile True:\n    _hog.append(bytearray(64 * 1024**2))\ndef f(x):\n    return 1"):
        r = score(code, ["assert f(0) == 1"], MEMORY_BOMB)
        assert (r.task_reward, r.limit_hit) == (0.0, "memory"), r.detail


def test_disk_fill_stops_at_the_tmpfs_size():
    code = (
        "import errno\n"
        "def f(x):\n"
        "    n = 0\n"
        "    for i in range(100000):\n"
        "        try:\n"
        "            with open(f'/tmp/fill{i}', 'wb') as fh:\n"
        "                fh.write(b'x' * 65536)\n"
        "        except OSError as e:\n"
        "            return (e.errno == errno.ENOSPC, n)\n"
        "        n += 65536\n"
        "    return (False, n)\n"
    )
    limits = RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=20.0, tmpfs_bytes=2 * 1024**2))
    r = score(code, ["r = f(0)\nassert r[0] is True\nassert 0 < r[1] <= 2 * 1024**2"], limits)
    assert r.task_reward == 1.0, r.detail


@pytest.mark.slow
def test_cpu_and_wall_limits_are_reported():
    r = score("while True:\n    pass", ["assert True"], RewardLimits(sandbox=SandboxLimits(cpu_time_s=1, wall_time_s=20.0)))
    assert (r.task_reward, r.limit_hit) == (0.0, "cpu"), r.detail
    r = score("import time\ntime.sleep(600)", ["assert True"], RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=1.5)))
    assert (r.task_reward, r.limit_hit) == (0.0, "wall"), r.detail
    # a program that fails a check before it loops failed on its own: no limit
    r = score("def f(x):\n    return 3", ["assert f(0) == 1\nwhile True:\n    pass"], RewardLimits(sandbox=SandboxLimits(cpu_time_s=1, wall_time_s=20.0)))
    assert (r.task_reward, r.limit_hit) == (0.0, None), r.detail
    with pytest.raises(RewardError, match="limit 'cpu'"):
        score("while True:\n    pass", ["assert True"], RewardLimits(sandbox=SandboxLimits(cpu_time_s=1))).raise_if_limited()


def test_missing_bubblewrap_refuses_code_tasks(monkeypatch):
    import protocol.rewards.sandbox as sb

    monkeypatch.setenv("PATH", "/nonexistent")
    sb._launch.cache_clear()
    sb._probe.cache_clear()
    try:
        ok, reason = sb.sandbox_status()
        assert not ok and "apt-get install bubblewrap" in reason and "\n" not in reason
        with pytest.raises(RewardError, match="apt-get install bubblewrap"):
            score("def f(x):\n    return 1", ["assert f(0) == 1"])
    finally:
        monkeypatch.undo()
        sb._launch.cache_clear()
        sb._probe.cache_clear()
    assert sb.sandbox_status()[0]


def test_output_flood_is_an_output_limit():
    limits = RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=20.0, output_bytes=1024 * 1024))
    r = score("while True:\n    print('x' * 100000)", ["assert True"], limits)
    assert (r.task_reward, r.limit_hit) == (0.0, "output"), r.detail


# ----------------------------------------------------------------------------- one budget for what it writes (issue 23 item 3)

_FILL = (
    "import errno, os\n"
    "def fill(path, limit=64 * 1024**2):\n"
    "    n = 0\n"
    "    try:\n"
    "        with open(path, 'wb') as fh:\n"
    "            while n < limit:\n"
    "                fh.write(b'x' * 1024**2)\n"
    "                fh.flush()\n"
    "                n += 1024**2\n"
    "    except OSError as e:\n"
    "        return (n, errno.errorcode.get(e.errno, str(e.errno)))\n"
    "    return (n, 'ok')\n"
)


def test_every_writable_mount_is_sized_within_one_budget():
    """bubblewrap's root and /dev tmpfs mounts had no size: 3 GiB went into /dev/shm and the
    sandbox's root in 3.3 s (host shared memory +3,071 MiB). Now the root and /dev are read-only
    and /tmp + /dev/shm together hold at most ``tmpfs_bytes``."""
    budget = 8 * 1024**2
    limits = RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=20.0, tmpfs_bytes=budget))
    paths = ["/tmp/a", "/dev/shm/b", "/c", "/dev/d", "/job/e", "/proc/f", "/home"]
    code = _FILL + f"def f(x):\n    return [fill(p) for p in {paths!r}]\n"
    # the assert's operands go back to the parent: it compares them with the hidden literals
    r = score(code, [f"assert [e for _, e in f(0)] == {['ENOSPC', 'ENOSPC', 'EROFS', 'EROFS', 'EROFS', 'ENOENT', 'EROFS']!r}",
                     f"assert sum(n for n, _ in f(0)) <= {budget}"], limits)
    assert r.task_reward == 1.0, r.detail


def test_inherited_descriptors_cannot_grow_the_hosts_disk():
    """stdin/stdout/stderr and the record stream were host temporary files opened read-write:
    ``fallocate(FALLOC_FL_KEEP_SIZE)`` skipped RLIMIT_FSIZE and took gigabytes of the host's
    /tmp. Now they are pipes and a sealed read-only memfd: every inherited descriptor refuses."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def f(x):\n"
        "    out = []\n"
        "    for fd in sorted(int(n) for n in os.listdir('/proc/self/fd')):\n"
        "        if libc.fallocate(fd, 1, ctypes.c_longlong(0), ctypes.c_longlong(1 << 30)) == 0:\n"
        "            out.append(fd)\n"
        "    return out\n"
    )
    before = os.statvfs("/tmp")
    r = score(code, ["assert f(0) == []"])
    after = os.statvfs("/tmp")
    assert r.task_reward == 1.0, r.detail
    assert (before.f_bavail - after.f_bavail) * before.f_frsize < 256 * 1024**2, "the host's /tmp did not lose a gigabyte"


@pytest.mark.slow
def test_a_program_that_kills_itself_failed_it_hit_no_limit():
    """A self-SIGKILL was classed as the CPU limit (benign): now only a SIGKILL after
    ``cpu_time_s`` of CPU is; a busy loop ignoring SIGXCPU still is."""
    r = score("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", ["assert True"])
    assert (r.task_reward, r.limit_hit) == (0.0, None), r.detail
    r = score("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass", ["assert True"],
              RewardLimits(sandbox=SandboxLimits(cpu_time_s=1, wall_time_s=20.0)))
    assert (r.task_reward, r.limit_hit) == (0.0, "cpu"), r.detail
