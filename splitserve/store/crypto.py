"""Keys of the disk tier: every tenant's blocks are sealed with AES-256-GCM under a key
derived from the worker's master key and the tenant, so a stolen disk (or another tenant's
key) reveals nothing, and a changed byte anywhere in a file fails authentication.

    tag key    = HKDF-SHA256(master, info="splitserve-kv-disk/v1 tenant-tag")
    name key   = HKDF-SHA256(master, info="splitserve-kv-disk/v1 tenant-name")
    tenant key = HKDF-SHA256(master, info="splitserve-kv-disk/v1 tenant-key" 0x00 utf8(tenant))
    tenant tag = BLAKE2b-128(utf8(tenant), key=tag key)          # names the tenant in a file
    name box   = AES-GCM(name key; u16le(len) utf8(tenant) zero-padded to 32k bytes)

The tag lets a reader match a file to a tenant without the name in clear; the name box
lets a restarted worker recover whose file it is (its quotas, its purge) without trying
every tenant's key; the padding hides the name's exact length. HKDF's info strings keep
the three derived keys independent (the 0x00 separator ends the fixed label before the
tenant's bytes). AES-GCM nonces are 96 random bits per file (a tenant key seals far
fewer than the 2**32 messages that random nonces allow).
"""
from __future__ import annotations

import hashlib
import secrets
import struct
import threading
from collections import OrderedDict

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MASTER_KEY_MIN_BYTES = 16
KEY_BYTES = 32
NONCE_BYTES = 12
GCM_TAG_BYTES = 16
TENANT_TAG_BYTES = 16
MAX_TENANT_BYTES = 4096
_NAME_PAD = 32
_INFO = b"splitserve-kv-disk/v1 "
_U16 = struct.Struct("<H")
_MAX_CACHED_KEYS = 1024  # tenants are client-chosen without API keys: bound the cache


def new_master_key() -> bytes:
    """A fresh random master key (keep it with the worker's other secrets, not on disk
    next to the blocks: whoever has it can read them)."""
    return secrets.token_bytes(KEY_BYTES)


def _derive(master_key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=_INFO + info).derive(master_key)


def _encode_tenant(tenant: str) -> bytes:
    encoded = tenant.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_TENANT_BYTES:
        raise ValueError(f"tenant name has {len(encoded)} UTF-8 bytes, the disk tier takes "
                         f"at most {MAX_TENANT_BYTES}")
    return encoded


class DiskCrypto:
    """Seals and opens one worker's disk blocks; thread-safe."""

    def __init__(self, master_key: bytes) -> None:
        if not isinstance(master_key, bytes) or len(master_key) < MASTER_KEY_MIN_BYTES:
            raise ValueError(f"the disk tier's master key must be at least "
                             f"{MASTER_KEY_MIN_BYTES} random bytes ({KEY_BYTES} recommended: "
                             f"crypto.new_master_key())")
        self._master_key = master_key
        self._tag_key = _derive(master_key, b"tenant-tag")
        self._names = AESGCM(_derive(master_key, b"tenant-name"))
        self._tenant_ciphers: OrderedDict[str, AESGCM] = OrderedDict()
        self._lock = threading.Lock()

    def tenant_tag(self, tenant: str) -> bytes:
        """A keyed digest naming the tenant in file headers and names."""
        return hashlib.blake2b(_encode_tenant(tenant), key=self._tag_key,
                               digest_size=TENANT_TAG_BYTES).digest()

    def seal_name(self, tenant: str, nonce: bytes, aad: bytes) -> bytes:
        encoded = _encode_tenant(tenant)
        plain = _U16.pack(len(encoded)) + encoded
        plain += bytes(-len(plain) % _NAME_PAD)
        return self._names.encrypt(nonce, plain, aad)

    def open_name(self, box: bytes, nonce: bytes, aad: bytes) -> str | None:
        """The tenant sealed in `box`, or None when it fails authentication."""
        try:
            plain = self._names.decrypt(nonce, box, aad)
        except InvalidTag:
            return None
        (length,) = _U16.unpack_from(plain)
        try:
            return plain[2:2 + length].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None

    def seal(self, tenant: str, nonce: bytes, payload: bytes | memoryview, aad: bytes) -> bytes:
        """Ciphertext and GCM tag of one block's payload."""
        return self._cipher(tenant).encrypt(nonce, payload, aad)

    def open(self, tenant: str, nonce: bytes, sealed: bytes | memoryview,
             aad: bytes | memoryview) -> bytes | None:
        """The payload, or None when the bytes, the header or the key do not match."""
        try:
            return self._cipher(tenant).decrypt(nonce, sealed, aad)
        except InvalidTag:
            return None

    def _cipher(self, tenant: str) -> AESGCM:
        with self._lock:
            cipher = self._tenant_ciphers.get(tenant)
            if cipher is not None:
                self._tenant_ciphers.move_to_end(tenant)
                return cipher
        cipher = AESGCM(_derive(self._master_key, b"tenant-key\x00" + _encode_tenant(tenant)))
        with self._lock:
            self._tenant_ciphers[tenant] = cipher
            if len(self._tenant_ciphers) > _MAX_CACHED_KEYS:
                self._tenant_ciphers.popitem(last=False)
        return cipher


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def name_box_bytes(tenant: str) -> int:
    """Size of `seal_name`'s output for this tenant."""
    plain = 2 + len(_encode_tenant(tenant))
    return plain + (-plain % _NAME_PAD) + GCM_TAG_BYTES
