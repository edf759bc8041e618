"""Small maths with one home."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` (``cdiv(0, b) == 0``)."""
    return -(-a // b)
