"""The harness inside an environment's bubblewrap sandbox (standard library, plus the environment's
own library; never imported by the node). It loads the environment once, then answers requests,
each in a fresh forked process.

It reads ``/job/spec.json`` (a read-only file bwrap made from the parent's memfd)::

    {"kind": "file" | "reasoning_gym" | "verifiers", "record_fd": int,
     "entry": "/env/my_env.py",                      # file: the environment file
     "module": "vf_gsm8k",                           # verifiers: the module load_environment lives in
     "datasets": [[name, weight], ...],              # reasoning_gym
     "args": {...}, "site_dirs": [path, ...], "env_root": "/env" | "",
     "limits": {"memory_bytes", "processes", "open_files", "output_bytes", "cpu_time_s"}}

sets RLIMIT_AS, NPROC, NOFILE, FSIZE and CORE = 0, adds ``site_dirs`` (read-only binds of the
node's site-packages) and ``env_root`` (the environment's own files, bound from memfds) to
``sys.path``, loads the environment, and writes ``{"ready": true}`` (or ``{"fatal": "…"}``) to
``record_fd``. Then, per JSON line on stdin::

    {"op": "describe", "train": [seed, count], "heldout": [seed, count], "wall_s": s, "max_bytes": n}
    {"op": "score", "row": {...}, "completion": str, "wall_s": s, "max_bytes": n}
    {"op": "score_many", "items": [{"row": {...}, "completion": str}, ...], "item_wall_s": s, "wall_s": s, "max_bytes": n}

it forks (``score_many``: and that fork forks once per item, each bounded by ``item_wall_s``,
so a batch scores as one ``score`` call per item would); the fork sets RLIMIT_CPU, seeds ``random`` (and numpy's global generator, when loaded)
from the request, runs the environment's code and writes its answer to a pipe; the harness waits
at most ``wall_s`` for it (then SIGKILL), reads at most ``max_bytes``, kills every other process
of the sandbox's pid namespace (whatever the call left running), and writes one answer line::

    {"items": {"train": [...], "heldout": [...] | null}}       # describe
    {"score": float, "detail": str}                            # score
    {"scores": [{"score": …} | {"fault": …}, ...]}             # score_many, one per item
    {"fault": "crash" | "wall" | "cpu" | "memory" | "output" | "value", "detail": str}

The environment's code runs as the same user as this harness and could tamper with it; that can
only change the answers, which the node treats as the environment's (bounded, checked, never
trusted beyond a score). The sandbox, not this file, is the boundary.
"""



import errno
import hashlib
import importlib.util
import json
import math
import os
import random
import resource
import select
import signal
import site
import sys
import time
from collections.abc import Callable
from typing import Any

_SPEC_PATH = "/job/spec.json"
_MAX_REQUEST_BYTES = 64 * 1024**2
_SWEEP_ROUNDS = 20
_DEFAULT_TEMPLATE = "{question}\n\nGive your final answer between <answer> and </answer>."


class _Fault(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON-ready copy of a row: tuples and sets become lists, other objects their ``str``, non-finite floats ``null``."""
    if depth > 32:
        return None
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, (set, frozenset)):
        items = [_plain(x, depth + 1) for x in v]
        try:
            return sorted(items)
        except TypeError:
            return sorted(items, key=repr)
    return str(v)


def _read_rows(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json task file must hold a list of task objects")
        return rows
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class FileEnv:
    """A plain Python file: ``score(task, completion) -> float``; tasks from ``generate(seed, count)``
    or ``TASKS_FILE`` (and ``HELDOUT_FILE``); prompts from ``prompt(task)`` or ``task["prompt"]``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        entry = spec["entry"]
        mspec = importlib.util.spec_from_file_location("intellect_env", entry)
        if mspec is None or mspec.loader is None:
            raise ImportError(f"cannot load {entry}")
        self.m = importlib.util.module_from_spec(mspec)
        sys.modules["intellect_env"] = self.m
        mspec.loader.exec_module(self.m)
        if not callable(getattr(self.m, "score", None)):
            raise TypeError("the environment file defines no score(task, completion) function")
        self.root = os.path.dirname(entry)

    def _items(self, rows: Any) -> list[dict[str, Any]]:
        if not isinstance(rows, (list, tuple)):
            raise TypeError(f"tasks must be a list of dicts, got {type(rows).__name__}")
        prompt = getattr(self.m, "prompt", None)
        items = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"task {i} is a {type(row).__name__}, not a dict")
            text = prompt(row) if callable(prompt) else row.get("prompt")
            if not isinstance(text, str):
                raise TypeError(f"task {i}: no prompt (define prompt(task) -> str or give each task a 'prompt' string)")
            pid = row.get("id")
            items.append({"id": pid if isinstance(pid, str) else None, "prompt": text, "row": row})
        return items

    def describe(self, train: list[int], heldout: list[int]) -> dict[str, Any]:
        generate = getattr(self.m, "generate", None)
        if callable(generate):
            return {"train": self._items(list(generate(train[0], train[1]))),
                    "heldout": self._items(list(generate(heldout[0], heldout[1]))) if heldout[1] else []}
        tasks_file = getattr(self.m, "TASKS_FILE", None)
        if not isinstance(tasks_file, str):
            raise TypeError("the environment file defines neither generate(seed, count) nor TASKS_FILE")
        rows = _read_rows(os.path.join(self.root, tasks_file))[: train[1]]
        held_file = getattr(self.m, "HELDOUT_FILE", None)
        held = _read_rows(os.path.join(self.root, held_file))[: heldout[1]] if isinstance(held_file, str) else None
        return {"train": self._items(rows), "heldout": None if held is None else self._items(held)}

    def score(self, row: dict[str, Any], completion: str) -> Any:
        return self.m.score(row, completion)


class ReasoningGymEnv:
    """reasoning-gym datasets by name, mixed by weight (reasoning-gym's composite dataset). ``args``:
    one table of dataset config per dataset name, ``template`` (``str.format`` over the entry:
    ``{question}``, ``{metadata[expression]}``) and ``answer``: ``"tag"`` (reasoning-gym's
    ``<answer>…</answer>``, the default) or ``"text"`` (the whole completion, stripped)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import reasoning_gym
        from reasoning_gym.composite import DatasetSpec
        from reasoning_gym.utils import extract_answer

        args = dict(spec["args"])
        names = [n for n, _ in spec["datasets"]]
        self.template = args.pop("template", _DEFAULT_TEMPLATE)
        self.answer = args.pop("answer", "tag")
        if not isinstance(self.template, str) or self.answer not in ("tag", "text"):
            raise ValueError("env.args.template must be a string and env.args.answer 'tag' or 'text'")
        unknown = sorted(set(args) - set(names))
        if unknown:
            raise ValueError(f"env.args has {unknown}: neither a dataset of env.name ({names}) nor template/answer")
        for name in names:
            cfg = args.get(name, {})
            if not isinstance(cfg, dict) or {"seed", "size"} & set(cfg):
                raise ValueError(f"env.args.{name} must be a table of the dataset's config without seed or size "
                                 "(env.seed, env.train_size and env.heldout_size set those)")
            reasoning_gym.create_dataset(name, seed=0, size=1, **cfg)  # an unknown dataset or field fails here, at load
        self.specs = [DatasetSpec(name=n, weight=float(w), config=dict(args.get(n, {}))) for n, w in spec["datasets"]]
        self.create = reasoning_gym.create_dataset
        self.extract = extract_answer
        self._cache: dict[int, Any] = {}

    def _dataset(self, seed: int) -> Any:
        if seed not in self._cache:
            self._cache[seed] = self.create("composite", seed=seed, size=1, datasets=self.specs)
        return self._cache[seed]

    def _split(self, split: str, seed: int, count: int) -> list[dict[str, Any]]:
        ds = self._dataset(seed)
        items = []
        for i in range(count):
            entry = ds[i]
            row = _plain(entry)
            row["rg"] = {"seed": seed, "index": i}
            answer = str(entry.get("answer", ""))
            row["reference"] = f"<answer>{answer}</answer>" if self.answer == "tag" else answer
            name = entry.get("metadata", {}).get("source_dataset", "task")
            items.append({"id": f"{name}/{split}/{i}", "prompt": self.template.format(**entry), "row": row})
        return items

    def describe(self, train: list[int], heldout: list[int]) -> dict[str, Any]:
        return {"train": self._split("train", train[0], train[1]), "heldout": self._split("heldout", heldout[0], heldout[1])}

    def score(self, row: dict[str, Any], completion: str) -> Any:
        where = row["rg"]
        ds = self._dataset(int(where["seed"]))
        entry = ds[int(where["index"])]
        answer = self.extract(completion) if self.answer == "tag" else completion.strip()
        return ds.score_answer(answer, entry)


class VerifiersEnv:
    """A verifiers single-turn environment: ``load_environment(**args)`` of its module; tasks from
    its dataset (held-out: its ``eval_dataset``); score: its rubric's weighted reward."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import verifiers as vf

        self.vf = vf
        self.env = vf.load_environment(spec["module"], **spec["args"])
        kind = type(self.env).__name__
        if "SingleTurn" not in kind and not any("SingleTurn" in c.__name__ for c in type(self.env).__mro__):
            raise TypeError(f"{spec['module']} is a {kind}; only single-turn environments can be trained here")

    @staticmethod
    def _prompt(prompt: Any) -> str:
        if isinstance(prompt, str):
            return prompt
        parts = [m.get("content") for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]
        return "\n\n".join(parts)

    def _items(self, ds: Any) -> list[dict[str, Any]]:
        return [{"id": None, "prompt": self._prompt(row.get("prompt", row.get("question", ""))), "row": _plain(dict(row))} for row in ds]

    def describe(self, train: list[int], heldout: list[int]) -> dict[str, Any]:
        items = self._items(self.env.get_dataset(n=train[1]))
        build = getattr(self.env, "build_eval_dataset", None)
        if callable(build):
            build()
        held = None
        if getattr(self.env, "eval_dataset", None) is not None and heldout[1]:
            held = self._items(self.env.get_eval_dataset(n=heldout[1]))
        return {"train": items, "heldout": held}

    def score(self, row: dict[str, Any], completion: str) -> Any:
        import asyncio

        state = self.vf.State.for_task(row)
        chat = getattr(self.env, "message_type", "chat") == "chat"
        state["completion"] = [{"role": "assistant", "content": completion}] if chat else completion
        asyncio.run(self.env.rubric.score_rollout(state))
        return state["reward"]


_KINDS = {"file": FileEnv, "reasoning_gym": ReasoningGymEnv, "verifiers": VerifiersEnv}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _sweep(*keep: int) -> None:
    """Kill every process of this pid namespace but its init (pid 1), the caller and ``keep``."""
    spared = {1, os.getpid(), *keep}
    for _ in range(_SWEEP_ROUNDS):
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in spared]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _seed(item: Any) -> None:
    """Seed ``random`` (and numpy's global generator) from ``item``: the same draws for the same call on every node."""
    seed = hashlib.sha256(json.dumps(item, sort_keys=True).encode("utf-8", "surrogatepass")).digest()
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(int.from_bytes(seed[:4], "big"))


def _score_one(env: Any, row: dict[str, Any], completion: str) -> dict[str, Any]:
    """One score, or the fault of the environment's code on it (a MemoryError is a fault too)."""
    _seed({"row": row, "completion": completion})
    try:
        value = env.score(row, completion)
    except MemoryError:
        return {"fault": "memory", "detail": "MemoryError"}
    except Exception as e:  # noqa: BLE001 - the environment's failure is an answer
        return {"fault": "crash", "detail": f"{type(e).__name__}: {e}"[:300]}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return {"fault": "value", "detail": f"score returned {str(value)[:80]!r}, not a number in [0, 1]"}
    return {"score": float(value), "detail": ""}


def _in_fork(work: Callable[[], dict[str, Any]], wall_s: float, max_bytes: int, keep: tuple[int, ...] = ()) -> dict[str, Any]:
    """``work()`` in a fork of this process; its answer, or a fault. Waits at most ``wall_s`` for
    the answer line (then SIGKILL), reads at most ``max_bytes``, and then kills every process of the
    sandbox but pid 1, this one and ``keep`` (whatever the call left running). The answer ends at its
    newline, not at EOF: a process the call left may hold the pipe open."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the call's own process
        os.close(r)
        try:
            data = json.dumps(work(), allow_nan=False).encode("utf-8", "surrogatepass")
        except MemoryError:
            data = b'{"fault": "memory", "detail": "MemoryError"}'
        except OSError as e:
            kind = "output" if e.errno == errno.EFBIG else "crash"
            data = json.dumps({"fault": kind, "detail": f"{type(e).__name__}: {e}"[:300]}).encode()
        except BaseException as e:  # noqa: BLE001 - the environment's failure is an answer
            data = json.dumps({"fault": "crash", "detail": f"{type(e).__name__}: {e}"[:300]}).encode("utf-8", "replace")
        try:
            _write_all(w, data + b"\n")  # JSON holds no raw newline
        finally:
            os._exit(0)
    os.close(w)
    buf = bytearray()
    deadline = time.monotonic() + wall_s
    fault: tuple[str, str] | None = None
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                fault = ("wall", f"ran over {wall_s:g} s")
                break
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            if len(buf) > max_bytes:
                fault = ("output", f"answer over {max_bytes} bytes")
                break
    finally:
        os.close(r)
    done = fault is None and b"\n" in buf
    try:
        os.kill(pid, signal.SIGKILL)  # it exits once it has answered; an answer cut short or late ends here
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    _sweep(*keep)
    if fault is not None:
        return {"fault": fault[0], "detail": fault[1]}
    if not done and not buf and os.WIFSIGNALED(status):  # it died before answering (RLIMIT_CPU: SIGXCPU, then SIGKILL)
        sig = os.WTERMSIG(status)
        return {"fault": "cpu" if sig in (signal.SIGXCPU, signal.SIGKILL) else "crash", "detail": f"killed by signal {sig}"}
    try:
        answer = json.loads(bytes(buf))
    except ValueError:
        return {"fault": "crash", "detail": "the call ended without an answer"}
    return answer if isinstance(answer, dict) else {"fault": "crash", "detail": "malformed answer"}


def _call_in_fork(env: Any, req: dict[str, Any], lim: dict[str, Any], record_fd: int) -> dict[str, Any]:
    """Run one request in a fork (see the module docstring); the answer or a fault."""
    cpu = int(lim["cpu_time_s"])

    def work() -> dict[str, Any]:
        os.close(record_fd)
        if req["op"] == "describe":
            resource.setrlimit(resource.RLIMIT_CPU, (int(req["wall_s"]) + 1,) * 2)
            _seed({"train": req["train"], "heldout": req["heldout"]})
            return {"items": env.describe(req["train"], req["heldout"])}
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        if req["op"] == "score_many":
            # each item in its own fork, as a ``score`` call runs in its own fork of the harness: it sees
            # the environment as loaded (nothing an earlier item changed in its globals), has its own CPU
            # limit and wall, and what it left running is killed before the next; so a batch scores exactly
            # as one call per item would (a worker scores in batches, a validator re-checks one by one)
            harness, item_wall_s = os.getppid(), float(req["item_wall_s"])
            return {"scores": [_in_fork(lambda item=item: _score_one(env, item["row"], item["completion"]), item_wall_s, 1 << 16, (harness,))
                               for item in req["items"]]}
        return _score_one(env, req["row"], req["completion"])

    return _in_fork(work, float(req["wall_s"]), int(req["max_bytes"]))


def _main() -> None:
    with open(_SPEC_PATH, encoding="utf-8") as f:
        spec = json.load(f)
    record_fd = int(spec["record_fd"])
    lim = spec["limits"]
    for rlim, value in (
        (resource.RLIMIT_AS, (int(lim["memory_bytes"]),) * 2),
        (resource.RLIMIT_FSIZE, (int(lim["output_bytes"]),) * 2),
        (resource.RLIMIT_NPROC, (int(lim["processes"]),) * 2),
        (resource.RLIMIT_NOFILE, (int(lim["open_files"]),) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(rlim, value)

    def send(obj: dict[str, Any]) -> None:
        _write_all(record_fd, (json.dumps(obj, allow_nan=False) + "\n").encode("utf-8", "surrogatepass"))

    try:
        for d in spec["site_dirs"]:
            site.addsitedir(d)
        if spec.get("env_root"):
            sys.path.insert(0, spec["env_root"])
        env = _KINDS[spec["kind"]](spec)
    except BaseException as e:  # noqa: BLE001 - reported to the node in one line
        send({"fatal": f"{type(e).__name__}: {e}"[:500]})
        os._exit(1)
    _sweep()  # nothing the import started keeps running
    send({"ready": True})
    stdin = os.fdopen(0, "rb", buffering=0)
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = stdin.read(1 << 16)
            if not chunk:
                os._exit(0)
            pending += chunk
            if len(pending) > _MAX_REQUEST_BYTES:
                os._exit(2)
        line, pending = pending.split(b"\n", 1)
        send(_call_in_fork(env, json.loads(line), lim, record_fd))


_main()
