"""Typed message bodies carried in signed envelopes (``docs/protocol.md`` §3).

Each class is one message type: its ``TYPE`` tag (versioned, ``name/1``), the largest envelope
accepted for it (``MAX_BYTES``), who may sign it (``SIGNER``), and a strict schema: exact types
(no coercion, ``bool`` is not an ``int``), bounded lengths and ranges, no extra fields. Every
list stops validating at its first bad element (``fail_fast``): 16,000 empty maps where rollouts
belong cost one error, not 160,000. The decoder limits of each type are derived from these
schemas (:data:`BODY_LIMITS`).

Producers and consumers:

================================ ============ ===========================================
type                              signed by    read by
================================ ============ ===========================================
``node_record/1``                 any node     peer table of every node (gossip heartbeats)
``manifest/1``                    coordinator  relays, workers, validators (Shardcast HTTP)
``checkpoint_announcement/1``     coordinator  relays, workers, validators (gossip)
``delta_manifest/1``              coordinator  relays, workers, validators (Shardcast HTTP)
``submission/1``                  any worker   coordinator ingest, validators (HTTP)
``verdict/1``                     validators   coordinator ingest, workers (HTTP, gossip)
``ban_list/1``                    coordinator  everyone (gossip, HTTP)
``lease_request/1``               validators   coordinator ingest (HTTP)
``worker_standing/1``             coordinator  the worker it describes (HTTP, ``intellect-node status``)
================================ ============ ===========================================
"""

from __future__ import annotations

import itertools
import types
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from protocol.content import CONTENT_ID_BYTES
from protocol.encoding import DecodeLimits
from protocol.identity import PeerId

KiB = 1 << 10
MiB = 1 << 20

U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
Step = Annotated[int, Field(ge=0, le=2**40)]
Count = Annotated[int, Field(ge=0, le=2**40)]
ContentIdBytes = Annotated[bytes, Field(min_length=CONTENT_ID_BYTES, max_length=CONTENT_ID_BYTES)]
PeerIdStr = Annotated[PeerId, StringConstraints(min_length=46, max_length=60, pattern=r"^12D3KooW[1-9A-HJ-NP-Za-km-z]+$")]
ShortStr = Annotated[str, StringConstraints(max_length=256)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

MIN_PIECE_SIZE_BYTES = 64 * KiB
MAX_PIECE_SIZE_BYTES = 1 << 30
DEFAULT_PIECE_SIZE_BYTES = 16 * MiB
"""The run spec's ``shardcast.piece_size_bytes`` unless it states one."""
PieceSizeBytes = Annotated[int, Field(ge=MIN_PIECE_SIZE_BYTES, le=MAX_PIECE_SIZE_BYTES)]
"""A Shardcast piece size, bytes (64 KiB … 1 GiB): the one bound of the run spec's
``shardcast.piece_size_bytes``, a ``manifest/1``'s and a ``delta_manifest/1``'s, and of the piece
rule that cuts files (``protocol.shardcast.build_manifest``)."""

Signer = Literal["coordinator", "validator", "any"]

SUBMISSION_MAX_ROLLOUTS = 1 << 14
"""Most rollouts in one ``submission/1``: a run spec's ``data.tasks_per_submission × rl.group_size`` must fit."""
ROLLOUT_MAX_PROOFS = 1 << 16
"""Most TOPLOC proofs of one rollout: a run spec's ``⌈sampling.max_tokens / toploc.chunk_size⌉`` must fit."""
PROOF_MAX_BYTES = 1024
"""Largest TOPLOC proof in a rollout, bytes: a run spec's ``toploc.topk`` must make proofs that fit
(``protocol.toploc.proof_size_bytes``: 2 + 2k bytes, so k ≤ 511)."""


class Message(BaseModel):
    """Base of all message bodies: strict, frozen, no extra fields."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    TYPE: ClassVar[str]
    MAX_BYTES: ClassVar[int]
    SIGNER: ClassVar[Signer]
    SIGNER_IS_SUBJECT: ClassVar[str | None] = None  # field that must equal the signer's peer ID


class Hardware(Message):
    """What a node reports about its machine (informational, not trusted)."""

    cpu_count: Annotated[int, Field(ge=0, le=1 << 16)]
    memory_bytes: Annotated[int, Field(ge=0, le=1 << 60)]
    accelerator: Annotated[str, StringConstraints(max_length=128)] = ""
    accelerator_count: Annotated[int, Field(ge=0, le=1024)] = 0


Role = Literal["coordinator", "worker", "relay", "validator", "observer"]


HUB_ROLES = ("coordinator", "relay", "validator")
"""Roles that accept workers' presence streams and publish their records on gossip (``docs/gossip.md``)."""


class NodeRecord(Message):
    """Signed self-description of a node (``docs/gossip.md``).

    A hub (coordinator, relay, validator) publishes one every ``heartbeat_interval_s`` on the
    ``nodes`` topic; it is also the hub's *roster digest*: ``workers`` is how many workers are
    attached to it and ``roster`` the content ID of the list of their signed records
    (``protocol.presence``), fetched on demand. A worker sends its record only to the hubs it is
    attached to, over its presence stream. ``seq`` increases with every record of a process;
    receivers keep the highest.
    """

    TYPE: ClassVar[str] = "node_record/1"
    MAX_BYTES: ClassVar[int] = 8 * KiB
    SIGNER: ClassVar[Signer] = "any"
    SIGNER_IS_SUBJECT: ClassVar[str | None] = "peer_id"

    peer_id: PeerIdStr
    role: Role
    seq: Count
    addrs: Annotated[list[ShortStr], Field(max_length=16, fail_fast=True)] = []
    http_url: Annotated[str, StringConstraints(max_length=256)] = ""
    version: Annotated[str, StringConstraints(max_length=64)]
    policy_step: Annotated[int, Field(ge=-1, le=2**40)] = -1
    held_steps: Annotated[list[Step], Field(max_length=64, fail_fast=True)] = []
    hardware: Hardware | None = None
    workers: Annotated[int, Field(ge=0, le=1 << 20)] = 0
    roster: Annotated[bytes, Field(max_length=CONTENT_ID_BYTES)] = b""

    @model_validator(mode="after")
    def _roster_of_a_hub(self) -> NodeRecord:
        if len(self.roster) not in (0, CONTENT_ID_BYTES):
            raise ValueError(f"roster must be empty or a {CONTENT_ID_BYTES}-byte content ID")
        if (self.workers or self.roster) and self.role not in HUB_ROLES:
            raise ValueError(f"a {self.role} has no roster (workers and roster are for {', '.join(HUB_ROLES)})")
        if bool(self.workers) != bool(self.roster):
            raise ValueError("roster is set exactly when workers > 0")
        return self


class ManifestFile(Message):
    """One file of a checkpoint: its name, size and the IDs of its pieces in order."""

    name: Name
    size_bytes: Annotated[int, Field(ge=0, le=1 << 50)]
    pieces: Annotated[list[ContentIdBytes], Field(max_length=1 << 18, fail_fast=True)]


def unique_file_names(files: list[ManifestFile]) -> list[ManifestFile]:
    """``files`` unchanged when no two share a name (a manifest's or an artifact's file list).

    Raises:
        ValueError: a name occurs twice.
    """
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError("file names must be unique")
    return files


class Manifest(Message):
    """The coordinator-signed list of a checkpoint's pieces (Shardcast, ``docs/protocol.md`` §5).

    Piece *i* of a file covers bytes ``[i·piece_size_bytes, min((i+1)·piece_size_bytes, size))``.
    ``checkpoint_hash`` is the SHA-256 of the files' bytes concatenated in list order.
    """

    TYPE: ClassVar[str] = "manifest/1"
    MAX_BYTES: ClassVar[int] = 16 * MiB
    SIGNER: ClassVar[Signer] = "coordinator"

    step: Step
    piece_size_bytes: PieceSizeBytes
    files: Annotated[list[ManifestFile], Field(min_length=1, max_length=1024, fail_fast=True)]
    checkpoint_hash: ContentIdBytes
    meta: Annotated[dict[Name, ShortStr], Field(max_length=32)] = {}

    @field_validator("files")
    @classmethod
    def _unique_names(cls, files: list[ManifestFile]) -> list[ManifestFile]:
        return unique_file_names(files)


class CheckpointAnnouncement(Message):
    """Gossiped news that the coordinator published the manifest with ID ``manifest_id``."""

    TYPE: ClassVar[str] = "checkpoint_announcement/1"
    MAX_BYTES: ClassVar[int] = 4 * KiB
    SIGNER: ClassVar[Signer] = "coordinator"

    step: Step
    manifest_id: ContentIdBytes
    checkpoint_hash: ContentIdBytes
    origin_url: Annotated[str, StringConstraints(max_length=256)] = ""


class DeltaManifest(Message):
    """The coordinator-signed list of the pieces of a step delta (``docs/shardcast.md`` §9).

    The delta turns the checkpoint of ``base_step`` (whose ``manifest/1`` envelope hashes to
    ``base_manifest_id``) into the one of ``step`` (``target_manifest_id``); its bytes are the
    zstd-compressed delta body of :mod:`protocol.delta`, ``size_bytes`` long, cut by the piece
    rule into ``pieces``. ``raw_size_bytes`` is the decompressed body's exact length (a bound for
    the decoder). A node accepts the result of applying it only if the files hash to the pieces
    of the target *full* manifest; ``changed_elements`` / ``total_elements`` (16-bit words) are
    informational.
    """

    TYPE: ClassVar[str] = "delta_manifest/1"
    MAX_BYTES: ClassVar[int] = 16 * MiB
    SIGNER: ClassVar[Signer] = "coordinator"

    step: Step
    base_step: Step
    base_manifest_id: ContentIdBytes
    target_manifest_id: ContentIdBytes
    piece_size_bytes: PieceSizeBytes
    size_bytes: Annotated[int, Field(ge=1, le=1 << 50)]
    raw_size_bytes: Annotated[int, Field(ge=8, le=1 << 52)]
    pieces: Annotated[list[ContentIdBytes], Field(min_length=1, max_length=1 << 18, fail_fast=True)]
    delta_hash: ContentIdBytes
    changed_elements: Count = 0
    total_elements: Count = 0
    meta: Annotated[dict[Name, ShortStr], Field(max_length=32)] = {}


class SubmissionTask(Message):
    """A task a submission answers: its index in the run's dataset and the derived parameters."""

    task_index: Count
    problem_id: ShortStr
    target_length: Annotated[int, Field(ge=0, le=1 << 20)]


class Rollout(Message):
    """One sampled completion. Arrays are little-endian packed: ``*_ids`` uint32, ``logprobs`` float32.

    ``proofs`` holds one 258-byte TOPLOC proof per ``chunk_size`` completion tokens.
    """

    task: Annotated[int, Field(ge=0, le=1 << 16)]
    sample: Annotated[int, Field(ge=0, le=1 << 16)]
    seed: U64
    prompt_ids: Annotated[bytes, Field(max_length=4 << 20)]
    completion_ids: Annotated[bytes, Field(max_length=4 << 20)]
    logprobs: Annotated[bytes, Field(max_length=4 << 20)]
    finish: Literal["eos", "length"]
    task_reward: FiniteFloat
    reward: FiniteFloat
    proofs: Annotated[list[Annotated[bytes, Field(max_length=PROOF_MAX_BYTES)]], Field(max_length=ROLLOUT_MAX_PROOFS, fail_fast=True)]

    @field_validator("prompt_ids", "completion_ids", "logprobs")
    @classmethod
    def _packed_u32(cls, v: bytes) -> bytes:
        if len(v) % 4:
            raise ValueError("packed array length must be a multiple of 4 bytes")
        return v


class Submission(Message):
    """A worker's signed answer to its derived tasks: G rollouts per task (``docs/protocol.md`` §6)."""

    TYPE: ClassVar[str] = "submission/1"
    MAX_BYTES: ClassVar[int] = 32 * MiB
    SIGNER: ClassVar[Signer] = "any"
    SIGNER_IS_SUBJECT: ClassVar[str | None] = "worker"

    worker: PeerIdStr
    policy_step: Step
    counter: Count
    tasks: Annotated[list[SubmissionTask], Field(min_length=1, max_length=1024, fail_fast=True)]
    rollouts: Annotated[list[Rollout], Field(min_length=1, max_length=SUBMISSION_MAX_ROLLOUTS, fail_fast=True)]


VerdictValue = bool | int | FiniteFloat | ShortStr


class ReplayStats(Message):
    """What the model checks of one submission saw, token by token, in counts: the evidence the
    coordinator's per-worker audit accumulates (``docs/toploc.md`` §11, ``protocol.audit``).

    Counts are over every rollout the validator checked in full: ``gap_over[i]`` counts the tokens
    that differ from the validator's replay with a gap beyond ``GAP_EDGE_FRACTIONS[i]`` of the
    replay rule's tolerance (``protocol.sampling.ReplayParams.gap_edges``; the last is the tolerance
    itself: the out-of-bound tokens), so the list is non-increasing and each entry ≤ ``differ``.

    The twin counts (audit rule ``eprocess-v2``, ``docs/toploc.md`` §11.2; 0 under other rules and in
    verdicts signed before they existed): of the ``rollouts`` checked, ``diverged`` hold ≥ 1 token that
    differs from the replay's choice; for ``decided`` of those (at most
    :data:`protocol.audit.TWINS_PER_SUBMISSION`, drawn at random by the validator) it decoded the
    *twin* — the replay's own choice at the first differing position, then its own seeded float32
    decode — and rewarded both: ``up`` where the claimed completion's task reward is higher, ``down``
    where the twin's is. So ``up + down ≤ decided ≤ diverged ≤ min(rollouts, differ)`` and
    ``rollouts ≤ tokens``.
    """

    tokens: Count  # completion tokens replayed
    differ: Count  # of them, claimed ≠ the validator's choice
    gap_over: Annotated[list[Count], Field(max_length=8, fail_fast=True)] = []  # differing with gap > edge i
    impossible: Count = 0  # claimed tokens no logits within any bound pick (gap +inf)
    logprob_over: Count = 0  # tokens whose |reported − recomputed| log-prob exceeds toploc.logprob_max_abs
    chunks: Count = 0  # TOPLOC chunks checked
    chunks_over: Count = 0  # chunks beyond the TOPLOC thresholds
    rollouts: Count = 0  # rollouts replayed (eprocess-v2; 0: not counted)
    diverged: Count = 0  # of them, with ≥ 1 differing token
    decided: Count = 0  # of those, twins decoded and rewarded
    up: Count = 0  # of those, claimed task reward > the twin's
    down: Count = 0  # of those, the twin's task reward > claimed

    @model_validator(mode="after")
    def _consistent(self) -> ReplayStats:
        over = self.gap_over
        if self.differ > self.tokens or self.impossible > self.differ or self.logprob_over > self.tokens or self.chunks_over > self.chunks:
            raise ValueError("replay stats: a count exceeds what it counts within")
        if (self.rollouts > self.tokens or self.diverged > min(self.rollouts, self.differ) or self.decided > self.diverged
                or self.up + self.down > self.decided):
            raise ValueError("replay stats: need up + down ≤ decided ≤ diverged ≤ min(rollouts, differ) and rollouts ≤ tokens")
        if any(a < b for a, b in itertools.pairwise(over)) or (over and over[0] > self.differ):
            raise ValueError("replay stats: gap_over must be non-increasing and ≤ differ")
        return self


class Verdict(Message):
    """A validator's signed judgement of one submission (``reason`` is ``"ok"`` when accepted).

    ``stats`` (when the validator ran the model checks) are the replay statistics of the whole
    submission: on an accepted verdict and on a ``precision`` rejection they are what the
    coordinator's audit counts (``docs/toploc.md`` §11).
    """

    TYPE: ClassVar[str] = "verdict/1"
    MAX_BYTES: ClassVar[int] = 64 * KiB
    SIGNER: ClassVar[Signer] = "validator"

    submission_id: ContentIdBytes
    worker: PeerIdStr
    policy_step: Step
    counter: Count
    accepted: bool
    reason: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]
    evidence: Annotated[dict[Name, VerdictValue], Field(max_length=64)] = {}
    stats: ReplayStats | None = None


class BanEvidence(Message):
    """One independent check that found a submission of the banned worker to be a cheat.

    A ban needs two (``docs/validator.md`` "Ban rule"): the deciding validator verdict and either
    another validator's verdict on the same submission or the coordinator's own re-check.
    """

    by: PeerIdStr  # the validator, or the coordinator for its re-check
    verdict_id: Annotated[bytes, Field(max_length=CONTENT_ID_BYTES)] = b""  # content ID of the verdict envelope; b"" for a re-check
    reason: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]
    detail: Annotated[str, StringConstraints(max_length=200)] = ""  # what was seen (rollout, chunk, numbers)


class BanEntry(Message):
    """One banned worker and why: the submission and the two checks that agree it cheated; or, with
    reason ``audit``, the coordinator's per-worker audit (one evidence entry: the test's figures,
    naming the verdict that completed it; ``docs/toploc.md`` §11)."""

    peer_id: PeerIdStr
    reason: Annotated[str, StringConstraints(max_length=64)]
    since_ms: Annotated[int, Field(ge=0, le=2**63 - 1)]
    verdict_id: Annotated[bytes, Field(max_length=CONTENT_ID_BYTES)] = b""
    submission_id: Annotated[bytes, Field(max_length=CONTENT_ID_BYTES)] = b""
    evidence: Annotated[list[BanEvidence], Field(max_length=2, fail_fast=True)] = []


class BanList(Message):
    """The coordinator's whole ban list; a higher ``version`` replaces a lower one."""

    TYPE: ClassVar[str] = "ban_list/1"
    MAX_BYTES: ClassVar[int] = 4 * MiB
    SIGNER: ClassVar[Signer] = "coordinator"

    version: Count
    # ≤ ~0.9 KiB each with evidence, ~0.2 KiB without: the coordinator drops the oldest entries' evidence to fit MAX_BYTES
    entries: Annotated[list[BanEntry], Field(max_length=1 << 14, fail_fast=True)]


class LeaseRequest(Message):
    """A validator asking the ingest for up to ``limit`` pending submissions, leased for ``lease_s``.

    Signed so that only the run's validators can lease work (a stranger cannot starve them).
    """

    TYPE: ClassVar[str] = "lease_request/1"
    MAX_BYTES: ClassVar[int] = 1 * KiB
    SIGNER: ClassVar[Signer] = "validator"

    limit: Annotated[int, Field(ge=1, le=256)]
    lease_s: Annotated[float, Field(gt=0.0, le=3600.0, allow_inf_nan=False)]


ReasonStr = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]


class WorkerStanding(Message):
    """The coordinator's signed account of one worker's work in the run (``GET /ingest/1/workers/{peer_id}``).

    Counts are of the worker's submissions as the coordinator's ledger holds them: ``pending``
    (stored, not yet judged), ``accepted`` (a validator accepted it), ``rejected`` (by a verdict, or
    unjudged: ``stale_policy`` when it left the async window first, ``banned``), with
    ``rejected_by_reason`` splitting them, ``stale`` (of the rejected, those that went stale: no
    fault of the worker's), ``trained`` (submissions a trainer step trained on) and
    ``rollouts_trained``, ``displaced`` (set aside for a newer worker of a lighter address prefix;
    no verdict). ``place`` is its rank on the run's leaderboard (most accepted, then fewest rejected,
    then peer ID; 1 is first, 0 when it has no submission) among ``workers``. The envelope's
    timestamp says when it was true; ``trainer_step`` the coordinator's step then.
    """

    TYPE: ClassVar[str] = "worker_standing/1"
    MAX_BYTES: ClassVar[int] = 16 * KiB
    SIGNER: ClassVar[Signer] = "coordinator"

    worker: PeerIdStr
    trainer_step: Step
    pending: Count
    accepted: Count
    rejected: Count
    stale: Count
    trained: Count
    rollouts_trained: Count
    displaced: Count
    rejected_by_reason: Annotated[dict[ReasonStr, Count], Field(max_length=64)] = {}
    place: Count
    workers: Count
    banned: bool = False
    ban_reason: Annotated[str, StringConstraints(max_length=64)] = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (NodeRecord, Manifest, CheckpointAnnouncement, DeltaManifest, Submission, Verdict, BanList, LeaseRequest, WorkerStanding)
}
"""Every message type a node accepts, by type tag."""


def _max_len(metadata: list[Any]) -> int | None:
    for m in metadata:
        n = getattr(m, "max_length", None)
        if n is not None:
            return int(n)
    return None


_EXTRA_FIELDS_SLACK = 8  # a few unknown fields still decode, so the schema names the first one in its error
_FIELD_NAME_BYTES = 64  # longest field name a body may carry (known names are ≤ 20 bytes; an unknown one is named in the error)


def _walk(tp: Any, metadata: list[Any], depth: int, acc: dict[str, int]) -> None:
    """Fold the largest container/bin/str sizes and nesting of type ``tp`` into ``acc``."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extra = typing.get_args(tp)
        more = [m for e in extra for m in (getattr(e, "metadata", None) or [e])]
        _walk(base, list(metadata) + more, depth, acc)
        return
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            _walk(arg, metadata, depth, acc)
        return
    if origin is Literal:
        acc["str"] = max(acc["str"], *(len(str(a).encode()) for a in typing.get_args(tp)))
        return
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        acc["map"] = max(acc["map"], len(tp.model_fields) + _EXTRA_FIELDS_SLACK)
        acc["str"] = max(acc["str"], _FIELD_NAME_BYTES)  # map keys are msgpack strs too
        acc["depth"] = max(acc["depth"], depth + 1)
        for f in tp.model_fields.values():
            _walk(f.annotation, f.metadata, depth + 1, acc)
        return
    n = _max_len(metadata)
    if origin is list:
        if n is None:
            raise TypeError(f"unbounded list in a message schema: {tp}")
        acc["array"] = max(acc["array"], n)
        acc["depth"] = max(acc["depth"], depth + 1)
        _walk(typing.get_args(tp)[0], [], depth + 1, acc)
    elif origin is dict:
        if n is None:
            raise TypeError(f"unbounded dict in a message schema: {tp}")
        acc["map"] = max(acc["map"], n)
        acc["depth"] = max(acc["depth"], depth + 1)
        key, value = typing.get_args(tp)
        _walk(key, [], depth + 1, acc)
        _walk(value, [], depth + 1, acc)
    elif tp is bytes:
        if n is None:
            raise TypeError("unbounded bytes in a message schema")
        acc["bin"] = max(acc["bin"], n)
    elif tp is str:
        if n is None:
            raise TypeError("unbounded str in a message schema")
        acc["str"] = max(acc["str"], 4 * n)  # characters → UTF-8 bytes


ENVELOPE_FIELDS = 8
"""Entries of the envelope map around every body (``protocol.envelope``)."""


def decode_limits(cls: type[Message]) -> DecodeLimits:
    """The decoder bounds of a message type's *body*, derived from its schema.

    Every list, dict, bytes and str field of the schema must carry a ``max_length``; the
    largest of each kind anywhere in the schema becomes the limit, and the deepest nesting the
    depth limit. So a body cannot make the decoder build a 380 KiB array of empty maps where
    the schema allows at most 1,024 tasks.

    Raises:
        TypeError: the schema has an unbounded container (a bug in this module).
    """
    acc = {"bin": 0, "str": 0, "array": 0, "map": 0, "depth": 0}
    _walk(cls, [], 0, acc)
    return DecodeLimits(max_bin_len=acc["bin"], max_str_len=acc["str"], max_array_len=acc["array"], max_map_len=acc["map"],
                        max_depth=acc["depth"], max_containers=max_containers(cls))


def max_containers(cls: type[BaseModel], lengths: dict[str, int] | None = None) -> int:
    """Most arrays and maps a body of message type (or part) ``cls`` holds, itself included, with
    every list and dict at its schema's ``max_length``, or (list fields of ``cls`` named in
    ``lengths``) at the length given there (:class:`protocol.encoding.DecodeLimits`)."""
    if not lengths:
        return _containers(cls, [])
    total = 1 + _EXTRA_FIELDS_SLACK
    for name, f in cls.model_fields.items():
        if name in lengths and typing.get_origin(f.annotation) is list:
            total += 1 + lengths[name] * _containers(typing.get_args(f.annotation)[0], [])
        else:
            total += _containers(f.annotation, f.metadata)
    return total


def _containers(tp: Any, metadata: list[Any]) -> int:
    """Most arrays and maps a valid value of type ``tp`` holds (itself included), plus an empty
    one in each of a model's :data:`_EXTRA_FIELDS_SLACK` unknown fields (so the schema, not the
    decoder, names an unknown field)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extra = typing.get_args(tp)
        return _containers(base, list(metadata) + [m for e in extra for m in (getattr(e, "metadata", None) or [e])])
    if origin in (typing.Union, types.UnionType):
        return max(_containers(arg, metadata) for arg in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return 1 + _EXTRA_FIELDS_SLACK + sum(_containers(f.annotation, f.metadata) for f in tp.model_fields.values())
    n = _max_len(metadata) or 0
    if origin is list:
        return 1 + n * _containers(typing.get_args(tp)[0], [])
    if origin is dict:
        return 1 + n * _containers(typing.get_args(tp)[1], [])
    return 0


BODY_LIMITS: dict[str, DecodeLimits] = {tag: decode_limits(cls) for tag, cls in MESSAGE_TYPES.items()}
"""Decoder bounds of each message type's body, by type tag (``docs/protocol.md`` §2)."""
