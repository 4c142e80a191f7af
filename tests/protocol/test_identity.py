import os
import stat

import pytest

from protocol.errors import KeyFileError, SchemaError, SignatureError
from protocol.identity import NodeKey, peer_id_from_public_key, public_key_from_peer_id, verify_signature


def test_peer_id_matches_py_libp2p():
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    for i in range(5):
        key = NodeKey.from_seed(bytes([i]) * 32)
        pair = create_new_key_pair(key.seed())
        assert pair.public_key.to_bytes() == key.public_key
        assert ID.from_pubkey(pair.public_key).to_base58() == key.peer_id
        assert key.peer_id.startswith("12D3KooW") and len(key.peer_id) == 52


def test_peer_id_round_trip_and_rejects_garbage():
    key = NodeKey.generate()
    assert public_key_from_peer_id(key.peer_id) == key.public_key
    for bad in ["", "12D3KooW", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", key.peer_id[:-1] + "0", key.peer_id + "1"]:
        with pytest.raises(SchemaError):
            public_key_from_peer_id(bad)
    with pytest.raises(SchemaError):
        peer_id_from_public_key(b"\x00" * 31)


def test_sign_verify_and_reject_other_key():
    a, b = NodeKey.generate(), NodeKey.generate()
    sig = a.sign(b"msg")
    verify_signature(a.public_key, sig, b"msg")
    with pytest.raises(SignatureError):
        verify_signature(b.public_key, sig, b"msg")
    with pytest.raises(SignatureError):
        verify_signature(a.public_key, sig, b"msh")


def test_key_file_mode_no_overwrite_and_load(tmp_path):
    path = tmp_path / "sub" / "node.key"
    old = os.umask(0)
    try:
        key = NodeKey.generate()
        key.save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert NodeKey.load(path).peer_id == key.peer_id
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        NodeKey.generate().save(path)
    assert NodeKey.load(path).peer_id == key.peer_id


def test_load_errors(tmp_path):
    with pytest.raises(KeyFileError, match="keygen"):
        NodeKey.load(tmp_path / "missing")
    (tmp_path / "junk").write_text("not a key")
    (tmp_path / "junk").chmod(0o600)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        NodeKey.load(tmp_path / "junk")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "ec").write_bytes(pem)
    (tmp_path / "ec").chmod(0o600)
    with pytest.raises(KeyFileError, match="not an ed25519"):
        NodeKey.load(tmp_path / "ec")


def test_load_or_create_is_stable(tmp_path):
    a = NodeKey.load_or_create(tmp_path / "k")
    b = NodeKey.load_or_create(tmp_path / "k")
    assert a.peer_id == b.peer_id
