"""Codes and scales of one layer for a compressed-tensors scheme, scales chosen by MSE search.

The usual data-free recipe (compressed-tensors' min-max observer) sets each group's scale from
its largest magnitude, so the extreme value is exact and every other value pays for it. As
HIGGS does for its grids (higgs_engine.quantize, the "mse" scale rules), the scale here is the
min-max scale times the multiplier m in MULTIPLIERS with the least squared error of the group's
reconstruction (m < 1 clips the extremes to code the bulk more finely). Candidates are scored
with the scale rounded to the checkpoint's dtype, as it is stored.

Codes follow compressed-tensors' conventions exactly, so that its compressors store them and its
decompression gives back our dequantized weight bit for bit:
- int, symmetric: q = clamp(round(w / s), -2^(b-1), 2^(b-1) - 1), w_hat = q * s;
- int, asymmetric: q = clamp(round(w / s + z), same range), z in that range, w_hat = (q - z) s;
- float (FP8 e4m3): q = float8(clamp(w / s, -448, 448)), w_hat = q * s;
with w_hat computed in the scale's dtype, as compressed-tensors dequantizes.

`quantize_layer` is the fast path (every candidate scored on whole row blocks at once);
`quantize_layer_reference` is its slow twin (one group at a time, float64 scores), and the tests
check that both choose the same scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from higgs_engine.ct.schemes import CtScheme
from higgs_engine.errors import InvalidConfigError

__all__ = [
    "FP8_MAX",
    "MULTIPLIERS",
    "CtQuantized",
    "best_scales",
    "check_layer",
    "dequant_grouped",
    "dequantize",
    "fp8_per_token",
    "group_codes",
    "quantize_layer",
    "quantize_layer_reference",
    "relative_error",
]

# Multipliers of the min-max scale tried per group: 0.50, 0.525, ..., 1.0 (1.0 is min-max).
MULTIPLIERS: tuple[float, ...] = tuple(0.5 + 0.025 * i for i in range(21))
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_BLOCK_VALUES = 1 << 21  # values scored at once by the fast path (bounds its scratch memory)


@dataclass(frozen=True)
class CtQuantized:
    """One layer in a scheme: codes (out, in) int8 (int schemes) or float8_e4m3fn, scales
    (out, groups) in the checkpoint dtype, zero points (out, groups) int8 when asymmetric."""

    scheme: CtScheme
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None


def _qrange(scheme: CtScheme) -> tuple[float, float]:
    if scheme.weight_type == "float":
        return -FP8_MAX, FP8_MAX
    half = float(2 ** (scheme.num_bits - 1))
    return -half, half - 1


def _grouped(w: torch.Tensor, scheme: CtScheme) -> torch.Tensor:
    """(out, in) -> (out, groups, group values) float32."""
    out_f, in_f = w.shape
    return w.to(torch.float32).reshape(out_f, scheme.groups(in_f), -1)


def _base_range(wg: torch.Tensor, scheme: CtScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max (lo, hi) of each group, 0 included (zero must be representable): (out, groups)."""
    lo = wg.amin(-1).clamp(max=0.0)
    hi = wg.amax(-1).clamp(min=0.0)
    if scheme.symmetric:
        m = torch.maximum(-lo, hi)
        return -m, m
    return lo, hi


def _scale_for(
    lo: torch.Tensor, hi: torch.Tensor, m: float, scheme: CtScheme, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (as stored, in `dtype`) and zero point (float, integral) for multiplier m."""
    qmin, qmax = _qrange(scheme)
    if scheme.weight_type == "float":
        s = hi * m / FP8_MAX
    elif scheme.symmetric:
        s = hi * m / ((qmax - qmin) / 2)  # compressed-tensors' symmetric min-max: max / 7.5
    else:
        s = (hi - lo) * m / (qmax - qmin)
    s = s.to(dtype)
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale codes it
    if scheme.symmetric:
        return s, None
    z = torch.clamp(torch.round(qmin - lo * m / s.to(torch.float32)), qmin, qmax)
    return s, z


def group_codes(
    wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, scheme: CtScheme
) -> torch.Tensor:
    """Codes as float32 values (out, groups, g) of grouped weights for scales s (out, groups)."""
    qmin, qmax = _qrange(scheme)
    x = wg / s.to(torch.float32)[..., None]
    if scheme.weight_type == "float":
        return x.clamp(qmin, qmax).to(torch.float8_e4m3fn).to(torch.float32)
    if z is not None:
        x = x + z[..., None]
    return torch.clamp(torch.round(x), qmin, qmax)


def dequant_grouped(
    q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """w_hat (out, groups, g) in `dtype`, computed as compressed-tensors dequantizes."""
    v = q.to(dtype)
    if z is not None:
        v = v - z.to(dtype)[..., None]
    return v * s.to(dtype)[..., None]


_ROUND = 12582912.0  # 1.5 * 2^23: x + R - R rounds a float32 |x| < 2^22 to the nearest even


def _score(
    wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, scheme: CtScheme
) -> torch.Tensor:
    """Squared error (rows, groups) of each group with scale s and zero point z, in float32
    throughout and in place (the hot loop: a scale's w_hat as float32 q * s, which can differ
    from the stored dtype's product in its last bit; the chosen scale is dequantized exactly)."""
    qmin, qmax = _qrange(scheme)
    sf = s.to(torch.float32)[..., None]
    x = wg / sf
    if scheme.weight_type == "float":
        x = x.clamp_(qmin, qmax).to(torch.float8_e4m3fn).to(torch.float32)
    else:
        if z is not None:
            x.add_(z[..., None])
        # clamping to integer bounds first rounds the same; then round half to even
        x.clamp_(qmin, qmax).add_(_ROUND).sub_(_ROUND)
        if z is not None:
            x.sub_(z[..., None])
    return x.mul_(sf).sub_(wg).square_().sum(-1)


def best_scales(
    wg: torch.Tensor, scheme: CtScheme, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MSE-best (scale, zero point) of every group of wg (rows, groups, g)."""
    lo, hi = _base_range(wg, scheme)
    best_err = torch.full(lo.shape, torch.inf)
    best_s = torch.ones(lo.shape, dtype=dtype)
    best_z: torch.Tensor | None = None if scheme.symmetric else torch.zeros(lo.shape)
    for m in MULTIPLIERS:
        s, z = _scale_for(lo, hi, m, scheme, dtype)
        err = _score(wg, s, z, scheme)
        better = err < best_err  # strict: ties keep the earlier (smaller) multiplier
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        if best_z is not None and z is not None:
            best_z = torch.where(better, z, best_z)
    return best_s, best_z


def _finish(
    wg: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor | None,
    scheme: CtScheme,
) -> CtQuantized:
    q = group_codes(wg, s, z, scheme).flatten(1)
    codes = q.to(torch.float8_e4m3fn) if scheme.weight_type == "float" else q.to(torch.int8)
    zp = None if z is None else z.to(torch.int8)
    return CtQuantized(scheme, codes, s, zp)


def check_layer(w: torch.Tensor, scheme: CtScheme) -> None:
    if scheme.keep:
        raise InvalidConfigError("a kept layer has no codes: scheme 'keep' is not quantized")
    if w.dim() != 2:
        raise InvalidConfigError(f"weight of shape {tuple(w.shape)} is not a matrix")
    # only the grouping binds the quantizer (rows may be a sample of a layer's); whether vLLM
    # runs the scheme on the whole layer is the caller's check (CtScheme.unfit_reason)
    if scheme.group_size is not None and int(w.shape[1]) % scheme.group_size:
        raise InvalidConfigError(
            f"scheme {scheme.name}: in_features={int(w.shape[1])} is not a multiple of the "
            f"group size {scheme.group_size}"
        )
    if not torch.isfinite(w).all():
        raise InvalidConfigError("weight has NaN or infinite values")


def quantize_layer(
    w: torch.Tensor, scheme: CtScheme, dtype: torch.dtype = torch.float16
) -> CtQuantized:
    """Codes, scales (in `dtype`) and zero points of the (out, in) weight `w` in `scheme`,
    each group's scale the MSE-best of MULTIPLIERS (ties: the smaller multiplier)."""
    check_layer(w, scheme)
    wg = _grouped(w, scheme)  # (out, groups, g)
    rows_per_block = max(1, _BLOCK_VALUES // max(1, wg.shape[1] * wg.shape[2]))
    scales, zeros = [], []
    for start in range(0, wg.shape[0], rows_per_block):
        s, z = best_scales(wg[start : start + rows_per_block], scheme, dtype)
        scales.append(s)
        if z is not None:
            zeros.append(z)
    s_all = torch.cat(scales)
    z_all = torch.cat(zeros) if zeros else None
    return _finish(wg, s_all, z_all, scheme)


def quantize_layer_reference(
    w: torch.Tensor, scheme: CtScheme, dtype: torch.dtype = torch.float16
) -> CtQuantized:
    """Slow twin of `quantize_layer`: each group on its own, its candidates scored in float64."""
    check_layer(w, scheme)
    wg = _grouped(w, scheme)
    out_f, n_groups, _ = wg.shape
    s_all = torch.ones(out_f, n_groups, dtype=dtype)
    z_all = None if scheme.symmetric else torch.zeros(out_f, n_groups)
    for r in range(out_f):
        for g in range(n_groups):
            one = wg[r : r + 1, g : g + 1]  # (1, 1, g)
            lo, hi = _base_range(one, scheme)
            best = float("inf")
            for m in MULTIPLIERS:
                s, z = _scale_for(lo, hi, m, scheme, dtype)
                q = group_codes(one, s, z, scheme)
                w_hat = dequant_grouped(q, s, z, dtype).to(torch.float64)
                err = float((w_hat - one.to(torch.float64)).square().sum())
                if err < best:
                    best = err
                    s_all[r, g] = s[0, 0]
                    if z_all is not None and z is not None:
                        z_all[r, g] = z[0, 0]
    return _finish(wg, s_all, z_all, scheme)


def dequantize(q: CtQuantized) -> torch.Tensor:
    """The (out, in) weight the checkpoint holds, in the scales' dtype, computed as
    compressed-tensors' decompression computes it."""
    out_f = q.codes.shape[0]
    groups = q.scale.shape[1]
    codes = q.codes.reshape(out_f, groups, -1)
    z = None if q.zero_point is None else q.zero_point
    return dequant_grouped(codes, q.scale, z, q.scale.dtype).reshape(q.codes.shape)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """t^2 = ||w_hat - w||^2 / ||w||^2 in float64 (0 for an all-zero weight)."""
    w64 = w.to(torch.float64)
    energy = float(w64.square().sum())
    if energy == 0.0:
        return 0.0
    return float((w_hat.to(torch.float64) - w64).square().sum()) / energy


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """What the `fp8-dynamic` scheme does to a layer's input at run time: each token's vector
    (last dimension) scaled by its largest magnitude / 448, rounded to FP8 e4m3 and scaled back,
    in x's dtype (an all-zero token stays zero)."""
    amax = x.abs().amax(-1, keepdim=True)
    s = amax / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * s
