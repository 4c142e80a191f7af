"""Node identity: one ed25519 key is both the libp2p peer ID and the message-signing key.

The peer ID is libp2p's (specs/peer-ids): the public key is wrapped in the libp2p ``PublicKey``
protobuf (``KeyType Ed25519 = 1``), and since that encoding is 36 bytes (≤ 42) the multihash is
the *identity* hash of it; the result is written in base58btc, which for ed25519 always starts
with ``12D3KooW``. Hence a peer ID alone carries the key that verifies the peer's signatures.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NewType

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import KeyFileError, SchemaError, SignatureError

PeerId = NewType("PeerId", str)
"""A libp2p peer ID (``12D3KooW…``, base58btc of the identity multihash of an ed25519 key): what
:attr:`NodeKey.peer_id`, verified envelopes and message fields (``protocol.messages.PeerIdStr``,
checked by pattern) hold. A plain ``str`` becomes one by :func:`public_key_from_peer_id` or a schema."""

PEER_ID_PATTERN = r"12D3KooW[1-9A-HJ-NP-Za-km-z]{44}"
"""An ed25519 peer ID's text (identity multihash of the protobuf key, base58btc): a regex without anchors."""
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
# libp2p PublicKey protobuf: field 1 (varint) = 1 (Ed25519), field 2 (bytes) = 32-byte key.
_PROTOBUF_PREFIX = bytes([0x08, 0x01, 0x12, PUBLIC_KEY_BYTES])
# multihash: code 0x00 (identity), length 36.
_MULTIHASH_PREFIX = bytes([0x00, len(_PROTOBUF_PREFIX) + PUBLIC_KEY_BYTES])
KEY_FILE_MODE = 0o600


def peer_id_from_public_key(public_key: bytes) -> PeerId:
    """Derive the libp2p peer ID of a raw ed25519 public key.

    Args:
        public_key: the 32-byte raw ed25519 public key.

    Returns:
        The base58btc peer ID (``12D3KooW…``, 52 characters).

    Raises:
        SchemaError: the key is not 32 bytes.
    """
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise SchemaError(f"an ed25519 public key is {PUBLIC_KEY_BYTES} bytes", "public_key")
    return PeerId(base58.b58encode(_MULTIHASH_PREFIX + _PROTOBUF_PREFIX + public_key).decode("ascii"))


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Recover the raw ed25519 public key embedded in a peer ID.

    Takes any string (not :data:`PeerId`): this is the check that makes an untrusted string one.

    Raises:
        SchemaError: not a base58btc identity-multihash ed25519 peer ID.
    """
    if not isinstance(peer_id, str) or not peer_id.startswith("12D3KooW") or len(peer_id) > 64:
        raise SchemaError(f"{str(peer_id)[:64]!r} is not an ed25519 peer ID", "peer_id")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise SchemaError(f"peer ID is not base58btc: {e}", "peer_id") from e
    head = _MULTIHASH_PREFIX + _PROTOBUF_PREFIX
    if len(raw) != len(head) + PUBLIC_KEY_BYTES or not raw.startswith(head):
        raise SchemaError("peer ID is not an identity multihash of an ed25519 key", "peer_id")
    key = raw[len(head):]
    if peer_id_from_public_key(key) != peer_id:  # reject non-canonical base58 spellings
        raise SchemaError("peer ID is not in canonical base58btc form", "peer_id")
    return key


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Check an ed25519 signature.

    Raises:
        SignatureError: wrong length or the signature does not verify.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise SignatureError("malformed public key or signature length")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as e:
        raise SignatureError("signature does not verify") from e


class NodeKey:
    """An ed25519 private key with its peer ID.

    Attributes:
        public_key: 32-byte raw public key.
        peer_id: the libp2p peer ID of ``public_key``.
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: PeerId = peer_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> NodeKey:
        """A fresh random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeKey:
        """The key whose 32-byte RFC 8032 private seed is ``seed`` (deterministic test keys)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def seed(self) -> bytes:
        """The 32-byte private seed (what libp2p's ed25519 key-pair constructor takes)."""
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, message: bytes) -> bytes:
        """Sign ``message``; returns the 64-byte ed25519 signature."""
        return self._private.sign(message)

    def save(self, path: Path) -> None:
        """Write the key as unencrypted PKCS#8 PEM with mode 0600, refusing to overwrite.

        Raises:
            KeyFileError: ``path`` exists or cannot be created.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
        except FileExistsError as e:
            raise KeyFileError(f"{path} already exists; refusing to overwrite a key") from e
        except OSError as e:
            raise KeyFileError(f"cannot create key file {path}: {e.strerror}") from e
        try:
            os.fchmod(fd, KEY_FILE_MODE)  # umask may have narrowed it; make it exactly 0600
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)

    @classmethod
    def load(cls, path: Path) -> NodeKey:
        """Read a key written by :meth:`save`.

        The file must have mode 0600 (owner read/write only): a key others can read may already
        be someone else's, so it is refused rather than used (``docs/operators.md``).

        Raises:
            KeyFileError: missing, unreadable, mode other than 0600, or not an ed25519 private key.
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise KeyFileError(f"no key file at {path}; create one with `intellect-node keygen --key {path}`") from e
        except OSError as e:
            raise KeyFileError(f"cannot read key file {path}: {e.strerror}") from e
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)  # of the file opened, not of whatever the path names later
            if mode != KEY_FILE_MODE:
                raise KeyFileError(f"key file {path} has mode {mode:04o}, must be 0600 (others may have read it); fix with `chmod 600 {path}`")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(1 << 16)
        except OSError as e:
            raise KeyFileError(f"cannot read key file {path}: {e.strerror}") from e
        finally:
            os.close(fd)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"{path} is not an unencrypted PEM private key") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} holds a {type(key).__name__}, not an ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> NodeKey:
        """Load the key at ``path``, creating it first if absent (a node's first start)."""
        if not Path(path).exists():
            key = cls.generate()
            try:
                key.save(path)
            except KeyFileError:
                pass  # lost a race with another process creating it: load theirs
            else:
                return key
        return cls.load(path)
