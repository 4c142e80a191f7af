"""Protocol layer of intellect-node: everything two nodes must agree on, byte for byte.

Pure where it says so: wire formats, identity, encoding and the math every node must agree on
open no sockets, run no event loop and hold no paths of their own. The few modules that must run
identically on every node but read files or start processes say so in their names and first
docstring line. What lives where:

Pure:

* ``identity``  — ed25519 :class:`NodeKey`, libp2p peer IDs (``NodeKey.save``/``load``: a key file the caller names).
* ``encoding``  — canonical msgpack; ``envelope`` — signed envelopes (:func:`seal`, :func:`open_envelope`).
* ``messages``  — typed message bodies; ``runspec`` — the signed run spec (:class:`RunSpec`).
* ``content``   — content IDs (SHA-256).
* ``shardcast``, ``delta`` — checkpoint pieces and manifests; step deltas (byte format, encoder, streaming applier).
* ``toploc``, ``sampling``, ``inference`` — inference proofs, replayable sampling, the shared forward pass.
* ``tasks``     — task schema, dataset hash and task derivation, prompts (``tasks.files`` reads files, below).
* ``rollout``   — the rollout rule (derived tasks, targets, prompts, seeds) and the packed-array codec.
* ``window``    — the async window (which policy steps are fresh for a trainer step).
* ``ingest_api``— the ingest's routes, lease answer and error codes (what a client does with each).
* ``addresses`` — client addresses as per-address limits count them (ingest, HTTP servers, gossip host).
* ``verdicts``  — verdict reasons (cheat vs benign); ``embedded`` — the devnet's generated addition task set.
* ``envs.ref``, ``envs.pin``, ``envs.tasks`` — a run's own environment: its name, its content hash, its tasks.

Read files or start processes (named so):

* ``tasks.files``, ``dataset`` — task files and the public sets under a caller's data root.
* ``models``    — policy models and tokenizers: the one builder, loader and writer of a model directory.
* ``durable``   — the one atomic, durable file write.
* ``step_dirs`` — the one layout of per-step directories (``<root>/step-<N>``: policies, training states, held checkpoints).
* ``rewards``   — the reward functions; ``rewards.sandbox`` and ``rewards.verifier`` start processes.
* ``envs.files`` reads an environment's files; ``envs.sandboxed`` runs its third-party code in the sandbox.
* ``dataset``   — also opens the run's environment (:func:`~protocol.dataset.resolve_run_tasks`).
"""

from protocol.content import content_id
from protocol.envelope import Envelope, open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey, PeerId
from protocol.runspec import RunSpec, load_run_spec

__all__ = ["Envelope", "NodeKey", "PeerId", "ProtocolError", "RunSpec", "content_id", "load_run_spec", "open_envelope", "seal"]
