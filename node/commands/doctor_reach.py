"""``doctor --role relay``'s reachability check: the coordinator dials this machine back at the
relay's HTTP (Shardcast) and libp2p ports (``node/reach.py``) and the fix is printed when it fails.

Before the relay runs nothing listens on its ports, so doctor listens there itself for the
check: a minimal Shardcast ``/held`` answer (this run's ID) on the HTTP port and the multistream
greeting on the libp2p port, bound to the interface the relay will use (``--host``). A port that
is already taken is taken by the running relay, presumably: then the real service is dialed.
Port 0 (the relay's default: any free port) is checked on a free port doctor picks; a failure
there says to choose a fixed port and open it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from aiohttp import web

from node.reach import MULTISTREAM, request_dialback
from protocol.shardcast import ROUTE_PREFIX

if TYPE_CHECKING:
    from node.commands.doctor import Check

SERVICES = (("shardcast", "HTTP (Shardcast) port", "--http-port"), ("libp2p", "libp2p port", "--p2p-port"))


def _free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.asynccontextmanager
async def stand_in(service: str, host: str, port: int, run_id: bytes) -> AsyncIterator[int]:
    """Listen on ``host:port`` (0: any free port) as the relay's service would answer a dial-back;
    yields the bound port."""
    if service == "shardcast":
        body = json.dumps({"run_id": run_id.hex(), "peer_id": "", "held_steps": [], "steps": [], "latest": None, "deltas": []})

        async def held(request: web.Request) -> web.Response:
            return web.Response(text=body, content_type="application/json")

        app = web.Application()
        app.router.add_get(f"{ROUTE_PREFIX}/held", held)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        try:
            yield int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        finally:
            await runner.cleanup()
        return

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.read(64), 2.0)
            writer.write(bytes([len(MULTISTREAM)]) + MULTISTREAM)
            await writer.drain()
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(greet, host, port)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


def _fix(service: str, flag: str, host: str, port: int, observed: str, fixed_port: bool, public_url: str) -> str:
    if host.startswith("127.") or host in ("::1", "localhost"):
        listen = "--host 0.0.0.0" if service == "shardcast" else "--listen-host 0.0.0.0"
        return f"the relay would listen on {host} only: pass {listen} so that others can connect (then run doctor again)"
    steps = [f"open TCP port {port} to this machine in its firewall (e.g. ufw allow {port}/tcp)",
             f"behind a router or NAT, forward TCP {port} on {observed} to this machine"]
    if not fixed_port:
        steps.insert(0, f"choose a fixed port with {flag} (port {port} was tried)")
    if service == "shardcast" and not public_url:
        steps.append(f"announce it with --public-url http://{observed}:{port}")
    return "; ".join(steps)


async def _one(coord_url: str, service: str, what: str, flag: str, host: str, port: int, run_id: bytes,
               public_url: str) -> Check:
    from node.commands.doctor import Check

    name = f"reachable: {what}"
    if port == 0 or _free(host, port):
        async with stand_in(service, host, port, run_id) as bound:
            answer = await request_dialback(coord_url, service, bound)
        tested = bound
    else:  # taken: the relay runs there already, presumably
        answer = await request_dialback(coord_url, service, port)
        tested = port
    where = f"{answer['address']}:{tested}"
    if not answer["reachable"]:
        return Check(name, "FAIL", f"the coordinator cannot reach {where}: {answer['detail']}",
                     _fix(service, flag, host, tested, answer["address"], port != 0, public_url))
    if port == 0:  # the relay's default; others learn its port from its record, so any port that is reachable serves
        return Check(name, "PASS", f"the coordinator reached {where} (a free port doctor picked: with {flag} fixed, check that one)")
    if service == "shardcast" and public_url:
        announced = urlsplit(public_url)
        host_differs = bool(announced.hostname) and _is_ip(announced.hostname or "") and announced.hostname != answer["address"]
        if host_differs or announced.port not in (None, tested):
            return Check(name, "WARN", f"the coordinator reached {where}, but --public-url announces {public_url}",
                         f"announce what others can dial: --public-url http://{answer['address']}:{tested}")
    return Check(name, "PASS", f"the coordinator reached {where}: {answer['detail']}")


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def check_reachability(coord_urls: list[str], run_id: bytes, *, host: str, http_port: int, p2p_port: int, public_url: str,
                       timeout_s: float) -> list[Check]:
    """Ask the first coordinator URL that answers to dial this machine back at each relay port.

    Returns:
        One check per port (HTTP/Shardcast, libp2p): PASS reachable, WARN reachable but announced
        wrongly (``--public-url``), FAIL unreachable with the fix (which port, which address).
    """
    from node.commands.doctor import Check

    if not coord_urls:
        return [Check("reachable", "WARN", "no coordinator URL to ask for a dial-back (the spec has no ingest URL)",
                      "join with the run's address, or pass the coordinator's URL in the spec")]

    async def go() -> list[Check]:
        out: list[Check] = []
        for service, what, flag in SERVICES:
            port = http_port if service == "shardcast" else p2p_port
            errors: list[str] = []
            for url in coord_urls[:3]:
                try:
                    out.append(await asyncio.wait_for(_one(url, service, what, flag, host, port, run_id, public_url), timeout_s + 10.0))
                    break
                except (OSError, TimeoutError) as e:
                    errors.append(str(e) or type(e).__name__)
            else:
                out.append(Check(f"reachable: {what}", "WARN", f"no coordinator answered the dial-back request: {'; '.join(errors)[:300]}",
                                 "check the ingest line above; an older coordinator has no dial-back route"))
        return out

    return asyncio.run(go())
