"""The per-layer schemes of the compressed-tensors format that vLLM's kernels run, as plain data.

vLLM reads a compressed-tensors checkpoint layer by layer (its CompressedTensorsConfig matches
each Linear to a config group) and picks a kernel for the layer's scheme and shape. The menu
here is what it runs for a dense Linear on CUDA, data-free (no calibration):

- `w4a16-g{32,64,128}`: int4 weights, one scale per group of 32/64/128 input values, symmetric
  (vLLM's CompressedTensorsWNA16, weight type uint4b8; Marlin's group sizes are -1, 32, 64 and
  128, and a group must not straddle the input dimension: `group_size` divides `in_features`).
  Stored by compressed-tensors' pack-quantized compressor (8 codes per int32).
- `w4a16-asym-g{32,64,128}` (ASYMMETRIC, off the menu): the same with a zero point per group
  (uint4 with zero points, which CompressedTensorsWNA16 runs for 4 and 8 bits; the zero points
  are packed along the output dimension). transformers cannot load those packed zero points
  (below), so no such checkpoint can be checked here and the menu leaves them out.
- `w8a16`: int8 weights, one scale per output channel, symmetric (CompressedTensorsWNA16 with 8
  bits, uint8b128; vLLM takes weight-only int schemes only in the pack-quantized format).
- `fp8-dynamic`: FP8 (e4m3) weights with one scale per output channel, activations quantized to
  FP8 per token at run time (CompressedTensorsW8A8Fp8; GPUs without FP8 run the weights through
  Marlin as W8A16). The FP8 GEMMs need both dimensions to be multiples of 16. Stored by the
  float-quantized compressor.
- `keep`: the layer stays 16-bit and is listed in the config's `ignore`.

Bits count every stored tensor of the layer: the packed codes, every scale (in the checkpoint's
16-bit dtype), every packed zero point and the pack-quantized `weight_shape` (two int64).
NVFP4 is left out for now: its weight-only form needs a global scale per tensor and FP8 group
scales, which this menu does not quantize yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from higgs_engine.errors import InvalidConfigError

__all__ = [
    "ASYMMETRIC",
    "CT_MENU",
    "GROUP_SIZES",
    "KEEP",
    "CtScheme",
    "ct_scheme",
    "scheme_menu",
    "uniform_scheme",
]

GROUP_SIZES = (32, 64, 128)  # Marlin's group sizes (besides per channel)
_FP8_MULTIPLE = 16  # CUTLASS / torch._scaled_mm FP8 GEMMs: both dimensions multiples of 16
_SHAPE_BITS = 2 * 64  # pack-quantized weight_shape: two int64


@dataclass(frozen=True)
class CtScheme:
    """One layer scheme: the weights' type and grouping, and whether activations are FP8."""

    name: str
    weight_type: str  # "int", "float" or "keep"
    num_bits: int  # 4 or 8; 16 when kept
    group_size: int | None = None  # None: one scale per output channel
    symmetric: bool = True
    fp8_activations: bool = False  # dynamic per-token FP8 activations

    @property
    def keep(self) -> bool:
        return self.weight_type == "keep"

    @property
    def label(self) -> str:
        return self.name

    @property
    def format(self) -> str:
        """The compressed-tensors compression format (the compressor that writes the layer)."""
        if self.keep:
            return "dense"
        return "pack-quantized" if self.weight_type == "int" else "float-quantized"

    def groups(self, in_features: int) -> int:
        """Scales (and zero points) per output row."""
        return 1 if self.group_size is None else in_features // self.group_size

    def unfit_reason(self, out_features: int, in_features: int) -> str | None:
        """Why vLLM runs no kernel for this scheme on an (out x in) layer; None when it does."""
        if out_features <= 0 or in_features <= 0:
            return f"layer shape ({out_features}, {in_features}) is not positive"
        if self.group_size is not None and in_features % self.group_size:
            return (
                f"in_features={in_features} is not a multiple of the group size "
                f"{self.group_size} (a group may not straddle the input dimension)"
            )
        if self.weight_type == "float" and (
            in_features % _FP8_MULTIPLE or out_features % _FP8_MULTIPLE
        ):
            return (
                f"FP8 GEMMs need both dimensions multiples of {_FP8_MULTIPLE}; the layer is "
                f"({out_features}, {in_features})"
            )
        return None

    def layer_bits(self, out_features: int, in_features: int, scale_bits: int = 16) -> int:
        """Bits the layer occupies in the checkpoint with this scheme, every tensor counted
        (a kept layer: `scale_bits`, the checkpoint's float width, per weight)."""
        reason = self.unfit_reason(out_features, in_features)
        if reason is not None:
            raise InvalidConfigError(f"scheme {self.name}: {reason}")
        numel = out_features * in_features
        if self.keep:
            return scale_bits * numel
        groups = self.groups(in_features)
        scales = scale_bits * out_features * groups
        if self.weight_type == "float":
            return 8 * numel + scales
        packed = 32 * out_features * math.ceil(in_features * self.num_bits / 32)
        zeros = 0 if self.symmetric else 32 * math.ceil(out_features * self.num_bits / 32) * groups
        return packed + scales + zeros + _SHAPE_BITS


KEEP = CtScheme("keep", "keep", 16)

CT_MENU: tuple[CtScheme, ...] = (
    KEEP,
    *(CtScheme(f"w4a16-g{g}", "int", 4, g) for g in GROUP_SIZES),
    CtScheme("w8a16", "int", 8),
    CtScheme("fp8-dynamic", "float", 8, fp8_activations=True),
)
# Written as vLLM reads them, but off the menu: transformers (5.24, with compressed-tensors
# 0.20) cannot load pack-quantized zero points (it expects them unpacked, (out, groups), while
# the library's compressor packs them along the output dimension as vLLM expects), so such a
# checkpoint could not be checked here by loading it.
ASYMMETRIC: tuple[CtScheme, ...] = tuple(
    CtScheme(f"w4a16-asym-g{g}", "int", 4, g, symmetric=False) for g in GROUP_SIZES
)
_BY_NAME = {s.name: s for s in (*CT_MENU, *ASYMMETRIC)}


def ct_scheme(name: str) -> CtScheme:
    """The menu's scheme called `name` (InvalidConfigError naming it when unknown)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise InvalidConfigError(
            f"compressed-tensors scheme {name!r} is not one of {sorted(_BY_NAME)}"
        ) from None


def scheme_menu(
    out_features: int, in_features: int, menu: tuple[CtScheme, ...] = CT_MENU
) -> tuple[list[CtScheme], dict[str, str]]:
    """The schemes vLLM runs for an (out x in) Linear, and {scheme: why not} for the others."""
    allowed: list[CtScheme] = []
    refused: dict[str, str] = {}
    for s in menu:
        reason = s.unfit_reason(out_features, in_features)
        if reason is None:
            allowed.append(s)
        else:
            refused[s.name] = reason
    return allowed, refused


def uniform_scheme(bits: int, out_features: int, in_features: int) -> tuple[CtScheme, str | None]:
    """The usual one-scheme recipe for `bits`: 4 -> symmetric int4 with group 128 where the
    width allows it, else the largest of 64 and 32 that divides it (W4A16); 8 -> int8 per
    channel (W8A16). Returns (scheme, None), or (KEEP, why) when no group size fits."""
    if bits == 8:
        return _BY_NAME["w8a16"], None
    if bits != 4:
        raise InvalidConfigError(
            f"bits={bits} has no uniform compressed-tensors scheme (4 or 8)", field="bits"
        )
    for g in sorted(GROUP_SIZES, reverse=True):
        s = _BY_NAME[f"w4a16-g{g}"]
        if s.unfit_reason(out_features, in_features) is None:
            return s, None
    return KEEP, (
        f"in_features={in_features} is not a multiple of any int4 group size "
        f"{list(GROUP_SIZES)}: kept 16-bit"
    )
