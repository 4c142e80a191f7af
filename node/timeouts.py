"""A node's download and ingest timeouts, seconds: each one named once, with why it is what it is.

Import-light (no imports): the CLI reads them for its defaults and help without loading aiohttp.
:class:`node.shardcast.download.DownloadConfig` takes its defaults from here; the roles that
download with other bounds (the policy follower, a relay) name theirs here too, beside the
defaults they depart from.
"""

from __future__ import annotations

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DOWNLOAD_DEADLINE_S",
    "FOLLOWER_DEADLINE_S",
    "FOLLOWER_STALL_TIMEOUT_S",
    "HELD_TIMEOUT_S",
    "INGEST_REQUEST_TIMEOUT_S",
    "MANIFEST_TIMEOUT_S",
    "PIECE_BODY_GRACE_S",
    "READ_TIMEOUT_S",
    "RELAY_STALL_TIMEOUT_S",
    "STALL_TIMEOUT_S",
]

# --- one download (node/shardcast/download.py: DownloadConfig's defaults) --------------------------

CONNECT_TIMEOUT_S = 5.0
"""TCP connect to a Shardcast source (never includes waiting for a pooled connection)."""
READ_TIMEOUT_S = 15.0
"""Longest silence while waiting for or reading a piece response."""
MANIFEST_TIMEOUT_S = 15.0
"""Longest silence on a manifest request."""
HELD_TIMEOUT_S = 3.0
"""Longest silence on a ``/held`` request (a tiny JSON answer)."""
PIECE_BODY_GRACE_S = 5.0
"""A piece's body must arrive within ``size / min_rate_bps`` plus this after its headers."""
STALL_TIMEOUT_S = 60.0
"""A download gives up when for this long no piece arrived and no request delivered at the rate floor."""
DOWNLOAD_DEADLINE_S = 3600.0
"""A download gives up after this long in all (``intellect-node shardcast fetch --timeout``'s default)."""

# --- downloads of a role with other bounds --------------------------------------------------------

FOLLOWER_STALL_TIMEOUT_S = 30.0
"""The policy follower (a worker's or validator's checkpoints, ``node/policy.py``) gives up on a
stalled download sooner than a one-off fetch: it tries again at the next need or announcement, from
sources that may have changed meanwhile."""
FOLLOWER_DEADLINE_S = 600.0
"""The policy follower's bound on one step's download: a step that takes longer is stale soon after."""
RELAY_STALL_TIMEOUT_S = 120.0
"""A relay waits longer for a stalled upstream than a fetch does: it follows upstreams that are
themselves still filling the step (cut-through), whose pieces come in bursts."""

# --- the ingest (node/ingest_client.py) ------------------------------------------------------------

INGEST_REQUEST_TIMEOUT_S = 60.0
"""One request to the coordinator's ingest (a submission or lease answer may be tens of MiB)."""
