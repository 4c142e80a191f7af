"""Join a run from its address: fetch and verify the signed spec, fetch the artifacts it pins, keep
both under the node's own folder (``docs/operators.md`` §0, ``docs/protocol.md`` §7.2).

:func:`open_run` is what ``join``, ``validate``, ``doctor`` and ``status`` call with their ``RUN``
argument, either a run address (``intellect1:…``, :mod:`protocol.address`) or the path of a
``run.toml`` (the old form, unchanged). From an address:

1. the spec is asked of every HTTP location of the address at once (:data:`protocol.run_api.SPEC_ROUTE`,
   at most :data:`protocol.runspec.MAX_SPEC_BYTES` read, :data:`SPEC_FETCH_TIMEOUT_S` for the whole
   request); the first answer whose signature verifies, whose coordinator is the address's peer ID
   and whose run ID starts with the address's run-ID prefix is taken;
2. the artifacts the caller needs (the ``tasks`` list, for workers and validators without task
   files) are fetched over Shardcast from the address's locations and the spec's origins, each
   checked against the ID the spec pins, every piece against its ID (:func:`node.shardcast.client.fetch_artifact`);
3. only then is anything written: ``<data dir>/runs/<run ID hex>/run.toml`` (the verified spec,
   written from its parsed content) and ``…/artifacts/<name>-<ID prefix>/`` (the artifact's files).

A refusal — a malformed address, a spec that does not verify or is not the address's, an artifact
whose bytes are not the pinned ones — is one line (:class:`JoinError`), and leaves the node's folder
as it was: downloads go to a staging folder that is removed on failure. A node that restarts and
cannot reach any location uses the spec it stored for that address's run (a run ID names one spec).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from node.errors import FetchError, NodeError
from node.http_read import BodyTooLarge, read_body
from node.retry import Backoff, first_success
from node.shardcast.client import ARTIFACT_FILE_NAME
from protocol.address import RunAddress, looks_like_address, parse_run_address
from protocol.durable import atomic_write
from protocol.errors import ProtocolError, RunSpecError
from protocol.run_api import SPEC_ROUTE
from protocol.runspec import MAX_SPEC_BYTES, SignedRunSpec, dump_run_spec, load_run_spec, parse_run_spec

logger = logging.getLogger(__name__)

SPEC_FETCH_TIMEOUT_S = 10.0
"""Whole-request deadline of one spec request (connect, head and body), seconds."""
ARTIFACT_FETCH_DEADLINE_S = 1800.0
"""Longest time an artifact download may take, seconds."""
RUNS_DIR = "runs"
"""Folder of a node's data dir holding one folder per run joined from an address."""
SPEC_FILE = "run.toml"


class JoinError(NodeError):
    """Joining from an address failed; the message is one line naming what was wrong."""


class LocationsUnavailable(JoinError):
    """No location of the address answered yet (unreachable, or an HTTP error): a coordinator still
    starting, or a network problem. Nothing they answered was refused."""


SPEC_RETRY_MAX_S = 10.0
"""While waiting for an address's locations to answer, the pause between attempts grows to this, seconds."""


@dataclass
class JoinedRun:
    """A run as a node opened it (:func:`open_run`).

    Attributes:
        signed: the verified run spec.
        spec_path: where the spec is on disk (the ``run.toml`` given, or the one stored from an address).
        address: the address it came from (``None``: a ``run.toml``).
        artifacts: artifact name → folder of its fetched files.
        bootstrap: libp2p bootstrap peers the address adds to the spec's.
        http_urls: the address's HTTP locations (``[]`` for a ``run.toml``).
    """

    signed: SignedRunSpec
    spec_path: Path
    address: RunAddress | None = None
    artifacts: dict[str, Path] = field(default_factory=dict)
    bootstrap: list[str] = field(default_factory=list)
    http_urls: list[str] = field(default_factory=list)


def run_folder(data_dir: Path, run_id: bytes) -> Path:
    """The folder of a run joined from an address: ``<data dir>/runs/<run ID hex>``."""
    return Path(data_dir) / RUNS_DIR / run_id.hex()


def artifact_folder(root: Path, name: str, artifact_id: bytes) -> Path:
    """Where artifact ``name`` with ID ``artifact_id`` is kept under a run folder ``root``."""
    return Path(root) / "artifacts" / f"{name}-{artifact_id.hex()[:16]}"


async def fetch_spec(address: RunAddress, *, timeout_s: float = SPEC_FETCH_TIMEOUT_S) -> tuple[SignedRunSpec, str]:
    """Ask every HTTP location of ``address`` for the run spec at once; return the first that is the
    address's run, and the URL that served it.

    Raises:
        LocationsUnavailable: no location answered (each unreachable or an HTTP error).
        JoinError: the address has no HTTP location, or no location served the address's run (one
            line listing each location's reason: unreachable, oversized, not a valid signed spec,
            another coordinator, another run).
    """
    if not address.http_urls:
        raise JoinError("the address names no HTTP location to fetch the run spec from (add the coordinator's or a relay's http:// URL)")
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(5.0, timeout_s))
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        won, failed = await first_success({url: _spec_from(session, url, address) for url in address.http_urls}, (JoinError,))
    if won is not None:
        return won[1], won[0]
    problems = [e for _, e in failed]
    kind = LocationsUnavailable if all(isinstance(p, LocationsUnavailable) for p in problems) else JoinError
    raise kind("no location of the address served its run spec: " + "; ".join(map(str, problems)))


async def _spec_from(session: aiohttp.ClientSession, base: str, address: RunAddress) -> SignedRunSpec:
    url = f"{base}{SPEC_ROUTE}"
    try:
        async with session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise LocationsUnavailable(f"{base}: answered HTTP {resp.status}")
            try:
                data = await read_body(resp, MAX_SPEC_BYTES)
            except BodyTooLarge as e:
                raise JoinError(f"{base}: the run spec is too large: {e}") from None
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise LocationsUnavailable(f"{base}: unreachable ({type(e).__name__}{': ' + str(e)[:120] if str(e) else ''})") from None
    try:
        signed = await asyncio.to_thread(parse_run_spec, data.decode("utf-8"))  # up to 1 MiB of TOML: off the loop
    except UnicodeDecodeError:
        raise JoinError(f"{base}: the run spec is not UTF-8") from None
    except RunSpecError as e:
        raise JoinError(f"{base}: refused the run spec it served: {str(e)[:200]}") from None
    if signed.spec.run.coordinator != address.coordinator:
        raise JoinError(f"{base}: served a run spec of coordinator {signed.spec.run.coordinator}, the address names {address.coordinator}")
    if not address.matches_run(signed.run_id):
        raise JoinError(f"{base}: served run {signed.run_id.hex()[:16]}…, the address names run {address.run_id_prefix[:16]}…")
    return signed


async def _fetch_spec_waiting(address: RunAddress, data_dir: Path, wait_s: float) -> tuple[SignedRunSpec, str]:
    """:func:`fetch_spec`, asked again (1 s, 2 s, … :data:`SPEC_RETRY_MAX_S` apart) while no location
    answers at all, for up to ``wait_s`` seconds; a node that has the run's spec stored does not wait."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    backoff = Backoff(base_s=min(1.0, SPEC_RETRY_MAX_S), max_s=SPEC_RETRY_MAX_S)
    said = False
    while True:
        try:
            return await fetch_spec(address)
        except LocationsUnavailable as e:
            pause = backoff.next_delay()
            if loop.time() + pause > end or stored_spec(data_dir, address) is not None:
                raise
            if not said:
                print(f"waiting up to {wait_s:.0f} s for the run's locations to answer: {str(e)[:300]}", flush=True)
                said = True
            await asyncio.sleep(pause)


def stored_spec(data_dir: Path, address: RunAddress) -> SignedRunSpec | None:
    """The spec stored under ``data_dir`` by an earlier join from an address naming the same
    coordinator (and run-ID prefix): used when no location answers. ``None`` when there is none or
    several match (an address without a run ID, after joining several runs of that coordinator)."""
    found: list[SignedRunSpec] = []
    for path in sorted((Path(data_dir) / RUNS_DIR).glob(f"*/{SPEC_FILE}")):
        try:
            signed = load_run_spec(path)
        except RunSpecError:
            continue
        if signed.spec.run.coordinator == address.coordinator and address.matches_run(signed.run_id):
            found.append(signed)
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A fresh folder beside ``target`` to build its new parts in: on success they are moved into
    ``target`` (merged, folder by folder); on failure the staging folder and every folder this
    created are removed, so nothing is left written."""
    created = [p for p in (target, *target.parents) if not p.exists()]
    staging = target.parent / f".incoming-{target.name}-{time.monotonic_ns()}"
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in created:  # innermost first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    _merge(staging, target)
    shutil.rmtree(staging, ignore_errors=True)


def _merge(src: Path, dest: Path) -> None:
    """Move the contents of ``src`` into ``dest``: folders merged, files replaced (renames)."""
    dest.mkdir(parents=True, exist_ok=True)
    for child in src.iterdir():
        to = dest / child.name
        if child.is_dir() and to.is_dir() and not (child / ARTIFACT_FILE_NAME).exists():  # an artifact folder is replaced whole
            _merge(child, to)
        else:
            if to.is_dir():
                shutil.rmtree(to)
            child.replace(to)


async def fetch_artifacts(signed: SignedRunSpec, names: Sequence[str], root: Path, sources: Sequence[str],
                          origins: Sequence[str]) -> dict[str, Path]:
    """Fetch the pinned artifacts ``names`` into ``root/artifacts/`` (those the spec does not pin are
    skipped; ones already held are not fetched again).

    Returns:
        Artifact name → folder of its files.

    Raises:
        JoinError: no source, or an artifact that could not be fetched with every piece verified.
    """
    from node.shardcast.client import fetch_artifact
    from node.shardcast.download import DownloadConfig

    wanted = [(n, aid) for n in names if (aid := signed.spec.artifact_id(n)) is not None]
    if not wanted:
        return {}
    urls = list(dict.fromkeys(u.rstrip("/") for u in [*sources, *origins]))
    if not urls:
        raise JoinError("the run spec pins artifacts but names no origin URL to fetch them from; join with the run's address")
    cfg = DownloadConfig(stall_timeout_s=60.0, deadline_s=ARTIFACT_FETCH_DEADLINE_S)
    out: dict[str, Path] = {}
    for name, aid in wanted:
        folder = artifact_folder(root, name, aid)
        try:
            await fetch_artifact(urls, folder, aid, origins=[u.rstrip("/") for u in origins], config=cfg, keep_partial=False)
        except FetchError as e:
            raise JoinError(f"cannot fetch the run's {name} artifact {aid.hex()[:16]}…: {str(e)[:300]}") from None
        out[name] = folder
    return out


def read_run(run: str, data_dir: Path | None = None) -> tuple[SignedRunSpec, RunAddress | None]:
    """The verified spec an address or a ``run.toml`` names, written nowhere (``doctor``, ``status``).
    With ``data_dir``, an address whose locations do not answer falls back on the spec an earlier
    join stored there (:func:`stored_spec`).

    Raises:
        JoinError: as :func:`open_run` (one line).
    """
    if not looks_like_address(run):
        try:
            return load_run_spec(Path(run)), None
        except RunSpecError as e:
            raise JoinError(str(e)) from None
    try:
        address = parse_run_address(run)
    except ProtocolError as e:
        raise JoinError(str(e)) from None
    try:
        return asyncio.run(fetch_spec(address))[0], address
    except JoinError:
        kept = stored_spec(data_dir, address) if data_dir is not None else None
        if kept is None:
            raise
        return kept, address


def open_run(run: str, data_dir: Path, *, artifacts: Sequence[str] = (), wait_s: float = 0.0) -> JoinedRun:
    """Open the run a command names: a run address or a ``run.toml`` path (module docstring).

    Args:
        run: the command's ``RUN`` argument.
        data_dir: the node's data dir (spec and artifacts of an address are kept under it).
        artifacts: the artifacts this node needs (e.g. ``("tasks",)``); fetched when the spec pins them.
        wait_s: while no location of an address answers at all (a coordinator still starting), keep
            asking for up to this many seconds (a refusal ends the wait at once).

    Returns:
        The :class:`JoinedRun`.

    Raises:
        JoinError: a malformed address, no verified spec of the address's run, a bad ``run.toml``,
            or an artifact that could not be fetched (one line each; nothing written).
    """
    if looks_like_address(run):
        return asyncio.run(_open_address(run, Path(data_dir), artifacts, wait_s))
    try:
        signed = load_run_spec(Path(run))
    except RunSpecError as e:
        raise JoinError(str(e)) from None
    held = asyncio.run(_hold(signed, artifacts, Path(data_dir), [], signed.spec.network.origin_urls, store_spec=False))
    return JoinedRun(signed, Path(run), artifacts=held)


async def _open_address(text: str, data_dir: Path, artifacts: Sequence[str], wait_s: float = 0.0) -> JoinedRun:
    try:
        address = parse_run_address(text)
    except ProtocolError as e:
        raise JoinError(str(e)) from None
    try:
        signed, served_by = await _fetch_spec_waiting(address, data_dir, wait_s)
        logger.info("run spec %s… from %s", signed.run_id.hex()[:16], served_by)
    except JoinError as e:
        kept = stored_spec(data_dir, address)
        if kept is None:
            raise
        logger.warning("no location of the address answered (%s); using the spec stored for run %s…", e, kept.run_id.hex()[:16])
        signed = kept
    held = await _hold(signed, artifacts, data_dir, address.http_urls, signed.spec.network.origin_urls, store_spec=True)
    return JoinedRun(signed, run_folder(data_dir, signed.run_id) / SPEC_FILE, address, held, list(address.bootstrap),
                     list(address.http_urls))


async def _hold(signed: SignedRunSpec, names: Sequence[str], data_dir: Path, sources: Sequence[str], origins: Sequence[str], *,
                store_spec: bool) -> dict[str, Path]:
    """Make sure the run folder holds the artifacts ``names`` the spec pins (and, with ``store_spec``,
    the spec): what is missing is fetched into a staging folder and moved in only when all of it
    arrived verified. Returns artifact name → folder."""
    from node.shardcast.client import held_artifact

    root = run_folder(data_dir, signed.run_id)
    pinned = {n: aid for n in names if (aid := signed.spec.artifact_id(n)) is not None}
    missing = [n for n, aid in pinned.items() if await asyncio.to_thread(held_artifact, artifact_folder(root, n, aid), aid) is None]
    write_spec = store_spec and not (root / SPEC_FILE).is_file()
    if missing or write_spec:
        with _staged(root) as staging:
            await fetch_artifacts(signed, missing, staging, sources, origins)
            if write_spec:
                atomic_write(staging / SPEC_FILE, dump_run_spec(signed).encode())
    return {n: artifact_folder(root, n, aid) for n, aid in pinned.items()}
