"""The run address: one string that names a run and where to reach it (pure; ``docs/protocol.md`` §7.2).

A coordinator prints it at start (``intellect-train``) and ``intellect-node spec address`` prints
it from a spec; a contributor passes it to ``join``, ``validate``, ``doctor`` or ``status`` instead
of a copied ``run.toml``. Grammar (ABNF, RFC 5234)::

    address   = "intellect1:" peer-id [ "/" run-id ] "@" location *( "," location )
    peer-id   = "12D3KooW" 44base58           ; the coordinator: the run's root of trust
    run-id    = 16*64HEXDIG-lowercase          ; a prefix of the run ID (SHA-256 of the spec's content)
    location  = http-url / multiaddr
    http-url  = ( "http://" / "https://" ) host [ ":" port ] [ path ]   ; no user, query or fragment
    multiaddr = "/" ( "ip4" / "ip6" / "dns" / "dns4" / "dns6" ) "/" host "/tcp/" port [ "/p2p/" peer-id ]

At most :data:`MAX_ADDRESS_CHARS` characters and :data:`MAX_LOCATIONS` locations, each at most
:data:`MAX_LOCATION_CHARS` (the run spec's bound on a URL or multiaddr). No whitespace, so the
address is one shell word. A multiaddr without ``/p2p/`` is the coordinator's own libp2p address
(its peer ID is appended); one with another peer ID is a relay or other bootstrap peer.

What the address proves: a node fetches the signed run spec from an HTTP location
(:data:`protocol.run_api.SPEC_ROUTE`) and accepts it only if the spec's coordinator is the
address's ``peer-id`` and its signature verifies; with a ``run-id`` prefix, only the spec of that
run. Only the coordinator key can sign a spec, so the prefix needs to tell apart that coordinator's
own runs, not resist forgery: 16 hex digits (64 bits) are what the coordinator prints. The
locations are hints and are trusted for nothing: a wrong one costs a failed request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from protocol.errors import AddressError
from protocol.identity import PEER_ID_PATTERN, PeerId

SCHEME = "intellect1:"
"""Prefix and version of the address format; a later format gets another number."""
MAX_ADDRESS_CHARS = 4096
MAX_LOCATIONS = 16
MAX_LOCATION_CHARS = 256
"""The run spec's bound on one URL or multiaddr (``NetworkSpec``)."""
PRINTED_RUN_ID_HEX = 16
"""Hex digits of the run ID a coordinator puts in the address it prints (64 bits: see the module docstring)."""

_PEER = PEER_ID_PATTERN
_PEER_RE = re.compile(rf"^{_PEER}$")
_IDENT_RE = re.compile(rf"^(?P<peer>{_PEER})(?:/(?P<run>[0-9a-f]{{16,64}}))?$")
_MULTIADDR_RE = re.compile(rf"^/(?P<proto>ip4|ip6|dns|dns4|dns6)/(?P<host>[^/\s]{{1,253}})/tcp/(?P<port>[0-9]{{1,5}})"
                           rf"(?:/p2p/(?P<peer>{_PEER}))?$")
_HOST_RE = re.compile(r"^[A-Za-z0-9.\-:\[\]]{1,253}$")


@dataclass(frozen=True)
class RunAddress:
    """A parsed run address.

    Attributes:
        coordinator: the coordinator's peer ID (the spec must be signed by this key).
        run_id_prefix: lower-case hex prefix of the run ID (16–64 digits), or ``""`` (any run of this coordinator).
        http_urls: where the spec (and Shardcast artifacts) can be fetched, without trailing slashes.
        bootstrap: libp2p bootstrap multiaddrs, each ending in ``/p2p/<peer ID>``.
    """

    coordinator: PeerId
    run_id_prefix: str
    http_urls: tuple[str, ...]
    bootstrap: tuple[str, ...]

    def matches_run(self, run_id: bytes) -> bool:
        """Whether a run ID (32 bytes) is the one the address names (always, without a prefix)."""
        return run_id.hex().startswith(self.run_id_prefix)

    def __str__(self) -> str:
        return format_run_address(self.coordinator, None, self.http_urls, self.bootstrap, run_id_hex=self.run_id_prefix)


def looks_like_address(text: str) -> bool:
    """Whether a command-line argument is meant as a run address (it starts with :data:`SCHEME`)."""
    return text.startswith(SCHEME)


def parse_run_address(text: str) -> RunAddress:
    """Parse and check a run address (grammar: module docstring).

    Raises:
        AddressError: one line naming what is wrong (prefix, peer ID, run ID, a location, a bound).
    """
    if not isinstance(text, str):
        raise AddressError("a run address is a string")
    if len(text) > MAX_ADDRESS_CHARS:
        raise AddressError(f"run address of {len(text)} characters is over the {MAX_ADDRESS_CHARS}-character limit")
    if not text.startswith(SCHEME):
        raise AddressError(f"a run address starts with {SCHEME!r} (got {text[:24]!r}…)")
    if any(c.isspace() for c in text) or not text.isprintable():
        raise AddressError("a run address has no whitespace or control characters (quote nothing; copy it whole)")
    ident, at, rest = text[len(SCHEME):].partition("@")
    if not at or not rest:
        raise AddressError("a run address is intellect1:PEER_ID[/RUN_ID]@LOCATION[,LOCATION…]: no '@' and location")
    m = _IDENT_RE.match(ident)
    if m is None:
        peer = ident.split("/", 1)[0]
        if not _PEER_RE.match(peer):
            raise AddressError(f"run address: {peer[:60]!r} is not a coordinator peer ID (12D3KooW… and 44 base58 characters)")
        raise AddressError("run address: the run ID after the peer ID must be 16 to 64 lower-case hex digits")
    coordinator = PeerId(m.group("peer"))
    parts = rest.split(",")
    if len(parts) > MAX_LOCATIONS:
        raise AddressError(f"run address names {len(parts)} locations, more than {MAX_LOCATIONS}")
    http: list[str] = []
    boot: list[str] = []
    for loc in parts:
        if not loc:
            raise AddressError("run address has an empty location (two commas in a row, or one at the end)")
        if len(loc) > MAX_LOCATION_CHARS:
            raise AddressError(f"run address location of {len(loc)} characters is over {MAX_LOCATION_CHARS}")
        if loc.startswith("/"):
            boot.append(_multiaddr(loc, coordinator))
        else:
            http.append(_http_url(loc))
    return RunAddress(coordinator, m.group("run") or "", tuple(dict.fromkeys(http)), tuple(dict.fromkeys(boot)))


def _http_url(loc: str) -> str:
    try:
        u = urlsplit(loc)
        port = u.port
    except ValueError as e:
        raise AddressError(f"run address location {loc[:80]!r}: {e}") from None
    if u.scheme not in ("http", "https"):
        raise AddressError(f"run address location {loc[:80]!r} is neither an http(s) URL nor a multiaddr starting with '/'")
    if not u.hostname or not _HOST_RE.match(u.hostname):
        raise AddressError(f"run address location {loc[:80]!r} has no valid host")
    if u.username is not None or u.password is not None or u.query or u.fragment:
        raise AddressError(f"run address location {loc[:80]!r}: no user, query or fragment allowed in a URL")
    if port == 0:
        raise AddressError(f"run address location {loc[:80]!r}: port 0")
    return loc.rstrip("/")


def _multiaddr(loc: str, coordinator: PeerId) -> str:
    m = _MULTIADDR_RE.match(loc)
    if m is None:
        raise AddressError(f"run address location {loc[:80]!r} is not a /ip4|ip6|dns/HOST/tcp/PORT[/p2p/PEER_ID] multiaddr")
    if not 0 < int(m.group("port")) <= 65535:
        raise AddressError(f"run address location {loc[:80]!r}: TCP port out of range")
    return loc if m.group("peer") else f"{loc}/p2p/{coordinator}"


def format_run_address(coordinator: PeerId | str, run_id: bytes | None, http_urls: tuple[str, ...] | list[str],
                       bootstrap: tuple[str, ...] | list[str] = (), *, run_id_hex: str | None = None) -> str:
    """The address of a run, as the coordinator prints it.

    Args:
        coordinator: the coordinator's peer ID.
        run_id: the 32-byte run ID (its first :data:`PRINTED_RUN_ID_HEX` hex digits are printed), or ``None``.
        http_urls: HTTP locations that serve the spec (the coordinator's public URL, relays).
        bootstrap: libp2p multiaddrs; the coordinator's own lose their ``/p2p/<coordinator>`` suffix.
        run_id_hex: print this run ID prefix instead of one taken from ``run_id``.

    Returns:
        The address string; :func:`parse_run_address` reads it back.

    Raises:
        AddressError: no location, or a location :func:`parse_run_address` would refuse.
    """
    prefix = run_id_hex if run_id_hex is not None else (run_id.hex()[:PRINTED_RUN_ID_HEX] if run_id else "")
    own = f"/p2p/{coordinator}"
    locs = [u.rstrip("/") for u in http_urls] + [a.removesuffix(own) for a in bootstrap]
    locs = list(dict.fromkeys(locs))
    if not locs:
        raise AddressError("a run address needs at least one location (an HTTP URL or a multiaddr)")
    text = f"{SCHEME}{coordinator}{'/' + prefix if prefix else ''}@{','.join(locs)}"
    parse_run_address(text)  # what is printed must read back
    return text
