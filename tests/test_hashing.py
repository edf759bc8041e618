"""Chained block hashes: a pinned vector, full blocks only, and independence from the process."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

from pdserve.hashing import hash_block, hash_block_chain, root_hash

NAMESPACE = "SmolLM2-135M-Instruct"

# Pinned once, from the encoding in hashing.py's docstring. Changing the encoding must change
# these, and with them every prefix index entry in a live cluster: bump the ROOT tag's version.
PINNED_ROOT = "7144b5d5e218093bf849b34c8b23cae4a591116df4c9688ccad9a1be67364cbd"
PINNED_CHAIN = [
    "4bf1c5aafbce4aaf401314deddfe710d9c237fe267b42c84ce748cc86c51030a",
    "c206b4c155bb8ba22367d3e995e024c0af79524d209f9e5fe15abf00aafc330f",
]


def ref_chain(token_ids: list[int], block_size: int, namespace: str, extra: bytes = b"") -> list[bytes]:
    """The docstring's encoding written out with hashlib and struct, one field at a time."""
    parent = hashlib.sha256(b"pdserve/block-hash/v1\x00" + namespace.encode("utf-8")).digest()
    out = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        data = parent + struct.pack("<I", len(block))
        for t in block:
            data += struct.pack("<I", t)
        data += struct.pack("<I", len(extra)) + extra
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def test_pinned_vector_matches_reference_encoding():
    ref_root = hashlib.sha256(b"pdserve/block-hash/v1\x00" + NAMESPACE.encode()).hexdigest()
    ref = [h.hex() for h in ref_chain(list(range(40)), 16, NAMESPACE)]
    assert ref_root == PINNED_ROOT
    assert ref == PINNED_CHAIN


def test_pinned_vector():
    assert root_hash(NAMESPACE).hex() == PINNED_ROOT
    chain = hash_block_chain(list(range(40)), 16, NAMESPACE)
    assert [h.hex() for h in chain] == PINNED_CHAIN
    assert all(isinstance(h, bytes) and len(h) == 32 for h in chain)


def test_reference_agrees_with_extra_and_odd_sizes():
    tokens = [7, 0, 2**32 - 1, 12345, 3, 3, 3, 99, 1]
    for block_size in (1, 2, 4, 8):
        for extra in (b"", b"lora:7", bytes(range(40))):
            assert hash_block_chain(tokens, block_size, "m", extra) == ref_chain(
                tokens, block_size, "m", extra
            )


def test_only_full_blocks_are_hashed():
    assert hash_block_chain(list(range(15)), 16, NAMESPACE) == []
    assert len(hash_block_chain(list(range(16)), 16, NAMESPACE)) == 1
    assert len(hash_block_chain(list(range(31)), 16, NAMESPACE)) == 1
    assert len(hash_block_chain(list(range(32)), 16, NAMESPACE)) == 2
    # The partial tail never changes the full blocks' hashes.
    assert hash_block_chain(list(range(40)), 16, NAMESPACE) == hash_block_chain(
        list(range(32)), 16, NAMESPACE
    )
    assert hash_block_chain(list(range(40)), 16, NAMESPACE)[:1] == hash_block_chain(
        list(range(17)), 16, NAMESPACE
    )


def test_inputs_that_must_change_the_hash():
    tokens = list(range(32))
    base = hash_block_chain(tokens, 16, NAMESPACE)
    assert hash_block_chain(tokens, 16, "other-model") != base
    other_ns = hash_block_chain(tokens, 16, "other-model")
    assert not set(base) & set(other_ns)
    assert hash_block_chain(tokens, 16, NAMESPACE, extra=b"x") != base
    assert hash_block_chain(tokens, 16, NAMESPACE, extra=b"x") != hash_block_chain(
        tokens, 16, NAMESPACE, b"y"
    )
    # Swapping two tokens inside block 0 changes block 0 and, through the chain, block 1.
    swapped = [1, 0, *tokens[2:]]
    h = hash_block_chain(swapped, 16, NAMESPACE)
    assert h[0] != base[0] and h[1] != base[1]
    # Same tokens of block 1 under a different block 0: the chain keeps them apart.
    assert hash_block(base[0], tokens[16:]) == base[1]
    assert hash_block(h[0], tokens[16:]) != base[1]
    # Block order matters.
    assert hash_block_chain(tokens[16:] + tokens[:16], 16, NAMESPACE) != base
    # Count prefix keeps a block of one size apart from the same bytes split differently.
    assert (
        hash_block_chain(list(range(8)), 8, NAMESPACE) != hash_block_chain(list(range(8)), 4, NAMESPACE)[:1]
    )


def test_start_continuation_equals_full_recompute():
    tokens = [(i * 37) % 1000 for i in range(100)]
    full = hash_block_chain(tokens, 8, NAMESPACE)
    assert len(full) == 12
    for cut in range(0, 101, 3):
        head = hash_block_chain(tokens[:cut], 8, NAMESPACE)
        cont = hash_block_chain(tokens, 8, NAMESPACE, start=head)
        assert cont == full
    # Returns a new list; the caller's start is untouched.
    head = full[:2]
    assert hash_block_chain(tokens, 8, NAMESPACE, start=head) == full and len(head) == 2
    # Nothing new to hash: start comes back as is.
    assert hash_block_chain(tokens[:20], 8, NAMESPACE, start=full[:2]) == full[:2]


def test_digests_do_not_depend_on_python_hash_seed():
    # `import pdserve` is lazy: hashing loads with the standard library alone, no torch.
    code = (
        "from pdserve.hashing import hash_block_chain, root_hash\n"
        f"print(root_hash({NAMESPACE!r}).hex())\n"
        f"print(' '.join(h.hex() for h in hash_block_chain(list(range(40)), 16, {NAMESPACE!r})))\n"
        "print(hash('pdserve'))\n"
    )
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout.split("\n"))
    assert outs[0][2] != outs[1][2], "the two processes did not get different hash seeds"
    for lines in outs:
        assert lines[0] == PINNED_ROOT
        assert lines[1].split() == PINNED_CHAIN
