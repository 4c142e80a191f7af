"""`doctor`: check this machine and the run's services before joining, each check PASS/WARN/FAIL with a fix.

Cheap on purpose: no torch import; network checks are single HTTP GETs or TCP connects with a short
timeout, plus (unless ``--gossip-wait 0``) a few seconds on the run's gossip as a silent observer
to hear a signed record of this run. Exit status 1 when any check FAILs.

Answers are read as a hostile peer may write them (relays come from the coordinator's run page,
which any self-signed gossip record joins): every request has a whole-request deadline (connect,
head and body; a per-read timeout would let a server dribbling one byte every 2 s hold it forever),
bodies are cut at :data:`MAX_BODY_BYTES` and JSON refused deeper than :data:`MAX_JSON_DEPTH`
before it is decoded; a server that breaks a bound is a FAIL line. Checks of one kind run side by
side and all network checks share one budget, so doctor finishes within :func:`budget_s` seconds
(30 with the default ``--gossip-wait``) whatever the servers do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from node.cli import CliError, add_run_argument, command
from node.paths import default_data_dir
from node.reach import speaks_libp2p
from node.terminal import printable

if TYPE_CHECKING:
    from protocol.runspec import RunSpec

Status = Literal["PASS", "WARN", "FAIL"]
ROLES = ("worker", "relay", "validate", "coordinator")
DEFAULT_TIMEOUT_S = 3.0
DEFAULT_GOSSIP_WAIT_S = 5.0
"""Longest wait on gossip for the coordinator's signed heartbeat, seconds (it beats every ``heartbeat_interval_s``)."""
MAX_BODY_BYTES = 1 << 20
"""Largest HTTP answer a check reads, bytes."""
MAX_JSON_DEPTH = 16
"""Deepest JSON nesting a check decodes (the answers doctor reads are 4 levels deep)."""
NETWORK_BUDGET_S = 25.0
"""Seconds all network checks together may take, besides ``--gossip-wait`` beyond its default."""
LOCAL_RESERVE_S = 3.0
"""Seconds kept back from the network budget for the checks of this machine (disk, memory, ports)."""
MAX_RELAYS = 16
"""Relays probed at most (those the coordinator lists first)."""
CLOCK_PASS_S = 2.0
"""Offsets up to this many seconds pass (the HTTP Date header has 1 s resolution)."""
CLOCK_FAIL_S = 30.0
"""Offsets beyond this fail: validator leases are refused when signed more than 60 s off."""
MEMORY_FACTOR = 4
"""Memory a worker or validator needs, in multiples of the weights' bytes (engine copy, load buffer, activations)."""
TRAINER_MEMORY_FACTOR = 6
"""...and the coordinator, which trains: weights, gradients, two AdamW moments, plus activations and a publish copy."""
MATH_TASK_SETS = {"embedded", "gsm8k", "gsm8k_train", "math500", "math_train"}
"""Task sets without code tasks: the code-reward sandbox is not needed for them."""


@dataclass
class Check:
    """One line of the report: what was checked, the outcome, what was seen, and how to fix it."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        """The check as ``doctor`` prints it; what servers sent is shown escaped (``node.terminal``)."""
        return f"{self.status:4}  {self.name:<22} {printable(self.detail)}" + (
            f"\n      fix: {printable(self.fix)}" if self.fix and self.status != "PASS" else "")


@command
def _doctor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="check this machine and the run's services before joining (PASS/WARN/FAIL, a fix for each)")
    add_run_argument(p)
    p.add_argument("--role", choices=ROLES, default="worker", help="what this node will do (default worker)")
    p.add_argument("--data-dir", default=None, help=f"node data directory, for the free-disk check (default: {default_data_dir()})")
    p.add_argument("--host", default="127.0.0.1", help="interface the node will listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP/status port the node will bind (default 0: any)")
    p.add_argument("--p2p-port", type=int, default=0, help="libp2p TCP port the node will bind (default 0: any)")
    p.add_argument("--public-url", default="", help="relay: the URL it will announce (checked against the address the coordinator sees)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help=f"per network check, seconds (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--gossip-wait", type=float, default=DEFAULT_GOSSIP_WAIT_S, metavar="S",
                   help=f"join the run's gossip as a silent observer for up to S seconds to hear the coordinator's signed heartbeat "
                        f"(0: skip; default {DEFAULT_GOSSIP_WAIT_S:g})")
    p.add_argument("--data-root", default=None, help="coordinator: where the public task sets are (checked against data.tasks_hash)")
    p.add_argument("--key", default=None, help="coordinator: its key file (checked against run.coordinator of the spec)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(handler=_run_doctor)


def budget_s(gossip_wait_s: float) -> float:
    """Longest time :func:`run_checks` takes, seconds: :data:`NETWORK_BUDGET_S` plus the gossip
    wait (30 s with the default 5 s wait), plus a few seconds of local checks."""
    return NETWORK_BUDGET_S + gossip_wait_s


class Budget:
    """The time left to doctor's network checks: each request's deadline is its own timeout or what
    is left, whichever is shorter (a check that starts with nothing left is skipped)."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def cap(self, timeout_s: float) -> float:
        """``timeout_s``, or less when the budget ends sooner."""
        return min(timeout_s, self.left())


def _run_doctor(args: argparse.Namespace) -> int:
    if not 0 < args.timeout <= 60:
        raise CliError("--timeout must be between 0 and 60 seconds")
    if not 0 <= args.gossip_wait <= 300:
        raise CliError("--gossip-wait must be between 0 and 300 seconds")
    for name in ("http_port", "p2p_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise CliError(f"--{name.replace('_', '-')} must be 0…65535")
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if bool(args.address) == bool(args.run):
        raise CliError("name the run once: its address (intellect1:…) or --run run.toml")
    run = args.address or args.run
    tables: list[str] = []
    if args.role == "coordinator":
        checks = coordinator_checks(Path(run), data_dir=data_dir, data_root=Path(args.data_root) if args.data_root else None,
                                    key=Path(args.key) if args.key else None, host=args.host, http_port=args.http_port,
                                    p2p_port=args.p2p_port)
    else:
        checks = run_checks(run, role=args.role, data_dir=data_dir, host=args.host, http_port=args.http_port,
                            p2p_port=args.p2p_port, timeout_s=args.timeout, gossip_wait_s=args.gossip_wait, public_url=args.public_url,
                            tables=tables)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(c.line())
        for table in tables:
            print(table)
        n = {s: sum(c.status == s for c in checks) for s in ("PASS", "WARN", "FAIL")}
        print(f"doctor ({args.role}): {n['PASS']} passed, {n['WARN']} warnings, {n['FAIL']} failed")
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def run_checks(run: Path | str, *, role: str = "worker", data_dir: Path, host: str = "127.0.0.1", http_port: int = 0, p2p_port: int = 0,
               timeout_s: float = DEFAULT_TIMEOUT_S, gossip_wait_s: float = 0.0, public_url: str = "",
               tables: list[str] | None = None) -> list[Check]:
    """All checks for ``role`` against the run spec at ``run``, in report order, within :func:`budget_s` seconds.

    Args:
        run: the signed run spec file, or the run's address (its spec fetched and verified, written nowhere).
        role: ``worker``, ``relay`` or ``validate``.
        data_dir: where checkpoints will be kept (its file system's free space is checked).
        host, http_port, p2p_port: what the node will bind (0: any free port).
        timeout_s: per network request (whole request: connect, head and body), seconds.
        gossip_wait_s: longest wait on gossip for the coordinator's signed heartbeat, seconds (0: no gossip check).
        public_url: a relay's ``--public-url`` (checked against the address the coordinator sees).
        tables: receives the text tables to print under the checks (the machine-fit table of a worker or validator).

    Returns:
        The checks; a spec that does not verify ends the list after its FAIL. A relay's end with the
        coordinator's dial-back of its ports (``doctor_reach.py``); a worker's and validator's with the
        machine fit (``doctor_fit.py``).
    """
    from node.bootstrap import JoinError, read_run

    try:
        signed, address = read_run(str(run))
    except JoinError as e:
        return [Check("run spec signature", "FAIL", str(e)[:300], "get the run spec again from the coordinator: it is unsigned, altered or not a run spec")]
    run_id = signed.run_id.hex()
    # the checks' view of where the run is: the spec's locations and the address's (a spec may name none: the
    # address does); only for reading the locations (its run_id is not the run's: run_id above is)
    spec = _with_address(signed.spec, address)
    budget = Budget(budget_s(gossip_wait_s) - LOCAL_RESERVE_S)
    checks = [Check("run spec signature", "PASS", f"run {spec.run.name} ({run_id[:16]}…) signed by coordinator {spec.run.coordinator}")]
    coord_status, clock = _check_ingest(spec, run_id, checks, timeout_s, budget)
    checks += _check_bootstrap(spec, run_id, coord_status, timeout_s, budget)
    if gossip_wait_s > 0:
        checks.append(_check_gossip(signed.spec, gossip_wait_s, host, budget, bootstrap=list(address.bootstrap) if address else []))
    checks += _check_origins(spec, run_id, timeout_s, budget)
    checks.append(_check_relays(spec, run_id, timeout_s, budget))
    checks.append(_check_clock(clock))
    model_bytes = estimate_model_bytes(spec)
    checks.append(_check_disk(data_dir, model_bytes, spec.shardcast.keep_steps))
    checks.append(_check_memory(model_bytes, role))
    checks.append(_check_gpu(model_bytes, role))
    if role != "relay":
        from node.commands.doctor_fit import check_fit
        from node.machine import probe_machine

        fit, table = check_fit(spec, data_dir, probe_machine(use_torch=False))
        checks.append(fit)
        if tables is not None:
            tables.append(table)
    checks.append(_check_sandbox(spec.data.tasks, role))
    if spec.env.name and role != "relay":
        checks.append(_check_environment(spec))
    checks.append(_check_port(host, http_port, "HTTP/status port", "--http-port"))
    if role != "relay" or p2p_port:
        checks.append(_check_port(host, p2p_port, "libp2p port", "--p2p-port"))
    if role == "relay":
        from node.commands.doctor_reach import check_reachability

        coord_urls = list(spec.network.ingest_urls)
        if budget.left() < 2.0:
            checks.append(Check("reachable", "WARN", "not checked: doctor's time budget was spent on the checks above", "fix the slow checks above first"))
        else:
            checks += check_reachability(coord_urls, signed.run_id, host=host, http_port=http_port, p2p_port=p2p_port,
                                         public_url=public_url, timeout_s=budget.left() / 2)
    return checks


def coordinator_checks(run: Path, *, data_dir: Path, data_root: Path | None = None, key: Path | None = None, host: str = "127.0.0.1",
                       http_port: int = 0, p2p_port: int = 0) -> list[Check]:
    """The checks before starting ``intellect-train``: the spec, the coordinator's key, the validator
    keys in the spec, the task files (against ``data.tasks_hash``) and whether they are a training
    split, the base model (against ``model.base_hash``), disk, memory, sandbox and the two ports.

    Args:
        run: the signed run spec file.
        data_dir: the coordinator's ``--data-dir`` (free disk).
        data_root: ``--data-root`` of ``intellect-train`` (the public task sets).
        key: the coordinator's key file (``None``: not checked).
        host: the interface the coordinator will bind.
        http_port, p2p_port: its ports; 0 reads them from the spec (the first ingest URL, the
            coordinator's bootstrap address).

    Returns:
        The checks; a spec that does not verify ends the list after its FAIL.
    """
    from protocol.errors import RunSpecError
    from protocol.runspec import load_run_spec

    try:
        signed = load_run_spec(run)
    except RunSpecError as e:
        return [Check("run spec signature", "FAIL", str(e)[:300], "write the spec again with intellect-node spec init")]
    spec = signed.spec
    checks = [Check("run spec signature", "PASS", f"run {spec.run.name} ({signed.run_id.hex()[:16]}…) signed by coordinator {spec.run.coordinator}")]
    checks.append(_check_coordinator_key(key, spec.run.coordinator))
    checks.append(_check_validator_keys(spec))
    checks += _check_task_files(spec, data_root)
    checks.append(_check_base(spec))
    model_bytes = estimate_model_bytes(spec)
    checks.append(_check_disk(data_dir, model_bytes, spec.shardcast.keep_steps))
    checks.append(_check_memory(model_bytes, "coordinator"))
    checks.append(_check_gpu(model_bytes, "coordinator"))
    checks.append(_check_sandbox(spec.data.tasks, "coordinator"))
    if not http_port:
        http_port = next((p for p in (_url_port(u) for u in spec.network.ingest_urls[:1]) if p), 0)
    if not p2p_port:
        own = [m for m in (_parse_multiaddr(a) for a in spec.network.bootstrap) if m is not None and m[2] == spec.run.coordinator]
        p2p_port = own[0][1] if own else 0
    checks.append(_check_port(host, http_port, "HTTP port (ingest, origin)", "--http-port"))
    checks.append(_check_port(host, p2p_port, "libp2p port", "--p2p-port"))
    return checks


def _url_port(url: str) -> int:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return 0


def _check_coordinator_key(key: Path | None, coordinator: str) -> Check:
    if key is None:
        return Check("coordinator key", "WARN", "not checked (no --key)", "pass --key coord.key to check it is the key the spec names")
    from protocol.errors import KeyFileError
    from protocol.identity import NodeKey

    try:
        peer = NodeKey.load(key).peer_id
    except KeyFileError as e:
        return Check("coordinator key", "FAIL", str(e)[:300], "use the key spec init was given (--coordinator-key), mode 0600")
    if peer != coordinator:
        return Check("coordinator key", "FAIL", f"{key} is peer {peer}; the spec's coordinator is {coordinator}",
                     "start intellect-train with the key the spec was signed with, or write a new spec with this key")
    return Check("coordinator key", "PASS", f"{key} is the spec's coordinator {peer}")


def _check_validator_keys(spec: RunSpec) -> Check:
    vals = spec.run.validators
    if not vals:
        return Check("validator keys", "FAIL", "the spec names no validator: no verdict counts, so no rollout is ever trained on",
                     "spec init --validator PEER_ID (the peer ID intellect-node keygen printed on the validator's machine); "
                     "a new spec is a new run")
    return Check("validator keys", "PASS", f"{len(vals)} in the spec: {', '.join(vals[:4])}{' …' if len(vals) > 4 else ''}; "
                                           "each validator must start with the key of one of them")


def _check_task_files(spec: RunSpec, data_root: Path | None) -> list[Check]:
    from protocol.dataset import resolve_tasks
    from protocol.tasks import CONVERTER_NAMES, TaskError, training_split_warning

    tasks = spec.data.tasks
    out = []
    if spec.env.name:
        from protocol.dataset import resolve_run_tasks
        from protocol.rewards import RewardError

        try:
            env_tasks = resolve_run_tasks(spec, data_root)
        except (TaskError, RewardError) as e:
            out.append(Check("environment", "FAIL", str(e)[:300], "install what the spec's env.name needs, as on the coordinator: the "
                             "extra the error names, the same environment file and the same package versions"))
        else:
            out.append(Check("environment", "PASS", f"{spec.env.name}: hash {spec.env.hash[:16]}… matches the spec; "
                             f"{len(env_tasks.train)} training tasks, {len(env_tasks.heldout)} held out, scored in the sandbox", ""))
        return out
    if tasks in CONVERTER_NAMES and data_root is None:
        out.append(Check("task files", "FAIL", f"data.tasks {tasks!r} is a public set, and no --data-root was given",
                         "pass --data-root DIR (holding math/ and code/), the same as intellect-train's"))
    else:
        try:
            got = resolve_tasks(tasks, data_root, spec.data.tasks_hash)
        except TaskError as e:
            out.append(Check("task files", "FAIL", str(e)[:300], "copy the exact task files the spec was made from (rsync), "
                                                                "or write a new spec with --data-root (a new run)"))
        else:
            pinned = (f"tasks_hash {got.hash[:16]}… matches the spec" if spec.data.tasks_hash else
                      "the spec pins no tasks_hash, so nodes cannot check they hold the same files (spec init --data-root pins it)")
            out.append(Check("task files", "PASS" if spec.data.tasks_hash or tasks == "embedded" else "WARN",
                             f"{tasks}: {len(got.train)} training tasks, {len(got.heldout)} held out; {pinned}",
                             "spec init --tasks … --data-root DIR (a new spec and run)"))
    warning = training_split_warning(tasks)
    if warning:
        out.append(Check("training split", "WARN", warning, "spec init --tasks with a training set (a new spec and run)"))
    return out


def _check_base(spec: RunSpec) -> Check:
    if spec.model.base == "embedded":
        from node.coordinator.base import EMBEDDED_BASE_DIR, base_cache_root, check_shipped_base, uses_shipped_base
        from protocol.models import ModelLoadError

        if not uses_shipped_base(spec):
            return Check("base model", "PASS", f"the embedded model, warm-started once on this machine at start and cached in {base_cache_root()} "
                         "(only the embedded task set at hidden 128 has a shipped base)")
        try:
            check_shipped_base()
        except ModelLoadError as e:
            return Check("base model", "FAIL", str(e), "pip install -e . again (or git checkout node/coordinator/embedded_base)")
        return Check("base model", "PASS", f"the embedded base shipped in the package ({EMBEDDED_BASE_DIR}), its hash checked")
    base = Path(spec.model.base)
    if not base.is_dir():
        return Check("base model", "FAIL", f"model.base {base} is not a directory on this machine",
                     "copy the exact model directory to that path (every torchrun rank needs it)")
    from protocol.models import ModelLoadError, base_hash  # imports torch: only for this role

    try:
        digest = base_hash(base)
    except (ModelLoadError, OSError) as e:
        return Check("base model", "FAIL", str(e)[:300], "copy the exact model directory the spec was made from")
    if spec.model.base_hash and digest != spec.model.base_hash:
        return Check("base model", "FAIL", f"{base} hashes to {digest[:16]}…, the spec pins {spec.model.base_hash[:16]}…",
                     "copy the exact files (rsync); do not re-download or re-save them")
    return Check("base model", "PASS", f"{base}: base_hash {digest[:16]}… matches the spec")


# --- network -----------------------------------------------------------------------------------


class AnswerError(ValueError):
    """An HTTP answer that broke a bound or is not what a check reads (the message says which)."""


async def _get_one(session: Any, url: str, deadline_s: float) -> tuple[dict[str, Any], float | None]:
    import aiohttp

    from node.http_read import BodyTooLarge, read_body
    from node.jsonlimits import loads_bounded

    if deadline_s <= 0:
        raise TimeoutError("not asked: doctor's time budget was spent on the checks above")
    t0 = time.time()
    try:
        async with asyncio.timeout(deadline_s):  # the whole request: connect, head, body
            async with session.get(url, allow_redirects=False) as r:
                if r.status != 200:
                    raise AnswerError(f"HTTP {r.status}")
                try:
                    body = await read_body(r, MAX_BODY_BYTES)
                except BodyTooLarge as e:
                    raise AnswerError(f"answer larger than {MAX_BODY_BYTES} bytes ({e})") from None
                date = r.headers.get("Date")
    except TimeoutError:
        raise TimeoutError(f"no complete answer within {deadline_s:.1f} s") from None
    except aiohttp.ClientResponseError as e:  # a head aiohttp refuses: too long, malformed
        raise AnswerError(f"malformed HTTP answer: {e.message[:120]}") from None
    except aiohttp.ClientError as e:
        raise OSError(str(e)[:200] or type(e).__name__) from None
    t1 = time.time()
    try:
        doc = loads_bounded(body, max_bytes=MAX_BODY_BYTES, max_depth=MAX_JSON_DEPTH)
    except ValueError as e:
        raise AnswerError(f"not usable JSON: {e}") from None
    if not isinstance(doc, dict):
        raise AnswerError("answer is not a JSON object")
    offset = None
    if date:
        try:
            offset = parsedate_to_datetime(date).timestamp() - (t0 + t1) / 2
        except (TypeError, ValueError):
            offset = None
    return doc, offset


def _get_many(urls: list[str], timeout_s: float, budget: Budget) -> list[tuple[dict[str, Any], float | None] | BaseException]:
    """GET every URL as a JSON object at once, each within ``min(timeout_s, budget left)`` seconds.

    Returns:
        Per URL, ``(document, server clock − ours in seconds or None)`` or the exception that ended
        it: ``OSError`` (unreachable), ``TimeoutError`` (no complete answer in time) or
        :class:`AnswerError` (a bound broken, an HTTP error, not a JSON object).
    """
    import aiohttp

    async def go() -> list[Any]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            deadline = budget.cap(timeout_s)
            return await asyncio.gather(*(_get_one(session, u, deadline) for u in urls), return_exceptions=True)

    if not urls:
        return []
    return asyncio.run(go())


def _get(url: str, timeout_s: float, budget: Budget | None = None) -> tuple[dict[str, Any], float | None]:
    """GET ``url`` as a JSON object (see :func:`_get_many`).

    Raises:
        OSError, ValueError: unreachable, too slow, an HTTP error, or not a bounded JSON object.
    """
    (got,) = _get_many([url], timeout_s, budget or Budget(timeout_s))
    if isinstance(got, BaseException):
        raise got
    return got


def _why(e: BaseException) -> str:
    return str(e)[:200] or type(e).__name__


def _check_ingest(spec: RunSpec, run_id: str, checks: list[Check], timeout_s: float,
                  budget: Budget) -> tuple[dict[str, Any] | None, float | None]:
    """Ingest URLs answer ``/status`` for this run; returns the coordinator's status and clock offset."""
    coord: dict[str, Any] | None = None
    clock: float | None = None
    if not spec.network.ingest_urls:
        checks.append(Check("ingest", "FAIL", "the run spec lists no ingest URL", "ask the coordinator for a spec with network.ingest_urls"))
    urls = spec.network.ingest_urls[:4]
    for url, got in zip(urls, _get_many([f"{u.rstrip('/')}/status" for u in urls], timeout_s, budget)):
        if isinstance(got, BaseException):
            checks.append(Check(f"ingest {url}", "FAIL", f"{_failure(got)}: {_why(got)}",
                                "check that the coordinator is up and this address is reachable from here (firewall, NAT)"))
            continue
        doc, offset = got
        if doc.get("run_id") != run_id:
            checks.append(Check(f"ingest {url}", "FAIL", f"serves run {str(doc.get('run_id'))[:16]}…, not this run {run_id[:16]}…",
                                "the spec's ingest URL points at another run: get the current run spec from the coordinator"))
            continue
        coord = coord or doc
        clock = offset if clock is None else clock
        checks.append(Check(f"ingest {url}", "PASS", f"this run; trainer step {str(doc.get('trainer_step'))[:20]}, "
                                                     f"latest policy {str(doc.get('latest_policy_step'))[:20]}"))
    return coord, clock


def _failure(e: BaseException) -> str:
    """How a request failed, as a check's detail starts: ``unreachable``, ``too slow`` or ``bad answer``."""
    if isinstance(e, TimeoutError):
        return "too slow"
    if isinstance(e, AnswerError):
        return "bad answer"
    return "unreachable"


def _parse_multiaddr(addr: str) -> tuple[str, int, str] | None:
    """``/ip4|ip6|dns4|dns6|dns/HOST/tcp/PORT/p2p/PEER`` → (host, port, peer ID), or ``None``."""
    parts = addr.strip("/").split("/")
    try:
        if len(parts) >= 6 and parts[0] in ("ip4", "ip6", "dns4", "dns6", "dns") and parts[2] == "tcp" and parts[4] == "p2p":
            return parts[1], int(parts[3]), parts[5]
    except ValueError:
        return None
    return None


def _check_bootstrap(spec: RunSpec, run_id: str, coord: dict[str, Any] | None, timeout_s: float, budget: Budget) -> list[Check]:
    if not spec.network.bootstrap:
        return [Check("bootstrap", "WARN", "the run spec lists no bootstrap peer", "pass --bootstrap MULTIADDR to join (ask the coordinator for one)")]
    addrs = spec.network.bootstrap[:8]
    deadline = budget.cap(timeout_s)

    def probe(addr: str) -> Check:
        parsed = _parse_multiaddr(addr)
        name = f"bootstrap {addr if len(addr) <= 120 else addr[:119] + '…'}"
        if parsed is None:
            return Check(name, "FAIL", "not a /ip4|dns/HOST/tcp/PORT/p2p/PEER multiaddr", "ask the coordinator for a spec with a valid bootstrap address")
        host, port, peer = parsed
        if deadline <= 0:
            return Check(name, "WARN", "not checked: doctor's time budget was spent on the checks above", "fix the slow checks above first")
        try:
            libp2p = speaks_libp2p(host, port, deadline)
        except OSError as e:
            return Check(name, "FAIL", f"unreachable: {_why(e)}", "the peer is down or blocked: pass --bootstrap with a live peer, or check the firewall")
        if not libp2p:
            return Check(name, "FAIL", f"{host}:{port} accepts connections but does not speak libp2p",
                         "the address points at another service: ask the coordinator for the current bootstrap address")
        if peer == spec.run.coordinator and coord is not None and coord.get("peer_id") not in (None, peer):
            return Check(name, "FAIL", f"the coordinator's HTTP says peer {str(coord.get('peer_id'))[:64]}, the address says {peer}",
                         "get the current run spec from the coordinator")
        if peer == spec.run.coordinator and coord is not None:
            return Check(name, "PASS", f"libp2p; the run's coordinator (run {run_id[:16]}… confirmed by its ingest)")
        return Check(name, "PASS", "libp2p answers; its run is verified by signatures when gossip joins")

    with ThreadPoolExecutor(max_workers=len(addrs)) as pool:
        return list(pool.map(probe, addrs))


def _with_address(spec: RunSpec, address: Any) -> RunSpec:
    """``spec`` with the address's HTTP locations added to its ingest and origin URLs and its multiaddrs
    to its bootstrap peers (for reading only: the copy's content, hence its run ID, is not the run's)."""
    if address is None:
        return spec
    net = spec.network
    ingest = list(dict.fromkeys([*address.http_urls, *net.ingest_urls]))[:16]
    origins = list(dict.fromkeys([*net.origin_urls, *address.http_urls]))[:16]
    boot = list(dict.fromkeys([*net.bootstrap, *address.bootstrap]))[:64]
    return spec.model_copy(update={"network": net.model_copy(update={"ingest_urls": ingest, "origin_urls": origins, "bootstrap": boot})})


def _check_gossip(spec: RunSpec, wait_s: float, listen_host: str, budget: Budget, *, bootstrap: list[str] | None = None) -> Check:
    """Join the run's topics as a silent observer through the bootstrap peers and wait for the coordinator's heartbeat.

    A record is delivered only after its signature and run ID verify, so hearing the coordinator
    proves that the bootstrap peers relay *this* run's gossip.
    """
    try:
        from node.p2p import GossipConfig, GossipNode
        from protocol.identity import NodeKey
    except ImportError as e:
        return Check("gossip", "WARN", f"libp2p cannot be imported here: {e}", "reinstall intellect-node (pip install -e .)")

    async def listen() -> tuple[int, bool, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        node = await GossipNode.create(spec, NodeKey.generate(), GossipConfig(listen_host=listen_host, publish_records=False,
                                                                              bootstrap=bootstrap or []), role="observer")
        try:
            while loop.time() - t0 < wait_s and node.peers.coordinator() is None:
                await asyncio.sleep(0.05)
            return len(node.peers), node.peers.coordinator() is not None, loop.time() - t0
        finally:
            await node.stop()

    if budget.left() <= 1.0:
        return Check("gossip", "WARN", "not checked: doctor's time budget was spent on the checks above", "fix the slow checks above first")
    wait_s = min(wait_s, budget.left() - 1.0)
    try:
        peers, coordinator, took = asyncio.run(asyncio.wait_for(listen(), max(1.0, budget.left())))
    except Exception as e:  # noqa: BLE001 - any failure to join is the finding
        return Check("gossip", "FAIL", f"could not join the run's gossip: {str(e)[:200] or type(e).__name__}",
                     "check that the bootstrap peers are reachable on TCP and that --listen-host is a local address")
    if coordinator:
        return Check("gossip", "PASS", f"heard the coordinator's signed heartbeat for this run in {took:.1f} s ({peers} live peers)")
    if peers:
        return Check("gossip", "WARN", f"{peers} peers of this run heard in {wait_s:g} s, but not the coordinator",
                     "the coordinator may be down or not connected to these peers; retry with a longer --gossip-wait")
    return Check("gossip", "FAIL", f"no peer of this run heard within {wait_s:g} s through the bootstrap peers",
                 "no bootstrap peer answered with this run's records (down, blocked, or another run): check the bootstrap checks above, "
                 "get the current spec or other bootstrap peers")


def _check_origins(spec: RunSpec, run_id: str, timeout_s: float, budget: Budget) -> list[Check]:
    urls = spec.network.origin_urls[:4]
    out = [_shardcast_check(f"origin {u}", got, run_id) for u, got in zip(urls, _get_many([_held_url(u) for u in urls], timeout_s, budget))]
    if not urls:
        out.append(Check("origin", "WARN", "the run spec lists no origin URL", "checkpoints will come only from relays heard on gossip"))
    return out


def _held_url(url: str) -> str:
    return f"{url.rstrip('/')}/shardcast/1/held"


def _shardcast_check(name: str, got: tuple[dict[str, Any], float | None] | BaseException, run_id: str) -> Check:
    """The check of one Shardcast server's ``/held`` answer (or of the failure that ended the request)."""
    if isinstance(got, BaseException):
        return Check(name, "FAIL", f"{_failure(got)}: {_why(got)}", "check the address and that the server is up (firewall, NAT)")
    doc = got[0]
    if doc.get("run_id") != run_id:
        return Check(name, "FAIL", f"serves run {str(doc.get('run_id'))[:16]}…, not this run {run_id[:16]}…",
                     "this server belongs to another run: get the current run spec")
    held = doc.get("held_steps")
    return Check(name, "PASS", f"this run; holds steps {held[-4:] if isinstance(held, list) else []}")


def _check_relays(spec: RunSpec, run_id: str, timeout_s: float, budget: Budget) -> Check:
    """Relays the coordinator's run page lists (from gossip heartbeats, which anyone can sign) serve this
    run; all are asked at once, each answer bounded (a hostile relay is one FAIL among them)."""
    nodes: list[dict[str, Any]] = []
    answered = False
    for url in spec.network.ingest_urls[:4]:
        try:
            doc, _ = _get(f"{url.rstrip('/')}/api/run", timeout_s, budget)
        except (OSError, ValueError):
            continue
        answered = True
        listed = doc.get("nodes")
        nodes = [n for n in listed if isinstance(n, dict)] if isinstance(listed, list) else []
        break
    if not answered:
        return Check("relays", "WARN", "the coordinator's run page did not answer, so its relay list is unknown",
                     "see the ingest check above; checkpoints come from the origin until relays appear on gossip")
    relays = [str(n["http_url"])[:200] for n in nodes
              if n.get("role") == "relay" and n.get("state") == "alive" and isinstance(n.get("http_url"), str) and n["http_url"]][:MAX_RELAYS]
    if not relays:
        return Check("relays", "WARN", "the coordinator lists no live relay yet", "checkpoints come from the origin until relays appear on gossip")
    bad = []
    for url, got in zip(relays, _get_many([_held_url(u) for u in relays], timeout_s, budget)):
        c = _shardcast_check("relay", got, run_id)
        if c.status != "PASS":
            bad.append(f"{url} ({c.detail})")
    if len(bad) == len(relays):
        return Check("relays", "FAIL", f"none of {len(relays)} relays usable: {'; '.join(bad)[:600]}",
                     "relays advertise addresses this machine cannot reach, or answer too slowly or wrongly: check the network "
                     "path, or fetch from the origin (the node itself scores and skips such relays)")
    if bad:
        return Check("relays", "WARN", f"{len(relays) - len(bad)} of {len(relays)} usable; not: {'; '.join(bad)[:600]}",
                     "unusable relays are skipped; nothing to do unless all fail")
    return Check("relays", "PASS", f"{len(relays)} reachable, serving this run")


def _check_clock(offset: float | None) -> Check:
    fix = "synchronise the clock (timedatectl set-ntp true, or chrony/ntpd)"
    if offset is None:
        return Check("clock offset", "WARN", "not measured (no coordinator answered with a Date header)", "fix the ingest check first")
    a = abs(offset)
    if a <= CLOCK_PASS_S:
        return Check("clock offset", "PASS", f"{offset:+.1f} s vs the coordinator (±1 s resolution)")
    if a <= CLOCK_FAIL_S:
        return Check("clock offset", "WARN", f"{offset:+.1f} s vs the coordinator", fix)
    return Check("clock offset", "FAIL", f"{offset:+.1f} s vs the coordinator: signed messages older than 60 s are refused", fix)


# --- this machine ------------------------------------------------------------------------------


def estimate_model_bytes(spec: RunSpec) -> int | None:
    """Bytes of the policy's weights: the base directory's safetensors, or the embedded Qwen2's shape.

    Returns:
        ``None`` when the base is a directory this machine does not have.
    """
    if spec.model.base != "embedded":
        base = Path(spec.model.base)
        files = list(base.glob("*.safetensors")) if base.is_dir() else []
        return sum(f.stat().st_size for f in files) if files else None
    from node.commands.doctor_fit import run_shape

    shape = run_shape(spec, Path("."))  # the embedded base's shape (its shipped config.json at this hidden size)
    assert shape is not None
    params = shape.parameters()
    return params * (2 if spec.model.dtype == "bfloat16" else 4)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB" if n < (1 << 30) else f"{n / (1 << 30):,.1f} GiB"


def _check_disk(data_dir: Path, model_bytes: int | None, keep_steps: int) -> Check:
    probe = data_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if model_bytes is None:
        return Check("free disk", "WARN", f"{_mib(free)} free at {probe}; model size unknown (base is not on this machine)",
                     "make sure there is room for keep_steps + 2 checkpoints")
    need = (keep_steps + 2) * model_bytes  # kept steps, the one being fetched, the assembled copy
    detail = f"{_mib(free)} free at {probe}; {keep_steps} kept steps + 2 need {_mib(need)}"
    if free < need:
        return Check("free disk", "FAIL", detail, "free space or pass --data-dir on a larger disk")
    if free < 2 * need:
        return Check("free disk", "WARN", detail, "little headroom: free space or use a larger disk")
    return Check("free disk", "PASS", detail)


def _check_memory(model_bytes: int | None, role: str) -> Check:
    import psutil

    avail = psutil.virtual_memory().available
    if role == "relay":
        return Check("memory", "PASS", f"{_mib(avail)} available; relays stream pieces and hold no model")
    if model_bytes is None:
        return Check("memory", "WARN", f"{_mib(avail)} available; model size unknown", "check the model's size against available memory")
    factor = TRAINER_MEMORY_FACTOR if role == "coordinator" else MEMORY_FACTOR
    need = factor * model_bytes
    detail = f"{_mib(avail)} available; the model needs about {_mib(need)} ({factor}× {_mib(model_bytes)} of weights)"
    if avail < need:
        return Check("memory", "FAIL", detail, "free memory, or run on a machine with more")
    return Check("memory", "PASS", detail)


def _check_gpu(model_bytes: int | None, role: str) -> Check:
    from node.machine import nvidia_smi_gpus

    if role == "relay":
        return Check("GPU memory", "PASS", "relays need no GPU")
    try:
        gpus = nvidia_smi_gpus(LOCAL_RESERVE_S)
    except (OSError, subprocess.SubprocessError) as e:
        return Check("GPU memory", "WARN", f"nvidia-smi failed: {e}", "check the NVIDIA driver (nvidia-smi should list the GPU)")
    if not gpus:
        if shutil.which("nvidia-smi") is None:
            return Check("GPU memory", "PASS", "no CUDA GPU found (nvidia-smi absent): the CPU engine will be used")
        return Check("GPU memory", "WARN", "nvidia-smi lists no GPU", "check the NVIDIA driver")
    best = max(gpus, key=lambda g: g[1])
    detail = f"{len(gpus)} GPU(s); most free: {best[0]} {_mib(best[1])} of {_mib(best[2])}"
    if model_bytes is not None and best[1] < MEMORY_FACTOR * model_bytes:
        return Check("GPU memory", "WARN", f"{detail}; the model needs about {_mib(MEMORY_FACTOR * model_bytes)}",
                     "use --device cpu, or free GPU memory")
    return Check("GPU memory", "PASS", detail)


def _check_sandbox(tasks: str, role: str) -> Check:
    if role == "relay":
        return Check("code sandbox", "PASS", "relays compute no rewards")
    from protocol.rewards.sandbox import sandbox_status  # the probe the code-reward sandbox itself uses

    ok, msg = sandbox_status()
    if ok:
        return Check("code sandbox", "PASS", msg)
    needs_code = tasks not in MATH_TASK_SETS
    return Check("code sandbox", "FAIL" if needs_code else "WARN",
                 f"{msg}" + ("" if needs_code else f" (task set {tasks} has no code tasks)"),
                 "apt-get install bubblewrap (and allow unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1)")


def _check_environment(spec: RunSpec) -> Check:
    """The run's environment is installed here and hashes to the spec's ``env.hash`` (files and versions only: nothing runs)."""
    from protocol.envs import EnvError, environment_source, parse_env_ref

    try:
        source = environment_source(parse_env_ref(spec.env.name))
    except EnvError as e:
        return Check("environment", "FAIL", str(e)[:300], "install what the error names, the same versions as the coordinator's")
    if source.hash != spec.env.hash:
        return Check("environment", "FAIL", f"{spec.env.name} hashes to {source.hash} here, the spec pins {spec.env.hash}",
                     "install the same environment files and package versions as the coordinator (pip install the versions it names)")
    return Check("environment", "PASS", f"{spec.env.name}: {len(source.files)} files and {len(source.packages)} package versions "
                                        f"hash to {source.hash[:16]}…, as the spec pins")


def _check_port(host: str, port: int, what: str, flag: str) -> Check:
    """Whether ``host:port`` can be bound as the node binds it: with ``SO_REUSEADDR``, as
    ``node/http_server.py`` and py-libp2p's TCP listener do. Without it a port whose last server
    just stopped (its connections in TIME_WAIT) failed here although the node would bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            got = s.getsockname()[1]
    except OSError as e:
        return Check(what, "FAIL", f"cannot bind {host}:{port}: {e.strerror}", f"pick a free port with {flag}, or stop what uses it")
    return Check(what, "PASS", f"{host}:{port} bindable" if port else f"{host}: any free port (e.g. {got})")
