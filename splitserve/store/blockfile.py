"""The disk tier's file format: one sealed block per file.

    offset  size  field
    0       8     magic b"SSKVBLK\\0"
    8       2     format version (u16 le, 1)
    10      2     flags (bit 0: has a parent hash)
    12      16    fingerprint digest: BLAKE2b-128("splitserve-kv-disk-fp/v1" 0x00 fingerprint)
    28      16    block hash
    44      16    parent hash (zeros without one)
    60      16    tenant tag (crypto.py: keyed BLAKE2b, never the name in clear)
    76      4     payload length (u32 le): the store's block bytes
    80      12    AES-GCM nonce (random per file)
    92      2     name box length (u16 le)
    94      n     name box: AES-GCM(name key; tenant name), aad = bytes [0, 94)
    94+n    p+16  AES-GCM(tenant key; payload) || tag, aad = bytes [0, 94+n)

Everything before the payload is authenticated with it: a file renamed to another hash,
moved under another tenant or model, cut short or with any flipped byte does not open.
Also here: writing a file, and wiping one (secure deletion).
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import struct
from pathlib import Path
from typing import NamedTuple

from splitserve.kv_cache.block_hash import BlockHash

from .block import BlockKey
from .crypto import GCM_TAG_BYTES, MAX_TENANT_BYTES, DiskCrypto, name_box_bytes, new_nonce

logger = logging.getLogger(__name__)

MAGIC = b"SSKVBLK\x00"
VERSION = 1
_FLAG_PARENT = 1
_FIXED = struct.Struct("<8sHH16s16s16s16sI12sH")
_NO_PARENT = bytes(16)
MAX_HEAD_BYTES = _FIXED.size + name_box_bytes("x" * MAX_TENANT_BYTES)
_ZEROS = bytes(1 << 20)


def fingerprint_digest(fingerprint: str) -> bytes:
    return hashlib.blake2b(b"splitserve-kv-disk-fp/v1\x00" + fingerprint.encode("utf-8"),
                           digest_size=16).digest()


class _Header(NamedTuple):
    fixed: bytes
    fp_digest: bytes
    block_hash: BlockHash
    parent_hash: BlockHash | None
    tenant_tag: bytes
    payload_len: int
    nonce: bytes
    box_len: int

    @property
    def file_bytes(self) -> int:
        return _FIXED.size + self.box_len + self.payload_len + GCM_TAG_BYTES


def seal_block(crypto: DiskCrypto, fp_digest: bytes, key: BlockKey,
               payload: memoryview) -> list[bytes]:
    """The file's bytes, in parts (header, name box, sealed payload)."""
    tenant = key.tenant_id
    nonce = new_nonce()
    flags = _FLAG_PARENT if key.parent_hash is not None else 0
    fixed = _FIXED.pack(MAGIC, VERSION, flags, fp_digest, key.block_hash,
                        key.parent_hash or _NO_PARENT, crypto.tenant_tag(tenant),
                        payload.nbytes, nonce, name_box_bytes(tenant))
    box = crypto.seal_name(tenant, nonce, fixed)
    assert len(box) == name_box_bytes(tenant), "name box size formula drifted"
    return [fixed, box, crypto.seal(tenant, nonce, payload, fixed + box)]


def _parse(data: bytes, fp_digest: bytes, block_bytes: int) -> _Header | None:
    """The header if it is one of ours for this model and block size, else None."""
    if len(data) < _FIXED.size:
        return None
    (magic, version, flags, fp, block_hash, parent, tag, payload_len, nonce,
     box_len) = _FIXED.unpack_from(data)
    if (magic != MAGIC or version != VERSION or flags & ~_FLAG_PARENT
            or not hmac.compare_digest(fp, fp_digest) or payload_len != block_bytes):
        return None
    has_parent = bool(flags & _FLAG_PARENT)
    if not has_parent and parent != _NO_PARENT:
        return None
    return _Header(bytes(data[:_FIXED.size]), fp, block_hash, parent if has_parent else None,
                   tag, payload_len, nonce, box_len)


def read_key(head: bytes, file_bytes: int, crypto: DiskCrypto, fp_digest: bytes,
             block_bytes: int) -> BlockKey | None:
    """The key of a file from its first bytes (at least MAX_HEAD_BYTES, or all of it) and
    its size, authenticated through the name box; None when anything does not match."""
    header = _parse(head, fp_digest, block_bytes)
    if header is None or header.file_bytes != file_bytes:
        return None
    box = head[_FIXED.size:_FIXED.size + header.box_len]
    if len(box) != header.box_len:
        return None
    tenant = crypto.open_name(box, header.nonce, header.fixed)
    if tenant is None or not hmac.compare_digest(crypto.tenant_tag(tenant), header.tenant_tag):
        return None
    # NOTE: no tenant (None) and "" are one tenant; None is how the store spells it.
    return BlockKey(header.block_hash, header.parent_hash, tenant or None)


def open_block(data: bytes, crypto: DiskCrypto, fp_digest: bytes, key: BlockKey,
               tenant_tag: bytes, block_bytes: int) -> bytes | None:
    """The payload of a whole file expected to hold `key`, or None when it does not."""
    header = _parse(data, fp_digest, block_bytes)
    if (header is None or header.file_bytes != len(data)
            or header.block_hash != key.block_hash or header.parent_hash != key.parent_hash
            or not hmac.compare_digest(header.tenant_tag, tenant_tag)):
        return None
    body = _FIXED.size + header.box_len
    return crypto.open(key.tenant_id, header.nonce, memoryview(data)[body:],
                       memoryview(data)[:body])


def write_file(path: Path, parts: list[bytes], fsync: bool) -> None:
    """Creates `path` (owner-only, never an existing file) holding `parts`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def wipe_file(path: Path) -> None:
    """Secure deletion: overwrite the file with zeros, flush them to the device (else the
    file system may drop the dirty pages with the unlinked inode and the old bytes stay on
    disk), then unlink. On copy-on-write file systems and SSDs old sectors may survive an
    overwrite anyway: that is why the files are also encrypted."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return
    except OSError:
        fd = -1
    try:
        if fd >= 0:
            remaining = os.fstat(fd).st_size
            while remaining > 0:
                remaining -= os.write(fd, _ZEROS[:min(remaining, len(_ZEROS))])
            os.fsync(fd)
    except OSError as exc:
        logger.warning("disk tier: wiping %s failed (%s); unlinking it", path.name, exc)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
