"""HiggsLinear: a linear layer that computes with HIGGS codes instead of a dense weight;
HiggsEmbedding: a token embedding looked up from HIGGS codes (scope "all").

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
from higgs_engine.hadamard import unrotate
from higgs_engine.packing import unpack_codes
from higgs_engine.quantize import QuantizedMatrix, dequantize_matrix, higgs_matmul

# Buffers whose dtype must survive model.to(dtype) / .half(): the stored format.
_FIXED = ("codes", "scales", "grid", "code_index", "group_index")


class _HiggsCodes(nn.Module):
    """The buffers of a QuantizedMatrix held by a module: `codes` (packed uint8) and `scales`
    (fp16) are the stored tensors; `grid` (n, p) float32, `code_index` (out, in/p) and
    `group_index` (in,) are derived and not saved in the state dict. All follow `.to(device)`
    but keep their dtype under `.to(dtype)`, so a loaded artifact can be written back
    bit-exactly."""

    codes: torch.Tensor
    scales: torch.Tensor
    grid: torch.Tensor
    code_index: torch.Tensor
    group_index: torch.Tensor

    def __init__(self, q: QuantizedMatrix, grid: torch.Tensor | None = None) -> None:
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

    @property
    def quantized(self) -> QuantizedMatrix:
        """The QuantizedMatrix with this module's current tensors."""
        return replace(self._template, codes=self.codes, scales=self.scales)

    def rotated_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """s * grid[codes] of the given rows (a 1-D index tensor): (len(rows), in) float32 on
        the module's device, rotated basis."""
        w = self.grid[self.code_index[rows].long()]  # (r, in/p, p)
        w = w.reshape(rows.shape[0], self.in_features)  # (r, in)
        return w * self.scales[rows].to(torch.float32)[:, self.group_index]

    def rotated_weight(self) -> torch.Tensor:
        """s * grid[codes]: (out, in) float32 on the module's device, rotated basis."""
        w = self.grid[self.code_index.long()]  # (out, in/p, p)
        w = w.reshape(self.out_features, self.in_features)  # (out, in)
        return w * self.scales.to(torch.float32)[:, self.group_index]

    def dequantized_weight(self) -> torch.Tensor:
        """The dense (out, in) float32 weight this module represents (checks, not inference)."""
        q = replace(self._template, codes=self.codes.cpu(), scales=self.scales.cpu())
        return dequantize_matrix(q, grid=self.grid.cpu())

    def _apply(self, fn: Any, recurse: bool = True) -> _HiggsCodes:
        # Let nn.Module move everything, then restore the fixed buffers' dtypes: a model-wide
        # .half() / .to(bfloat16) must not round the fp16 scales or the float32 grid.
        saved = {n: self._buffers[n] for n in _FIXED}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for n, old in saved.items():
            moved = self._buffers[n]
            if old is not None and moved is not None:
                self._buffers[n] = old.to(moved.device)
        return self


class HiggsLinear(_HiggsCodes):
    """Drop-in replacement of nn.Linear (or GPT-2's Conv1D) holding a QuantizedMatrix.

    Buffers as `_HiggsCodes`. The bias follows the model dtype. `tied_to`: the module name of
    the quantized token embedding whose codes this output head shares (a tied head, stored
    once as the embedding), else None.
    """

    def __init__(
        self,
        q: QuantizedMatrix,
        bias: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
        *,
        tied_to: str | None = None,
    ) -> None:
        super().__init__(q, grid)
        self.tied_to = tied_to
        self.bias = (
            nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = higgs_matmul(x, self._template, w_rot=self.rotated_weight())  # (..., out)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        m = self._meta
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, p={m['p']}, "
            f"n={m['n']}, group_size={m['group_size']}, layout={m['layout']}, "
            f"bias={self.bias is not None}"
        )


class HiggsEmbedding(_HiggsCodes):
    """Drop-in replacement of a token nn.Embedding of (vocab, hidden) quantized as a matrix
    whose rows are tokens (the rotation runs along the hidden dimension, so rows are
    independent): a lookup dequantizes only the rows of the ids asked for,
    D Hn (s * grid[codes]) row by row. The output takes the model's dtype (`dtype_probe`, an
    empty buffer that follows `.to(dtype)`)."""

    dtype_probe: torch.Tensor

    def __init__(
        self, q: QuantizedMatrix, grid: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(q, grid)
        self.num_embeddings = self.out_features
        self.embedding_dim = self.in_features
        probe = torch.empty(0, dtype=dtype or torch.float32, device=q.codes.device)
        self.register_buffer("dtype_probe", probe, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).to(device=self.code_index.device, dtype=torch.long)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        t = self._template
        rows = unrotate(self.rotated_rows(uniq), t.layout, t.signs())  # (u, hidden)
        out = rows.index_select(0, inverse).to(self.dtype_probe.dtype)
        return out.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        m = self._meta
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"p={m['p']}, n={m['n']}, group_size={m['group_size']}, layout={m['layout']}"
        )


__all__ = ["HiggsEmbedding", "HiggsLinear"]
