"""Signed envelopes: the one wire format of every message (``docs/protocol.md`` §2).

An envelope is a canonical msgpack map with exactly these keys::

    v       int    1 (format version)
    type    str    message type tag, e.g. "verdict/1"
    run     bin32  run ID (SHA-256 of the run spec's canonical content)
    signer  bin32  raw ed25519 public key of the signer (its peer ID is derived from it)
    ts_ms   int    signer's wall clock, milliseconds since the Unix epoch
    nonce   bin16  random; makes two envelopes with equal content distinct
    body    map    the message fields (schema chosen by ``type``)
    sig     bin64  ed25519 signature over DOMAIN || canonical(map without "sig")

The signed bytes carry the type tag and the run ID (domain separation), so a signature made for
one message type or run can never be replayed as another.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack
from pydantic import ValidationError

from protocol import encoding
from protocol.content import ContentId, content_id
from protocol.errors import DecodeError, SchemaError, SignatureError, TooLarge, WrongRunError
from protocol.identity import NodeKey, PeerId, peer_id_from_public_key, verify_signature
from protocol.messages import BODY_LIMITS, MESSAGE_TYPES, Message

ENVELOPE_VERSION = 1
DOMAIN = b"intellect-node/envelope/1\x00"
NONCE_BYTES = 16
MAX_ENVELOPE_BYTES = max(cls.MAX_BYTES for cls in MESSAGE_TYPES.values())
_KEYS = {"v", "type", "run", "signer", "ts_ms", "nonce", "body", "sig"}

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Authorities:
    """Who may sign what in a run: the coordinator key and the validator keys (raw 32 bytes)."""

    coordinator: bytes
    validators: frozenset[bytes]

    def allows(self, signer_kind: str, public_key: bytes) -> bool:
        """Whether ``public_key`` may sign a message whose ``SIGNER`` is ``signer_kind``."""
        if signer_kind == "any":
            return True
        if signer_kind == "coordinator":
            return public_key == self.coordinator
        if signer_kind == "validator":
            return public_key in self.validators
        return False


@dataclass(frozen=True)
class Envelope(Generic[M]):
    """A decoded, verified envelope.

    Attributes:
        body: the typed message.
        run_id: 32-byte run ID.
        signer: 32-byte public key of the signer.
        ts_ms: signer's timestamp, milliseconds since the epoch.
        nonce: 16 random bytes.
        raw: the exact bytes received (what is stored and forwarded).
    """

    body: M
    run_id: bytes
    signer: bytes
    ts_ms: int
    nonce: bytes
    raw: bytes

    @property
    def type(self) -> str:
        return self.body.TYPE

    @property
    def peer_id(self) -> PeerId:
        """The signer's libp2p peer ID."""
        return peer_id_from_public_key(self.signer)

    @property
    def id(self) -> ContentId:
        """Content ID of the envelope bytes (submission IDs, manifest IDs, dedup keys)."""
        return content_id(self.raw)


def seal(key: NodeKey, run_id: bytes, body: Message, *, ts_ms: int | None = None, nonce: bytes | None = None) -> bytes:
    """Sign ``body`` for run ``run_id`` and return the envelope bytes.

    Args:
        key: the signer's key.
        run_id: 32-byte run ID.
        body: the message; its schema is re-checked so nothing invalid is ever sent.
        ts_ms: timestamp override (milliseconds since the epoch); default now.
        nonce: 16-byte nonce override; default random.

    Raises:
        SchemaError: ``body`` fails its own schema or exceeds its type's size limit.
    """
    if len(run_id) != 32:
        raise SchemaError("run ID must be 32 bytes", "run")
    body_map = body.model_dump(mode="python")
    _check_body(type(body), body_map)
    unsigned = {
        "v": ENVELOPE_VERSION,
        "type": body.TYPE,
        "run": bytes(run_id),
        "signer": key.public_key,
        "ts_ms": int(time.time() * 1000) if ts_ms is None else ts_ms,
        "nonce": os.urandom(NONCE_BYTES) if nonce is None else nonce,
        "body": body_map,
    }
    sig = key.sign(DOMAIN + encoding.packb(unsigned))
    data = encoding.packb({**unsigned, "sig": sig})
    if len(data) > body.MAX_BYTES:
        raise SchemaError(f"{body.TYPE} envelope is {len(data)} bytes, over its limit of {body.MAX_BYTES}")
    return data


def _check_body(cls: type[M], body_map: object) -> M:
    try:
        return cls.model_validate(body_map)
    except ValidationError as e:
        err = e.errors()[0]
        field = "body." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "body"
        raise SchemaError(err["msg"], field) from None


def open_envelope(
    data: bytes,
    *,
    run_id: bytes,
    authorities: Authorities | None = None,
    expect: type[M] | tuple[type[Message], ...] | None = None,
    max_bytes: int | None = None,
    now_ms: int | None = None,
    max_age_s: float | None = None,
    max_future_s: float = 30.0,
    body_limits: encoding.DecodeLimits | None = None,
) -> Envelope[M]:
    """Decode and verify an envelope; nothing of the body is trusted before this returns.

    Order of checks: size → the outer map alone (exactly the eight keys in canonical order, each
    fixed field canonical and tightly bounded; the body is only *skipped* over, not built) →
    field types → known type (and one of ``expect``) → run ID → signature over the raw signed
    bytes → signer allowed for the type → freshness → body decode under its type's schema-derived
    limits (:data:`protocol.messages.BODY_LIMITS`) → body schema (stopping at its first error) →
    canonical check of the body → body subject (e.g. a node record's ``peer_id``) equals the signer. So an unsigned or foreign
    envelope costs one pass over its bytes in C, never a Python walk of its body.

    Args:
        data: the received bytes.
        run_id: this node's 32-byte run ID; envelopes of other runs are rejected.
        authorities: keys of the run spec; required to accept coordinator/validator-signed types.
        expect: the message class (or classes) acceptable here; ``None`` accepts any known type.
        max_bytes: tighter size limit than the type's own ``MAX_BYTES``.
        now_ms: the receiver's clock for freshness checks (default: now).
        max_age_s: reject envelopes older than this many seconds (``None``: no age limit).
        max_future_s: reject timestamps further than this many seconds ahead of ``now_ms``.
        body_limits: tighter decoder bounds for the body than its type's (each bound is the
            smaller of the two), e.g. :func:`protocol.rollout.submission_decode_limits` of the run.

    Returns:
        The verified envelope with a typed body.

    Raises:
        DecodeError: size, msgpack or canonical-form failures.
        SchemaError: wrong envelope or body fields; the message names the field.
        WrongRunError: the envelope is for another run.
        SignatureError: bad signature, or a signer not allowed to sign this type.
    """
    limit = MAX_ENVELOPE_BYTES if max_bytes is None else min(max_bytes, MAX_ENVELOPE_BYTES)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limit:
        raise TooLarge(f"message of {len(data)} bytes exceeds the limit of {limit} bytes")
    outer = _read_outer(data)
    obj = outer.fields
    _typed(obj, "v", int)
    if obj["v"] != ENVELOPE_VERSION or isinstance(obj["v"], bool):
        raise SchemaError(f"unsupported envelope version {obj['v']!r}", "v")
    type_tag = _typed(obj, "type", str)
    cls = MESSAGE_TYPES.get(type_tag)
    if cls is None:
        raise SchemaError(f"unknown message type {type_tag[:64]!r}", "type")
    allowed = expect if isinstance(expect, tuple) else ((expect,) if expect is not None else None)
    if allowed is not None and cls not in allowed:
        raise SchemaError(f"{type_tag} not acceptable here (expected {', '.join(c.TYPE for c in allowed)})", "type")
    if len(data) > cls.MAX_BYTES:
        raise TooLarge(f"{type_tag} envelope of {len(data)} bytes exceeds its limit of {cls.MAX_BYTES}")
    run = _typed(obj, "run", bytes, 32)
    signer = _typed(obj, "signer", bytes, 32)
    ts_ms = _typed(obj, "ts_ms", int)
    if not 0 <= ts_ms < 2**63:
        raise SchemaError("timestamp out of range", "ts_ms")
    nonce = _typed(obj, "nonce", bytes, NONCE_BYTES)
    sig = _typed(obj, "sig", bytes, 64)
    if run != run_id:
        raise WrongRunError(f"envelope is for run {run.hex()[:16]}…, this node is in run {run_id.hex()[:16]}…")
    # the signature covers the raw bytes (canonical map without "sig"): checked before the body is decoded
    verify_signature(signer, sig, DOMAIN + outer.signed_bytes)
    if cls.SIGNER != "any" and (authorities is None or not authorities.allows(cls.SIGNER, signer)):
        raise SignatureError(f"{type_tag} must be signed by the {cls.SIGNER} of the run, not {peer_id_from_public_key(signer)}")
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    if ts_ms > now_ms + max_future_s * 1000:
        raise SchemaError(f"timestamp is {(ts_ms - now_ms) / 1000:.1f} s in the future", "ts_ms")
    if max_age_s is not None and ts_ms < now_ms - max_age_s * 1000:
        raise SchemaError(f"stale: {(now_ms - ts_ms) / 1000:.1f} s old, limit {max_age_s} s", "ts_ms")
    limits = BODY_LIMITS[type_tag]
    if body_limits is not None:
        limits = encoding.DecodeLimits(*(min(a, b) for a, b in zip(dataclasses.astuple(limits), dataclasses.astuple(body_limits))))
    body_obj = encoding.unpackb(outer.body_bytes, cls.MAX_BYTES, limits, canonical=False)
    if not isinstance(body_obj, dict):
        raise SchemaError("must be a map", "body")
    body = _check_body(cls, body_obj)  # fails fast on junk (pydantic stops at its first error)
    encoding.require_canonical(body_obj, outer.body_bytes, limits.max_depth)
    if cls.SIGNER_IS_SUBJECT is not None:
        subject = getattr(body, cls.SIGNER_IS_SUBJECT)
        if subject != peer_id_from_public_key(signer):
            raise SignatureError(f"body.{cls.SIGNER_IS_SUBJECT} {subject} is not the signer {peer_id_from_public_key(signer)}")
    return Envelope(body=body, run_id=run, signer=signer, ts_ms=ts_ms, nonce=nonce, raw=bytes(data))  # type: ignore[arg-type]


def _typed(obj: dict[str, Any], key: str, typ: type, length: int | None = None) -> Any:
    v: Any = obj[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise SchemaError(f"must be {typ.__name__}, got {type(v).__name__}", key)
    n = len(obj[key]) if length is not None else 0
    if length is not None and n != length:
        raise SchemaError(f"must be {length} bytes, got {n}", key)
    return obj[key]


_OUTER_ORDER = ("body", "nonce", "run", "sig", "signer", "ts_ms", "type", "v")  # canonical: ascending UTF-8 key bytes
_OUTER_LIMITS = encoding.DecodeLimits(max_bin_len=64, max_str_len=64, max_array_len=0, max_map_len=0, max_depth=0)


@dataclass(frozen=True)
class _Outer:
    fields: dict[str, Any]  # every key but "body"
    body_bytes: bytes  # the raw bytes of the body value
    signed_bytes: bytes  # canonical(map without "sig"), cut from the raw bytes


def _read_outer(data: bytes) -> _Outer:
    """Parse the envelope's outer map without building its body.

    The fixed fields are decoded with 64-byte bin/str limits and no containers; the body is
    skipped (a C pass over its bytes). Each field must be canonical, so the signed bytes are the
    raw bytes with the ``sig`` entry cut out and the map header rewritten for seven entries.

    Raises:
        DecodeError: not a canonical envelope map of exactly the eight keys.
        SchemaError: a missing or unknown key.
    """
    if not data:
        raise DecodeError("empty message")
    if not 0x80 <= data[0] <= 0x8F:  # canonical maps of ≤ 15 entries are fixmaps
        raise DecodeError("envelope must be a map of its eight fields")
    u = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True, max_buffer_size=len(data), max_ext_len=0,
                         max_bin_len=_OUTER_LIMITS.max_bin_len, max_str_len=_OUTER_LIMITS.max_str_len,
                         max_array_len=_OUTER_LIMITS.max_array_len, max_map_len=_OUTER_LIMITS.max_map_len)
    u.feed(data)
    fields: dict[str, Any] = {}
    body_span = sig_span = None
    prev = b""
    try:
        n = u.read_map_header()
        for _ in range(n):
            key_start = u.tell()
            key = u.unpack()
            if not isinstance(key, str):
                raise DecodeError("envelope keys must be strings")
            if key not in _OUTER_ORDER:
                raise SchemaError("unknown field", key[:64])
            value_start = u.tell()
            if data[key_start:value_start] != encoding.packb(key) or key.encode() <= prev:
                raise DecodeError("envelope is not in canonical msgpack form (key encoding or order)")
            prev = key.encode()
            if key == "body":
                u.skip()
                body_span = (value_start, u.tell())
                continue
            value = u.unpack()
            if encoding.packb(value) != data[value_start:u.tell()]:
                raise DecodeError(f"envelope field {key} is not in canonical msgpack form")
            if key == "sig":
                sig_span = (key_start, u.tell())
            fields[key] = value
        end = u.tell()
    except msgpack.OutOfData:
        raise DecodeError("truncated message") from None
    except (ValueError, TypeError, OverflowError) as e:  # FormatError/StackError/limits/UnicodeDecodeError
        raise DecodeError(f"malformed envelope: {type(e).__name__}: {e}") from None
    if end != len(data):
        raise DecodeError("trailing bytes after the message")
    missing = [k for k in _OUTER_ORDER if k not in fields and k != "body"] + (["body"] if body_span is None else [])
    if missing:
        raise SchemaError("missing", min(missing))
    assert body_span is not None and sig_span is not None
    signed = bytes([0x80 | (len(_OUTER_ORDER) - 1)]) + data[1:sig_span[0]] + data[sig_span[1]:]
    return _Outer(fields=fields, body_bytes=data[body_span[0]:body_span[1]], signed_bytes=signed)
