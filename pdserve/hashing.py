"""Chained block hashes: the one key for the node-local prefix cache and the Redis index.

Only full blocks are hashed::

    h_0     = SHA-256(ROOT(namespace) || encode(tokens of block 0) || encode(extra))
    h_i     = SHA-256(h_{i-1}         || encode(tokens of block i) || encode(extra))
    ROOT(n) = SHA-256(b"pdserve/block-hash/v1\\0" || utf8(n))

``encode(tokens)`` is a little-endian uint32 count followed by each token id as
little-endian uint32; ``encode(extra)`` is a uint32 length then the bytes. The
namespace is the model id, so two models never share a prefix. Nothing depends on
Python's ``hash()`` or the process, and tests pin a vector so every process (and
any other language) agrees.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
"""32 raw bytes of SHA-256."""

_ROOT_TAG = b"pdserve/block-hash/v1\0"


@functools.lru_cache(maxsize=16)
def root_hash(namespace: str) -> BlockHash:
    return hashlib.sha256(_ROOT_TAG + namespace.encode("utf-8")).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    extra: bytes = b"",
    start: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; ``start`` holds hashes already known.

    Returns ``start`` extended, so callers can keep a request's chain up to date as it grows.
    """
    hashes = list(start)
    parent = hashes[-1] if hashes else root_hash(namespace)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class BlockEvent:
    """A change to the set of cached block hashes, for the cluster's prefix index."""

    stored: bool
    block_hashes: tuple[BlockHash, ...]
