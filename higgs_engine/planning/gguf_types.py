"""llama.cpp's tensor types the GGUF allocator chooses from, as plain data (no llama.cpp, no torch).

Each type stores blocks of `block` consecutive values of a row in `block_bytes` bytes, so a row
of `cols` values takes cols / block * block_bytes bytes and is valid only when `block` divides
`cols` (llama.cpp refuses the type otherwise). The figures are ggml's (ggml_type_traits:
blck_size, type_size); tests/engine/test_gguf.py checks them against the library that is
installed.

The menu is every type llama.cpp quantizes without an importance matrix: the K-quants
Q2_K..Q6_K, the 32-value legacy types (what llama.cpp itself falls back to for rows that are not
a multiple of 256, e.g. hidden size 576 or 384), IQ4_NL, IQ4_XS and IQ3_S, Q8_0, and F16 (kept).
IQ3_XXS, IQ2_* and IQ1_* are left out: llama.cpp requires an importance matrix for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from higgs_engine.errors import InvalidConfigError

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUF_MENU",
    "GGUF_TYPES",
    "GgufType",
    "gguf_type",
    "max_menu_bits",
    "min_menu_bits",
    "uniform_type_for_bits",
]


@dataclass(frozen=True)
class GgufType:
    """One llama.cpp tensor type: its ggml id and block layout."""

    name: str
    ggml_id: int
    block: int  # values per block
    block_bytes: int  # bytes per block

    @property
    def bits(self) -> float:
        """Bits per value, every in-block scale and minimum counted."""
        return 8.0 * self.block_bytes / self.block

    @property
    def keep(self) -> bool:
        """Not quantized (F16 / F32)."""
        return self.block == 1

    @property
    def label(self) -> str:
        return self.name

    def fits(self, cols: int) -> bool:
        """Whether a row of `cols` values can be stored in this type."""
        return cols > 0 and cols % self.block == 0

    def row_bytes(self, cols: int) -> int:
        if not self.fits(cols):
            raise InvalidConfigError(
                f"a row of {cols} values cannot be stored as {self.name} (blocks of {self.block})"
            )
        return cols // self.block * self.block_bytes


# ggml's enum ggml_type ids and block layouts.
GGUF_TYPES: dict[str, GgufType] = {
    t.name: t
    for t in (
        GgufType("F32", 0, 1, 4),
        GgufType("F16", 1, 1, 2),
        GgufType("Q4_0", 2, 32, 18),
        GgufType("Q4_1", 3, 32, 20),
        GgufType("Q5_0", 6, 32, 22),
        GgufType("Q5_1", 7, 32, 24),
        GgufType("Q8_0", 8, 32, 34),
        GgufType("Q2_K", 10, 256, 84),
        GgufType("Q3_K", 11, 256, 110),
        GgufType("Q4_K", 12, 256, 144),
        GgufType("Q5_K", 13, 256, 176),
        GgufType("Q6_K", 14, 256, 210),
        GgufType("IQ4_NL", 20, 32, 18),
        GgufType("IQ3_S", 21, 256, 110),
        GgufType("IQ4_XS", 23, 256, 136),
        GgufType("BF16", 30, 1, 2),
    )
}

# The allocator's menu, cheapest first; ties in the DP go to the earlier entry.
GGUF_MENU: tuple[GgufType, ...] = tuple(
    sorted(
        (
            GGUF_TYPES[n]
            for n in (
                "Q2_K",
                "Q3_K",
                "IQ3_S",
                "IQ4_XS",
                "Q4_0",
                "IQ4_NL",
                "Q4_K",
                "Q4_1",
                "Q5_0",
                "Q5_K",
                "Q5_1",
                "Q6_K",
                "Q8_0",
                "F16",
            )
        ),
        key=lambda t: (t.bits, t.block != 256, t.name),
    )
)


def gguf_type(name: str) -> GgufType:
    """The type called `name` (case-insensitive), or InvalidConfigError naming the choices."""
    t = GGUF_TYPES.get(name.upper())
    if t is None:
        raise InvalidConfigError(
            f"unknown GGUF tensor type {name!r}; choose one of {sorted(GGUF_TYPES)}",
            field="gguf_type",
        )
    return t


def min_menu_bits() -> float:
    """Bits per value of the cheapest type on the menu (a lower bound on any GGUF target)."""
    return min(t.bits for t in GGUF_MENU)


def max_menu_bits() -> float:
    """Bits per value of the widest type on the menu (F16): no GGUF target is above it."""
    return max(t.bits for t in GGUF_MENU)


# `bits` targets on the GGUF path: the code bits people name map to the K-quant of that width
# (llama.cpp's own reading of "4-bit" is Q4_K); rows that the K-quant does not fit take the
# 32-value type llama.cpp itself falls back to.
_UNIFORM: tuple[tuple[float, str], ...] = (
    (2.0, "Q2_K"),
    (3.0, "Q3_K"),
    (4.0, "Q4_K"),
    (5.0, "Q5_K"),
    (6.0, "Q6_K"),
    (8.0, "Q8_0"),
    (16.0, "F16"),
)
FALLBACK: dict[str, str] = {
    "Q2_K": "Q4_0",
    "Q3_K": "Q4_0",
    "IQ3_S": "IQ4_NL",
    "IQ4_XS": "IQ4_NL",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}


def uniform_type_for_bits(bits: float) -> GgufType:
    """The type a uniform `bits` target means: the widest of Q2_K..Q6_K, Q8_0, F16 whose nominal
    width is at most `bits`; InvalidConfigError (field "bits") below Q2_K or above F16."""
    if bits > _UNIFORM[-1][0] + 1e-9:
        raise InvalidConfigError(
            f"bits={bits:g} is above the widest GGUF type (F16, 16 bits)", field="bits"
        )
    best = None
    for width, name in _UNIFORM:
        if width <= bits + 1e-9:
            best = name
    if best is None:
        raise InvalidConfigError(
            f"bits={bits:g} is below the smallest GGUF type (Q2_K, 2 code bits)", field="bits"
        )
    return GGUF_TYPES[best]


def type_for_row(t: GgufType, cols: int) -> GgufType:
    """`t`, or llama.cpp's fallback for it when a row of `cols` values does not fit; F16 last."""
    seen = t
    while not seen.fits(cols):
        nxt = FALLBACK.get(seen.name)
        if nxt is None:
            return GGUF_TYPES["F16"]
        seen = GGUF_TYPES[nxt]
    return seen


def _architectures() -> frozenset[str]:
    data = json.loads(
        (Path(__file__).resolve().parents[1] / "data" / "gguf_architectures.json").read_text()
    )
    return frozenset(data["architectures"])


# The Hugging Face architectures llama.cpp's converter (of the pinned llama-cpp-python) knows,
# shipped as data so that the API checks a gguf request without llama.cpp; a test compares it
# with the installed converter.
GGUF_ARCHITECTURES: frozenset[str] = _architectures()
