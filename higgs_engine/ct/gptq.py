"""Calibrated compressed-tensors: GPTQ in one of vLLM's symmetric schemes, with MSE-searched
scales, for one linear layer W (out, in) and the Hessian 2 X^T X / tokens of its inputs.

Columns are quantized in the scheme's own grid (int4 / int8 codes, or FP8 values, times the
group's scale in the checkpoint dtype), and each column's rounding error is pushed onto the
columns not yet quantized through the upper Cholesky factor U of the damped inverse Hessian
(higgs_engine.gptq, the same sweep and lazy block updates as calibrated HIGGS). The order and
the scales:
- `act_order=True` (what calibrated jobs run): columns by falling Hessian diagonal
  (`activation_order`), every group's scale the MSE-best of the original weights, fixed before
  the sweep; the codes keep the layer's column positions, so the stored groups are contiguous
  as in the data-free layer;
- `act_order=False`: left to right; a grouped scheme's scale is searched when the sweep
  reaches the group, on its columns as updated so far; a per-channel scheme's (int8, FP8) is
  the row's MSE-best of the original weights.

The result is an ordinary `CtQuantized` in the scheme: the writer stores it with the library's
compressor, and its decompression is our `dequantize` exactly, as for data-free layers.
`gptq_layer_reference` is the slow twin: float64, no Cholesky, no lazy batching, the explicit
optimal-brain-quantizer update with the inverse Hessian of the remaining columns.
Asymmetric schemes are not on the menu (docs/algorithm.md section 8) and are refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from higgs_engine.ct.quantizer import (
    CtQuantized,
    best_scales,
    check_layer,
    dequant_grouped,
    group_codes,
)
from higgs_engine.ct.schemes import CtScheme
from higgs_engine.errors import InvalidConfigError
from higgs_engine.gptq import (
    DEFAULT_BLOCK,
    DEFAULT_DAMP,
    check_hessian,
    inverse_cholesky_upper,
    prepare_hessian,
    sweep_with_writeback,
)

__all__ = ["activation_order", "gptq_layer", "gptq_layer_reference"]


def _setup(w: torch.Tensor, hessian: torch.Tensor, scheme: CtScheme) -> int:
    """Checks; the group length the sweep sets scales for (the row for per-channel)."""
    check_layer(w, scheme)
    if not scheme.symmetric:
        raise InvalidConfigError(
            f"scheme {scheme.name}: calibrated compressed-tensors takes symmetric schemes only"
        )
    check_hessian(hessian, int(w.shape[1]))
    return int(scheme.group_size or w.shape[1])


class _Columns:
    """The column quantizer of one sweep: the scale of a column's group (searched when the
    sweep reaches a grouped scheme's group, fixed for a per-channel one), its code and the
    value the checkpoint decompresses to (float32).

    `W` is the sweep's working matrix. With `order` (its column j is the layer's column
    order[j]: activation order), every group's scale is fixed before the sweep from the layer's
    `original` weight (a group's columns are no longer swept together), and codes land at the
    layer's own column positions."""

    def __init__(
        self,
        W: torch.Tensor,
        scheme: CtScheme,
        dtype: torch.dtype,
        g: int,
        order: torch.Tensor | None = None,
        original: torch.Tensor | None = None,
    ) -> None:
        out_f, in_f = W.shape
        self.W, self.scheme, self.dtype, self.g = W, scheme, dtype, g
        self.order = order
        self.scales = torch.ones(out_f, in_f // g, dtype=dtype)
        self.codes = torch.empty(out_f, in_f, dtype=torch.float32)
        self.per_group = scheme.group_size is not None and order is None
        if not self.per_group:  # scales from the original weights, before the sweep
            src = W if original is None else original
            grouped = src.to(torch.float32).reshape(out_f, in_f // g, g)
            self.scales, _ = best_scales(grouped, scheme, dtype)

    def __call__(self, j: int, col: torch.Tensor) -> torch.Tensor:
        at = j if self.order is None else int(self.order[j])  # the layer's column
        gi = at // self.g
        if self.per_group and j % self.g == 0:
            grp = self.W[:, j : j + self.g].to(torch.float32)[:, None, :]  # updated columns
            s, _ = best_scales(grp, self.scheme, self.dtype)
            self.scales[:, gi : gi + 1] = s
        s = self.scales[:, gi : gi + 1]  # (out, 1)
        q = group_codes(col.to(torch.float32)[:, None, :], s, None, self.scheme)  # (out, 1, 1)
        self.codes[:, at : at + 1] = q[:, :, 0]
        v = dequant_grouped(q, s, None, self.dtype).to(torch.float32)
        return v[:, :, 0].to(col.dtype)

    def result(self) -> CtQuantized:
        codes = (
            self.codes.to(torch.float8_e4m3fn)
            if self.scheme.weight_type == "float"
            else self.codes.to(torch.int8)
        )
        return CtQuantized(self.scheme, codes, self.scales, None)


def activation_order(hessian: torch.Tensor) -> torch.Tensor:
    """The columns by falling Hessian diagonal (the inputs' mean square: the largest first;
    ties keep the layer's order)."""
    return torch.argsort(torch.diagonal(hessian), descending=True, stable=True)


def _ordered(
    w: torch.Tensor, hessian: torch.Tensor, act_order: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the weight and the Hessian in the sweep's column order, that order or None)."""
    if not act_order:
        return w, hessian, None
    perm = activation_order(hessian)
    return w[:, perm], hessian[perm][:, perm], perm


def gptq_layer(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scheme: CtScheme,
    dtype: torch.dtype = torch.float16,
    *,
    damp: float = DEFAULT_DAMP,
    block: int = DEFAULT_BLOCK,
    precision: torch.dtype = torch.float32,
    act_order: bool = False,
) -> CtQuantized:
    """GPTQ of the (out, in) weight `w` in `scheme` (symmetric) with the inputs' Hessian
    (in, in): codes and scales (in `dtype`) as data-free `quantize_layer` returns them.
    `precision`: the sweep's arithmetic (float32 as GPTQ runs it; float64 for the tests).
    `act_order`: sweep the columns in `activation_order`, every group's scale fixed first."""
    g = _setup(w, hessian, scheme)
    if scheme.group_size is not None and block % g and g % block:
        raise InvalidConfigError(f"block={block} and group size {g} must nest")
    ws, hs, order = _ordered(w, hessian, act_order)
    U = inverse_cholesky_upper(prepare_hessian(hs, damp), precision)
    W = ws.to(precision).clone()
    cols = _Columns(W, scheme, dtype, g, order, w)
    sweep_with_writeback(W, U, block, cols)
    return cols.result()


def gptq_layer_reference(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scheme: CtScheme,
    dtype: torch.dtype = torch.float16,
    *,
    damp: float = DEFAULT_DAMP,
    act_order: bool = False,
) -> CtQuantized:
    """Slow twin of `gptq_layer` (float64): after column j, every remaining column is corrected
    by W_R -= (w_j - q_j) Hinv_jR / Hinv_jj, and Hinv becomes the inverse Hessian of the
    remaining columns, Hinv_RR - Hinv_Rj Hinv_jR / Hinv_jj."""
    g = _setup(w, hessian, scheme)
    ws, hs, order = _ordered(w, hessian, act_order)
    hinv = torch.linalg.inv(prepare_hessian(hs, damp))  # (in, in) float64
    W = ws.to(torch.float64).clone()
    cols = _Columns(W, scheme, dtype, g, order, w)
    step: Callable[[int, torch.Tensor], torch.Tensor] = cols
    for j in range(int(W.shape[1])):
        col = W[:, j : j + 1].clone()
        d = col - step(j, col)  # (out, 1)
        W[:, j + 1 :] -= d @ (hinv[:1, 1:] / hinv[0, 0])
        hinv = hinv[1:, 1:] - hinv[1:, :1] @ hinv[:1, 1:] / hinv[0, 0]
    return cols.result()
