"""The exception family of ``protocol/``.

Every failure caused by input a peer could have written (bytes off the network, a file on
disk) is a :class:`ProtocolError` subclass, so a fault-tolerance point can catch exactly that
family, penalise the sender and go on, without ever swallowing a programming bug.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of every error raised on untrusted input by ``protocol/``."""


class DecodeError(ProtocolError):
    """Bytes that are not a well-formed canonical message (truncated, oversized, bad msgpack,
    non-canonical encoding, wrong top-level shape)."""


class TooLarge(DecodeError):
    """Bytes over the byte limit of what they claim to be, refused before any of them is decoded
    (gossip's rejection reason ``oversized``)."""


class SchemaError(ProtocolError):
    """A structurally valid message whose fields are missing, extra, mistyped or out of bounds.

    Attributes:
        field: dotted path of the offending field (``"body.policy_step"``), or ``""``.
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class SignatureError(ProtocolError):
    """A signature that does not verify, or a signer not allowed for what it signed."""


class WrongRunError(ProtocolError):
    """A message or file that belongs to another run (run ID mismatch)."""


class KeyFileError(ProtocolError):
    """A key file that is missing, unreadable, of the wrong kind, or would be overwritten."""


class RunSpecError(ProtocolError):
    """A run spec that is malformed, unsigned, tampered with or inconsistent."""


class AddressError(ProtocolError):
    """A run address that is malformed, or whose spec is not the one it names (``protocol.address``)."""


class ArtifactError(ProtocolError):
    """An artifact manifest whose bytes are not the ones the run spec pins, or that breaks the piece rule
    (``protocol.artifacts``)."""
