"""Chained block hashes: the one prefix-identity contract (DESIGN.md 4.1).

The engine, the KV store, the router and KV events all name a block by the same
16-byte digest, so the byte encoding below is a wire format: changing it means
bumping the `/v1` tag in the root.

    root = BLAKE2b-128( u32le(len(TAG)) TAG
                        u32le(len(fp)) fp_utf8
                        0x00                          # namespace is None
                      | 0x01 u32le(len(ns)) ns_utf8 ) # namespace is a str ("" included)
    h_0  = BLAKE2b-128( root  || u32le(tok) for tok in block_0 )
    h_i  = BLAKE2b-128( h_i-1 || u32le(tok) for tok in block_i )

Length prefixes keep ("ab", "c") and ("a", "bc") apart; the presence byte keeps
None, "" and every non-empty namespace pairwise distinct, so two tenants can never
share a root and hence never match each other's blocks.
"""
from __future__ import annotations

import functools
import hashlib
import operator
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16-byte BLAKE2b digest

HASH_SIZE = 16
ROOT_TAG = b"splitserve-kv-root/v1"
_U32 = struct.Struct("<I")


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


@functools.lru_cache(maxsize=4096)  # bounded: clients choose namespaces (salts)
def root_hash(fingerprint: str, namespace: str | None) -> BlockHash:
    """Parent hash of a sequence's first block for one model and cache namespace.

    `fingerprint` is the model fingerprint (DESIGN.md 4.2); `namespace` is the tenant
    salt, where None (no namespace), "" and every non-empty string give different roots.
    """
    encoded = _field(ROOT_TAG) + _field(fingerprint.encode("utf-8"))
    if namespace is None:
        encoded += b"\x00"
    else:
        encoded += b"\x01" + _field(namespace.encode("utf-8"))
    return hashlib.blake2b(encoded, digest_size=HASH_SIZE).digest()


def _is_u32(token_id: object) -> bool:
    try:
        return 0 <= operator.index(token_id) < 1 << 32  # type: ignore[arg-type]
    except TypeError:
        return False


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian u32 encoding of `token_ids`; ValueError outside [0, 2**32)."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        bad = next((t for t in token_ids if not _is_u32(t)), None)
        raise ValueError(
            f"token id {bad!r} is not an integer in [0, 2**32); block hashes encode "
            f"token ids as u32, so check the tokenizer output") from None


def _check_parent(parent: BlockHash) -> None:
    if len(parent) != HASH_SIZE:
        raise ValueError(
            f"parent hash has {len(parent)} bytes, expected {HASH_SIZE}; pass a value "
            f"from root_hash() or hash_block()")


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash (the root for the first block)."""
    _check_parent(parent)
    return hashlib.blake2b(parent + _pack_tokens(token_ids), digest_size=HASH_SIZE).digest()


def hash_full_blocks(parent: BlockHash, token_ids: Sequence[int],
                     block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block is not
    hashed (but its token ids are still validated).

    Prefix-consistent: the hashes of a prefix of `token_ids` are a prefix of the result.
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    _check_parent(parent)
    # NOTE: pack once and slice the bytes; one struct call is much cheaper than one per block.
    packed = _pack_tokens(token_ids)
    stride = 4 * block_size
    hashes: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        parent = hashlib.blake2b(parent + packed[i * stride:(i + 1) * stride],
                                 digest_size=HASH_SIZE).digest()
        hashes.append(parent)
    return hashes
