"""Block hash contract (DESIGN.md 4.1): known answers, namespace isolation, chaining."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.kv_cache import hash_block, hash_full_blocks, root_hash

ZERO = bytes(16)


def ref_hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The contract written out independently of the implementation."""
    data = parent + b"".join(t.to_bytes(4, "little") for t in token_ids)
    return hashlib.blake2b(data, digest_size=16).digest()


def ref_root_hash(fingerprint: str, namespace: str | None) -> bytes:
    def field(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b
    data = field(b"splitserve-kv-root/v1") + field(fingerprint.encode())
    data += b"\x00" if namespace is None else b"\x01" + field(namespace.encode())
    return hashlib.blake2b(data, digest_size=16).digest()


def test_hash_block_known_answer() -> None:
    assert hash_block(ZERO, [0, 1, 2, 3]) == ref_hash_block(ZERO, [0, 1, 2, 3])
    # Pinned literal: the wire format must not drift between releases.
    assert hash_block(ZERO, [0, 1, 2, 3]).hex() == "206edb31760756de8ad76f30a1676152"
    parent = bytes(range(16))
    tokens = [2**32 - 1, 0, 128000, 7]
    assert hash_block(parent, tokens) == ref_hash_block(parent, tokens)
    assert len(hash_block(parent, tokens)) == 16


def test_root_hash_known_answer() -> None:
    for namespace in (None, "", "tenant-a", "ünïcode"):
        assert root_hash("llama-fp", namespace) == ref_root_hash("llama-fp", namespace)


def test_namespaces_are_isolated() -> None:
    roots = {ns: root_hash("fp", ns) for ns in (None, "", "x", "y")}
    assert len(set(roots.values())) == 4
    tokens = list(range(32))
    chains = {ns: hash_full_blocks(root, tokens, 16) for ns, root in roots.items()}
    all_hashes = [h for chain in chains.values() for h in chain]
    assert len(set(all_hashes)) == len(all_hashes)
    assert root_hash("fp", "x") == root_hash("fp", "x")
    assert root_hash("fp", "x") != root_hash("fp2", "x")


def test_root_fields_are_length_prefixed() -> None:
    assert root_hash("ab", "c") != root_hash("a", "bc")
    assert root_hash("a", "") != root_hash("", "a")
    assert root_hash("", None) != root_hash("", "")


def test_hash_full_blocks_chains_and_skips_partial_block() -> None:
    root = root_hash("fp", None)
    tokens = list(range(10))
    h0 = ref_hash_block(root, [0, 1, 2, 3])
    h1 = ref_hash_block(h0, [4, 5, 6, 7])
    assert hash_full_blocks(root, tokens, 4) == [h0, h1]
    assert hash_full_blocks(root, tokens[:3], 4) == []
    assert hash_full_blocks(root, [], 4) == []


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_out_of_range_token_raises(bad: int) -> None:
    with pytest.raises(ValueError, match="token id"):
        hash_block(ZERO, [1, bad])
    with pytest.raises(ValueError, match="token id"):
        hash_full_blocks(ZERO, [1, 2, 3, 4, bad], 4)  # even in the unhashed tail


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="parent hash"):
        hash_block(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks(ZERO, [1, 2], 0)


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=64)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, block_size=st.integers(1, 8), cut=st.integers(0, 64))
def test_hash_chains_are_prefix_consistent(tokens: list[int], block_size: int,
                                           cut: int) -> None:
    root = root_hash("fp", "ns")
    full = hash_full_blocks(root, tokens, block_size)
    assert len(full) == len(tokens) // block_size
    prefix = hash_full_blocks(root, tokens[:cut], block_size)
    assert prefix == full[:len(prefix)]
    if full:
        assert full[0] == hash_block(root, tokens[:block_size])


@settings(max_examples=60, deadline=None)
@given(a=st.lists(st.integers(0, 50), min_size=4, max_size=16),
       b=st.lists(st.integers(0, 50), min_size=4, max_size=16))
def test_different_tokens_give_different_hashes(a: list[int], b: list[int]) -> None:
    root = root_hash("fp", None)
    n = min(len(a), len(b)) // 4 * 4
    ha, hb = hash_full_blocks(root, a[:n], 4), hash_full_blocks(root, b[:n], 4)
    # Chained: every block from the first difference on differs, earlier ones agree.
    for i in range(n // 4):
        same_prefix = a[:(i + 1) * 4] == b[:(i + 1) * 4]
        assert (ha[i] == hb[i]) == same_prefix
    if a != b:
        assert hash_block(root, a) != hash_block(root, b)
