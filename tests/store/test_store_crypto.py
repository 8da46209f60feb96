"""Disk tier keys: per-tenant AES-GCM keys and keyed tenant tags from one master key."""
from __future__ import annotations

import pytest

from splitserve.store.crypto import (MAX_TENANT_BYTES, DiskCrypto, name_box_bytes,
                                     new_master_key, new_nonce)

AAD = b"header"


def test_tenant_keys_and_tags_depend_on_tenant_and_master_key() -> None:
    master = new_master_key()
    crypto, same, other = DiskCrypto(master), DiskCrypto(master), DiskCrypto(new_master_key())
    assert crypto.tenant_tag("A") == same.tenant_tag("A") != crypto.tenant_tag("B")
    assert crypto.tenant_tag("A") != other.tenant_tag("A")  # keyed: not a plain hash
    nonce = new_nonce()
    sealed = crypto.seal("A", nonce, b"kv bytes", AAD)
    assert same.open("A", nonce, sealed, AAD) == b"kv bytes"
    assert crypto.open("B", nonce, sealed, AAD) is None  # another tenant's key
    assert other.open("A", nonce, sealed, AAD) is None  # another master key
    assert crypto.open("A", nonce, sealed, b"other header") is None
    flipped = bytes([sealed[0] ^ 1]) + sealed[1:]
    assert crypto.open("A", nonce, flipped, AAD) is None


def test_name_box_round_trip_padding_and_tamper() -> None:
    crypto = DiskCrypto(new_master_key())
    nonce = new_nonce()
    for tenant in ("", "a", "ünïcode", "x" * 100):
        box = crypto.seal_name(tenant, nonce, AAD)
        assert len(box) == name_box_bytes(tenant) and len(box) % 16 == 0
        assert crypto.open_name(box, nonce, AAD) == tenant
        assert len(tenant) < 8 or tenant.encode() not in box  # short names match by chance
    assert len(crypto.seal_name("a", nonce, AAD)) == len(crypto.seal_name("abc", nonce, AAD))
    box = crypto.seal_name("a", nonce, AAD)
    assert crypto.open_name(box, nonce, b"moved") is None
    assert DiskCrypto(new_master_key()).open_name(box, nonce, AAD) is None


def test_bad_master_key_and_tenant_names() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        DiskCrypto(b"0" * 15)
    with pytest.raises(ValueError, match="at least 16"):
        DiskCrypto("a string key" * 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="UTF-8 bytes"):
        DiskCrypto(new_master_key()).tenant_tag("x" * (MAX_TENANT_BYTES + 1))
