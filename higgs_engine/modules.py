"""HiggsLinear: a linear layer that computes with HIGGS codes instead of a dense weight.

Forward (pure torch, CPU or CUDA):
    w_rot = s * grid[codes]               # (out, in) rotated-basis weights, built per call
    y = higgs_matmul(x, q, w_rot) + bias  # rotates x block by block (x' = H D x), x' @ w_rot^T
The dense weight W is never materialised or stored; the inverse rotation is never applied.

The packed codes are unpacked once, at construction, into a code-index buffer on the module's
device (uint8 for n <= 256, which is exactly as large as the packed stream for p=2 n=256;
int16 above). Building w_rot from the indices is a gather, which works on any device, whereas
the bit unpacker runs on CPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from higgs_engine.grids import get_grid
from higgs_engine.packing import unpack_codes
from higgs_engine.quantize import QuantizedMatrix, dequantize_matrix, higgs_matmul

# Buffers whose dtype must survive model.to(dtype) / .half(): the stored format.
_FIXED = ("codes", "scales", "grid", "code_index", "group_index")


class HiggsLinear(nn.Module):
    """Drop-in replacement of nn.Linear (or GPT-2's Conv1D) holding a QuantizedMatrix.

    Buffers: `codes` (packed uint8) and `scales` (fp16) are the stored tensors; `grid`
    (n, p) float32, `code_index` (out, in/p) and `group_index` (in,) are derived and not saved
    in the state dict. All follow `.to(device)` but keep their dtype under `.to(dtype)`, so a
    loaded artifact can be written back bit-exactly. The bias follows the model dtype.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    grid: torch.Tensor
    code_index: torch.Tensor
    group_index: torch.Tensor

    def __init__(
        self, q: QuantizedMatrix, bias: torch.Tensor | None = None, grid: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        q.validate()
        self.in_features = int(q.in_features)
        self.out_features = int(q.out_features)
        self._meta = q.meta()
        # Metadata only (layout, signs seed, shapes): the tensors live in the buffers below.
        self._template = replace(
            q, codes=torch.empty(0, dtype=torch.uint8), scales=torch.empty(0, dtype=torch.float16)
        )
        g = get_grid(q.p, q.n) if grid is None else grid
        if tuple(g.shape) != (q.n, q.p):
            raise ValueError(f"grid of shape {tuple(g.shape)} is not ({q.n}, {q.p})")
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)
        self.register_buffer("grid", g.to(torch.float32), persistent=False)
        idx = unpack_codes(q.codes.cpu(), q.bits, q.num_codes)
        idx_dtype = torch.uint8 if q.n <= 256 else torch.int16
        idx = idx.to(idx_dtype).reshape(q.out_features, q.in_features // q.p)
        self.register_buffer("code_index", idx.to(q.codes.device), persistent=False)
        gidx = torch.repeat_interleave(
            torch.arange(len(q.group_lens)), torch.tensor(q.group_lens)
        )  # (in,): scale group of each input column
        self.register_buffer("group_index", gidx.to(q.codes.device), persistent=False)
        self.bias = (
            nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        )

    @property
    def quantized(self) -> QuantizedMatrix:
        """The QuantizedMatrix with this module's current tensors."""
        return replace(self._template, codes=self.codes, scales=self.scales)

    def rotated_weight(self) -> torch.Tensor:
        """s * grid[codes]: (out, in) float32 on the module's device, rotated basis."""
        w = self.grid[self.code_index.long()]  # (out, in/p, p)
        w = w.reshape(self.out_features, self.in_features)  # (out, in)
        return w * self.scales.to(torch.float32)[:, self.group_index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = higgs_matmul(x, self._template, w_rot=self.rotated_weight())  # (..., out)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def dequantized_weight(self) -> torch.Tensor:
        """The dense (out, in) float32 weight this layer represents (checks, not inference)."""
        q = replace(self._template, codes=self.codes.cpu(), scales=self.scales.cpu())
        return dequantize_matrix(q, grid=self.grid.cpu())

    def _apply(self, fn: Any, recurse: bool = True) -> HiggsLinear:
        # Let nn.Module move everything, then restore the fixed buffers' dtypes: a model-wide
        # .half() / .to(bfloat16) must not round the fp16 scales or the float32 grid.
        saved = {n: self._buffers[n] for n in _FIXED}
        super()._apply(fn, recurse)
        for n, old in saved.items():
            moved = self._buffers[n]
            if old is not None and moved is not None:
                self._buffers[n] = old.to(moved.device)
        return self

    def extra_repr(self) -> str:
        m = self._meta
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, p={m['p']}, "
            f"n={m['n']}, group_size={m['group_size']}, layout={m['layout']}, "
            f"bias={self.bias is not None}"
        )


__all__ = ["HiggsLinear"]
