"""The run's own HTTP routes, defined once: the signed spec and the reachability dial-back (pure;
``docs/protocol.md`` §7.2, §8.2).

The coordinator serves every route here on its HTTP port; a relay serves :data:`SPEC_ROUTE` too
(its Shardcast port), so a newcomer can fetch the spec from any location of a run address
(:mod:`protocol.address`). The client side is ``node/bootstrap.py`` (spec) and ``node/reach.py``
(dial-back).
"""

from __future__ import annotations

from typing import Final, Literal

PREFIX: Final = "/run/1"
"""Versioned prefix of the run's routes."""
SPEC_ROUTE: Final = f"{PREFIX}/spec"
"""``GET``: the signed run spec as TOML (``protocol.runspec.dump_run_spec``), at most
``protocol.runspec.MAX_SPEC_BYTES``; ``Content-Type: application/toml``. Anyone may serve it:
the reader verifies the coordinator's signature and the address's peer ID."""
SPEC_CONTENT_TYPE: Final = "application/toml"

ReachService = Literal["shardcast", "libp2p"]
REACH_SERVICES: Final[tuple[ReachService, ...]] = ("shardcast", "libp2p")
"""What a dial-back checks: ``shardcast`` — an HTTP ``GET /shardcast/1/held`` answered with this
run's ID (a relay's port); ``libp2p`` — the multistream-select greeting of a libp2p TCP port."""
REACH_ROUTE: Final = f"{PREFIX}/reach/{{service}}/{{port}}"
"""``POST`` (no body): dial the requester's own observed IP at ``port`` and check ``service``
there; 200 JSON with the fields :data:`REACH_ANSWER_KEYS`. Refused with 429 (``Retry-After``) over the
per-address rate, 400 for an unknown service or a port outside 1…65535."""


def reach_path(service: str, port: int) -> str:
    """The path of a dial-back request."""
    return REACH_ROUTE.format(service=service, port=int(port))


REACH_ANSWER_KEYS: Final = ("reachable", "address", "port", "service", "detail", "seconds")
"""The dial-back answer's JSON fields: ``reachable`` (bool), ``address`` (the requester's IP as the
coordinator saw it), ``port``, ``service``, ``detail`` (what was seen, one line), ``seconds``
(how long the dial-back took)."""
REACH_ANSWER_MAX_BYTES: Final = 4096
"""Largest dial-back answer a client reads, bytes."""
