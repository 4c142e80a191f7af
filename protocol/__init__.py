"""Pure protocol layer of intellect-node: everything two nodes must agree on, byte for byte.

No sockets, no event loop, no paths of its own. What lives where:

* ``identity``  — ed25519 :class:`NodeKey`, libp2p peer IDs.
* ``encoding``  — canonical msgpack; ``envelope`` — signed envelopes (:func:`seal`, :func:`open_envelope`).
* ``messages``  — typed message bodies; ``runspec`` — the signed run spec (:class:`RunSpec`).
* ``content``   — content IDs (SHA-256).
* ``shardcast``, ``delta`` — checkpoint pieces and manifests; step deltas (byte format, encoder, streaming applier).
* ``toploc``, ``sampling`` — inference proofs and replayable sampling.
* ``tasks``, ``rewards`` — task schema, derivation and the one reward implementation.
"""

from protocol.content import content_id
from protocol.envelope import Envelope, open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey, PeerId
from protocol.runspec import RunSpec, load_run_spec

__all__ = ["Envelope", "NodeKey", "PeerId", "ProtocolError", "RunSpec", "content_id", "load_run_spec", "open_envelope", "seal"]
