"""Reachability: a peer of the run dials a node back to tell it whether others can reach it
(``docs/protocol.md`` §8.2; ``intellect-node doctor --role relay``).

**Server** (:class:`DialBack`, mounted on the coordinator's HTTP port): ``POST
/run/1/reach/{service}/{port}`` connects to the requester's own address, as this server saw it
on the request's TCP connection, at ``port``, and checks ``service`` there
(:data:`protocol.run_api.REACH_SERVICES`). It is a security boundary — a public endpoint that
makes this server open connections — so it cannot become a reflector or a port scanner:

* it dials **only the requester's observed IP** (``request.remote``; no host in the request, no
  ``X-Forwarded-For`` or other header believed), so a requester can only probe itself;
* **only the one port** named, for one of two fixed protocols, and reads at most
  :data:`MAX_READ_BYTES` within :data:`DIAL_TIMEOUT_S` (connect, send, read together): a target
  that floods, dribbles or never answers costs one bounded attempt;
* **rate-limited per address** (:data:`RATE_PER_S`, burst :data:`BURST`, counted per
  ``protocol.addresses.address_key``: an IPv6 /64 is one address) and **bounded in all**
  (:data:`MAX_CONCURRENT` dial-backs at once; more are refused with 503, never queued);
* what it sends the target is fixed (a multistream greeting, or ``GET /shardcast/1/held``), and
  what it answers the requester is a fixed phrase, never the target's bytes.

**Client**: :func:`request_dialback` (doctor), and the probes :func:`speaks_libp2p` (also
doctor's bootstrap check) and :func:`serves_shardcast`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web

from node.http_read import BodyTooLarge, read_body
from node.jsonlimits import loads_bounded
from protocol.addresses import address_key
from protocol.ratelimit import RateLimiter
from protocol.run_api import REACH_ANSWER_MAX_BYTES, REACH_ROUTE, REACH_SERVICES, reach_path
from protocol.shardcast import ROUTE_PREFIX

DIAL_TIMEOUT_S = 3.0
"""Whole time of one dial-back (connect, send, read), seconds."""
MAX_READ_BYTES = 64 << 10
"""Most bytes a dial-back reads from its target."""
RATE_PER_S = 0.2
BURST = 4.0
"""Dial-backs per requester address: a burst of 4, then one per 5 s."""
MAX_CONCURRENT = 8
"""Dial-backs running at once on one server; more are answered 503."""
MULTISTREAM = b"/multistream/1.0.0\n"
"""The protocol-select greeting every libp2p TCP connection opens with (a varint length, then this)."""


def speaks_libp2p(host: str, port: int, timeout_s: float) -> bool:
    """Connect and do the first multistream-select exchange (the opening of every libp2p TCP
    connection), all within ``timeout_s`` seconds (a peer dribbling its answer byte by byte cannot
    stretch it); reads at most 64 bytes. Blocking.

    Raises:
        OSError: not reachable (refused, unroutable, no answer to the connect).
    """
    end = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(bytes([len(MULTISTREAM)]) + MULTISTREAM)
        got = b""
        try:
            while len(got) < 1 + len(MULTISTREAM) and (left := end - time.monotonic()) > 0:
                s.settimeout(left)
                chunk = s.recv(64)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass
        return got[1:1 + len(MULTISTREAM)] == MULTISTREAM


async def serves_shardcast(url: str, run_id: bytes, timeout_s: float) -> tuple[bool, str]:
    """``GET url/shardcast/1/held`` within ``timeout_s`` seconds, at most :data:`MAX_READ_BYTES` read,
    no redirects followed. Returns ``(serves this run, one-line finding)``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as s, \
                s.get(f"{url}{ROUTE_PREFIX}/held", allow_redirects=False) as r:
            try:
                body: bytes | None = await read_body(r, MAX_READ_BYTES)
            except BodyTooLarge:
                body = None
            status = r.status
    except TimeoutError:
        return False, f"no answer within {timeout_s:g} s (a firewall dropping the packets, or a silent service)"
    except aiohttp.ClientConnectorError as e:
        return False, f"connection failed ({_errno_phrase(e.os_error)})"
    except (aiohttp.ClientError, OSError) as e:
        return False, f"the connection broke ({type(e).__name__})"
    if status != 200 or body is None:
        return False, f"something answers there, but not a Shardcast server (HTTP {status})"
    try:
        got = json.loads(body).get("run_id")
    except (ValueError, AttributeError):
        return False, "something answers there, but not a Shardcast server (no JSON /held)"
    if got != run_id.hex():
        return False, "a Shardcast server answers there, but for another run"
    return True, "answers /shardcast/1/held for this run"


def _errno_phrase(e: OSError | None) -> str:
    import errno

    code = getattr(e, "errno", None)
    return {errno.ECONNREFUSED: "refused: nothing listens on that port for that address", errno.EHOSTUNREACH: "host unreachable",
            errno.ENETUNREACH: "network unreachable", errno.ETIMEDOUT: "timed out"}.get(code or 0, f"errno {code}")


async def probe(service: str, ip: str, port: int, run_id: bytes, timeout_s: float = DIAL_TIMEOUT_S) -> tuple[bool, str]:
    """Dial ``ip:port`` and check ``service`` there (the server's side of a dial-back)."""
    if service == "libp2p":
        try:
            ok = await asyncio.wait_for(asyncio.to_thread(speaks_libp2p, ip, port, timeout_s), timeout_s + 0.5)
        except TimeoutError:
            return False, f"no answer within {timeout_s:g} s (a firewall dropping the packets, or a silent service)"
        except ConnectionRefusedError:
            return False, "connection failed (refused: nothing listens on that port for that address)"
        except OSError as e:
            return False, f"connection failed ({_errno_phrase(e)})"
        return ok, "speaks libp2p (multistream-select)" if ok else "accepts connections but does not speak libp2p"
    from node.http_server import http_url

    return await serves_shardcast(http_url(ip, port), run_id, timeout_s)


class DialBack:
    """The dial-back route of a run's coordinator (module docstring).

    Args:
        run_id: the run's ID (a Shardcast target must serve this run).
        timeout_s: whole time of one dial-back, seconds.
        rate_per_s, burst: per-address rate of requests.
        max_concurrent: dial-backs at once.
    """

    def __init__(self, run_id: bytes, *, timeout_s: float = DIAL_TIMEOUT_S, rate_per_s: float = RATE_PER_S, burst: float = BURST,
                 max_concurrent: int = MAX_CONCURRENT) -> None:
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.limiter = RateLimiter(rate_per_s, burst)
        self.max_concurrent = max_concurrent
        self.running = 0
        self.dialed = 0

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(REACH_ROUTE, self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        ip = request.remote
        if not ip:
            return web.json_response({"error": "no_address", "detail": "the request came with no IP address to dial back"}, status=400)
        key = address_key(ip)
        if not self.limiter.allow(key):
            after = max(1, int(self.limiter.retry_after_s(key) + 0.999))
            return web.json_response({"error": "rate_limited", "detail": "too many dial-backs from this address; retry later"},
                                     status=429, headers={"Retry-After": str(after)})
        service, port_text = request.match_info["service"], request.match_info["port"]
        if service not in REACH_SERVICES:
            return web.json_response({"error": "bad_service", "detail": f"service must be one of {', '.join(REACH_SERVICES)}"}, status=400)
        if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5 and 0 < int(port_text) <= 65535):
            return web.json_response({"error": "bad_port", "detail": "port must be 1…65535"}, status=400)
        if self.running >= self.max_concurrent:
            return web.json_response({"error": "busy", "detail": "too many dial-backs running; retry later"}, status=503,
                                     headers={"Retry-After": "2"})
        port = int(port_text)
        self.running += 1
        self.dialed += 1
        t0 = time.monotonic()
        try:
            ok, detail = await probe(service, ip, port, self.run_id, self.timeout_s)
        finally:
            self.running -= 1
        return web.json_response({"reachable": ok, "address": ip, "port": port, "service": service, "detail": detail,
                                  "seconds": round(time.monotonic() - t0, 3)})


async def request_dialback(base_url: str, service: str, port: int, *, timeout_s: float = DIAL_TIMEOUT_S + 5.0) -> dict[str, Any]:
    """Ask the server at ``base_url`` to dial this machine back at ``port`` (``service``).

    Returns:
        The answer: ``reachable`` (bool), ``address`` (this machine's IP as the server saw it),
        ``port``, ``service``, ``detail`` (str), ``seconds``.

    Raises:
        OSError: the server cannot be reached, refused the request, or answered malformed (one line).
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as s, s.post(f"{base_url.rstrip('/')}{reach_path(service, port)}",
                                                                      allow_redirects=False) as r:
            try:
                answer: bytes | None = await read_body(r, REACH_ANSWER_MAX_BYTES)
            except BodyTooLarge:
                answer = None
            status = r.status
    except TimeoutError:
        raise OSError(f"{base_url} did not answer the dial-back request within {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise OSError(f"{base_url} cannot be reached ({type(e).__name__})") from None
    try:  # bounded in depth too: 4 KB of '[' would otherwise raise RecursionError out of here
        doc = loads_bounded(answer, max_bytes=REACH_ANSWER_MAX_BYTES, max_depth=4) if answer is not None else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise OSError(f"{base_url} answered the dial-back request with HTTP {status} and no JSON (an older coordinator?)")
    if status != 200:
        raise OSError(f"{base_url} refused the dial-back: {str(doc.get('detail', doc.get('error', status)))[:200]}")
    seconds = doc.get("seconds")
    if (not isinstance(doc.get("reachable"), bool) or not isinstance(doc.get("address"), str) or not isinstance(doc.get("detail"), str)
            or not (seconds is None or (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)))):
        raise OSError(f"{base_url} answered the dial-back with an unexpected shape")
    return {"reachable": doc["reachable"], "address": doc["address"][:64], "port": port, "service": service, "detail": doc["detail"][:300],
            "seconds": seconds}
