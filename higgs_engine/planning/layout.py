"""Power-of-two block layouts of a row (pure Python, no torch).

Kept apart from higgs_engine.hadamard so that size arithmetic (the allocator's costs, the
service's plans) works in processes without torch; hadamard re-exports `block_layout`.
"""

from __future__ import annotations

from higgs_engine.errors import InvalidConfigError

__all__ = ["block_layout", "is_power_of_two"]


def is_power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def block_layout(in_features: int, max_block: int = 1024) -> list[int]:
    """Power-of-two block sizes, largest first, that sum to `in_features` (no padding)."""
    if not isinstance(in_features, int) or in_features <= 0:
        raise InvalidConfigError(f"in_features={in_features!r} must be a positive integer")
    if not isinstance(max_block, int) or not is_power_of_two(max_block):
        raise InvalidConfigError(f"rotation block {max_block!r} must be a power of two")
    layout = [max_block] * (in_features // max_block)
    rest = in_features % max_block
    bit = max_block >> 1
    while rest:
        if rest & bit:
            layout.append(bit)
            rest -= bit
        bit >>= 1
    return layout
