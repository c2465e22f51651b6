"""Calibrated HIGGS: GPTQ with HIGGS grids (docs/algorithm.md section 6), and standard GPTQ int4.

For one linear layer W (out, in) with calibration inputs X (tokens, in):

    X' = X (H D)^T, W' = W (H D)^T            (the HIGGS rotation, so X' W'^T = X W^T)
    Hes = 2 X'^T X' / tokens + damp * mean(diag) * I
    U   = cholesky(inverse(Hes)) upper
    s   = the fp16 RMS of every scale group of W', fixed before the sweep (as data-free HIGGS)

Columns (p = 1) or column pairs (p = 2) are then quantized left to right: the tuple
W'[:, j:j+p] / s goes to its nearest grid point (the pair jointly), and the rounding error,
solved against U[j:j+p, j:j+p], is pushed onto the columns not yet quantized through
U[j:j+p, j+p:]. Updates inside a block of B columns are applied at once; the columns right of
the block receive the block's stacked errors in one matrix product (GPTQ's lazy batch update).

The result is an ordinary `QuantizedMatrix` (same codes, scales, layout and sign seed as
data-free HIGGS would store): artifacts, loader and bit accounting are unchanged.

`gptq_higgs_reference` is the slow, obviously correct twin: no Cholesky and no lazy batching,
the explicit optimal-brain-quantizer update with the inverse Hessian of the remaining columns,
in float64. `gptq_rtn` is standard GPTQ with a uniform asymmetric grid (min-max scale and zero
point per group of `group_size` columns, computed from the updated weights when the sweep
reaches the group, as GPTQ does), in the original basis: the data-aware baseline.

The Hessian is accumulated from unrotated inputs (`HessianAccumulator`) and rotated here:
Hes' = R Hes R^T with R = H D blockwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from higgs_engine.errors import InvalidConfigError
from higgs_engine.grids import get_grid
from higgs_engine.hadamard import block_layout, random_signs, rotate, unrotate
from higgs_engine.nearest import nearest_points, nearest_searcher
from higgs_engine.packing import pack_codes
from higgs_engine.planning.config import MatrixSpec
from higgs_engine.quantize import (
    FP16_MAX,
    SCALE_RULES,
    QuantizedMatrix,
    check_inputs,
    fit_scales,
    group_lengths,
    group_rms,
)

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_DAMP",
    "HessianAccumulator",
    "check_hessian",
    "gptq_higgs",
    "gptq_higgs_many",
    "gptq_higgs_reference",
    "gptq_rtn",
    "inverse_cholesky_upper",
    "output_error",
    "prepare_hessian",
    "rotate_hessian",
    "sweep_with_writeback",
]

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128


class HessianAccumulator:
    """Running 2 X^T X / tokens of a layer input, float64, from batches (..., in).

    X^T X is symmetric: each batch computes only its upper triangle, as row strips of
    `STRIP` rows (about a quarter fewer multiply-adds than the full product at the widths of
    small LLMs); `hessian()` mirrors it."""

    STRIP = 256

    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise InvalidConfigError(
                f"input of width {x.shape[-1]} does not match the Hessian's {self.in_features}"
            )
        x2 = x.detach().reshape(-1, self.in_features).to(torch.float32)  # (tokens, in)
        # float32 product per batch (fast), float64 running sum (no drift over many batches).
        n, b = self.in_features, self.STRIP
        for i in range(0, n, b):
            strip = x2[:, i : i + b].T @ x2[:, i:]  # rows i..i+b, columns i.. (upper part)
            self.sum[i : i + b, i:] += strip.to(torch.float64)
        self.tokens += int(x2.shape[0])

    def hessian(self) -> torch.Tensor:
        """2 X^T X / tokens (in, in) float64; refuses an empty accumulator."""
        if self.tokens == 0:
            raise InvalidConfigError("no calibration inputs reached this layer")
        upper = torch.triu(self.sum)
        return (upper + torch.triu(upper, 1).T) * (2.0 / self.tokens)


def rotate_hessian(
    hes: torch.Tensor, layout: list[int], signs: torch.Tensor | None
) -> torch.Tensor:
    """R Hes R^T for R = H D blockwise (the Hessian of the rotated inputs X' = X R^T)."""
    h = hes.to(torch.float64)
    h = rotate(h, layout, signs)  # Hes R^T
    return rotate(h.T.contiguous(), layout, signs)  # R Hes R^T (Hes symmetric)


def check_hessian(hes: torch.Tensor, in_features: int) -> None:
    if not isinstance(hes, torch.Tensor) or tuple(hes.shape) != (in_features, in_features):
        shape = tuple(hes.shape) if isinstance(hes, torch.Tensor) else type(hes).__name__
        raise InvalidConfigError(f"Hessian of shape {shape} is not ({in_features}, {in_features})")
    if not bool(torch.isfinite(hes).all()):
        raise InvalidConfigError("the Hessian has non-finite entries (nan or inf inputs)")


def prepare_hessian(hes: torch.Tensor, damp: float) -> torch.Tensor:
    """Damped copy (float64): dead inputs (zero diagonal) get 1 on the diagonal, then
    damp * mean(diag) is added to every diagonal entry."""
    if not (math.isfinite(damp) and damp >= 0):
        raise InvalidConfigError(f"damp={damp!r} must be a finite number >= 0")
    h = hes.to(torch.float64).clone()
    diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = 1.0
    diag += damp * float(diag.mean())
    return h


def inverse_cholesky_upper(h: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """U upper triangular with U^T U = inverse(h), computed in `dtype` (float32 as GPTQ does:
    the damping keeps it well conditioned; float64 for the tests).

    One Cholesky factorisation and one triangular inverse: with J the order reversal and
    J h J = L L^T, U = J L^{-1} J (upper, positive diagonal, and U^T U = J L^{-T} L^{-1} J =
    inverse(h)), the unique factor GPTQ's cholesky(cholesky_inverse(cholesky(h))) computes
    with two factorisations and an inverse."""
    h = h.to(dtype)
    # cholesky_ex: the same factorisation as cholesky, its failure as a code instead of a raise
    lower, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if int(info) != 0:
        raise InvalidConfigError(
            f"the damped Hessian is not positive definite (its leading minor of order "
            f"{int(info)} is not positive); raise damp"
        )
    eye = torch.eye(h.shape[0], dtype=dtype)
    inv: torch.Tensor = torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)
    return inv


# ----------------------------------------------------------------------------- the sweep

# quantize_cols(j, w) -> q: the quantized values of columns j..j+p of the (updated) weights.
ColumnQuantizer = Callable[[int, torch.Tensor], torch.Tensor]


def _pair_inverses(U: torch.Tensor, p: int) -> torch.Tensor:
    """The inverses (in / p, p, p) of U's p x p diagonal blocks (e = d U_SS^{-1} per tuple S)."""
    in_f = U.shape[0]
    idx = torch.arange(0, in_f, p)
    diag = torch.stack([U[idx + a, idx + b] for a in range(p) for b in range(p)], 1)
    inv: torch.Tensor = torch.linalg.inv(diag.reshape(-1, p, p))
    return inv


def _sweep_grid(
    W: torch.Tensor,
    U: torch.Tensor,
    p: int,
    block: int,
    inv_col: torch.Tensor,
    search: Callable[[torch.Tensor], torch.Tensor],
    grid: torch.Tensor,
    s_col: torch.Tensor,
) -> torch.Tensor:
    """GPTQ sweep with lazy block updates over W (out, in) for a fixed grid (n, p) and fixed
    per-column scales: tuple j of every row goes to the nearest grid point of
    W[:, j:j+p] * inv_col[:, j:j+p] (`search`, `nearest_searcher`'s coordinate-major
    interface), its value is grid[code] * s_col. Returns the codes (out, in / p) int64.

    The sweep runs on the transposes (in, out), so a column tuple of every row is p
    contiguous rows and every per-step operation is vectorised over the rows of W. Inside a
    block of `block` columns a short loop (one tuple per step); the columns right of the
    block receive the block's errors in one matmul. Slices are taken once per block."""
    out_f, in_f = W.shape
    uinv_t = _pair_inverses(U, p).transpose(1, 2).contiguous()  # e^T = U_SS^{-T} d^T
    wt = W.T.contiguous()  # (in, out)
    inv_t = inv_col.T.contiguous()
    s_t = s_col.T.contiguous()
    grid_t = grid.T.contiguous()  # (p, n)
    codes_t = torch.empty(in_f // p, out_f, dtype=torch.int64)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        steps = (i2 - i1) // p
        w1 = wt[i1:i2]  # (B, out), a view: updated in place
        err = torch.empty_like(w1)
        u1t = U[i1:i2, i1:i2].T.contiguous()  # (B, B), lower
        ws, errs = torch.split(w1, p), torch.split(err, p)
        invs, scs = torch.split(inv_t[i1:i2], p), torch.split(s_t[i1:i2], p)
        for t in range(steps):
            w = ws[t]  # (p, out), sees the in-block updates
            c = search(w * invs[t])  # (out,)
            codes_t[i1 // p + t] = c
            d = w - grid_t.index_select(1, c).mul_(scs[t])  # (p, out)
            e = torch.mm(uinv_t[i1 // p + t], d, out=errs[t])
            if t + 1 < steps:
                j = t * p
                w1[j + p :].addmm_(u1t[j + p :, j : j + p], e, alpha=-1.0)
        if i2 < in_f:
            wt[i2:].addmm_(U[i1:i2, i2:].T, err, alpha=-1.0)
    return codes_t.T.contiguous()


def _check_block(block: int, p: int) -> None:
    if not isinstance(block, int) or block < p or block % p:
        raise InvalidConfigError(f"block={block!r} must be a positive multiple of p={p}")


def _higgs_setup(
    W: torch.Tensor, spec: MatrixSpec, grid: torch.Tensor | None
) -> tuple[list[int], list[int], torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layout, group lengths, signs, grid float32, rotated W' float64, fp16 scales (out, G)).

    The scales follow `spec.scale_rule` exactly as data-free HIGGS would choose them for W'."""
    p, n, group_size = spec.p, spec.n, spec.group_size
    if spec.scale_rule not in SCALE_RULES:
        raise InvalidConfigError(
            f"scale_rule={spec.scale_rule!r} must be one of {list(SCALE_RULES)}"
        )
    check_inputs(W, p, n, group_size, spec.rotation_block)
    if not bool(torch.isfinite(W).all()):
        raise InvalidConfigError(f"W has {int((~torch.isfinite(W)).sum())} non-finite values")
    _out_f, in_f = W.shape
    g = get_grid(p, n) if grid is None else grid
    if tuple(g.shape) != (n, p):
        raise InvalidConfigError(f"grid of shape {tuple(g.shape)} is not ({n}, {p})")
    layout = block_layout(in_f, spec.rotation_block)
    lens = group_lengths(layout, group_size)
    bad = [length for length in lens if length % p]
    if bad:
        raise InvalidConfigError(
            f"scale group of length {bad[0]} (layout {layout}) is not divisible by p={p}"
        )
    signs = None if spec.sign_seed is None else random_signs(in_f, spec.sign_seed)
    y = rotate(W.to(torch.float64), layout, signs)  # (out, in) float64
    rms = group_rms(y.to(torch.float32), lens, group_size)  # (out, G)
    if bool((rms > FP16_MAX).any()):
        raise InvalidConfigError(
            f"a scale group RMS of {float(rms.max()):.4g} exceeds the fp16 range"
        )
    g32 = g.to(torch.float32)
    if spec.scale_rule == "rms":
        s16 = rms.to(torch.float16)
    else:
        y32 = y.to(torch.float32)
        s16, _ = fit_scales(y32, rms, lens, group_size, g32, "auto", spec.scale_rule)
    return layout, lens, signs, g32, y, s16.cpu()


def _column_scales(scales16: torch.Tensor, lens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """(out, in) scale of every column's group."""
    gidx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # (in,)
    return scales16.to(dtype)[:, gidx]


@dataclass(frozen=True)
class _Swept:
    """One swept matrix (or rows of a stacked one): fp16 scales (rows, G), codes
    (rows, in/p), the rotated-domain reconstruction Q (rows, in)."""

    scales16: torch.Tensor
    codes: torch.Tensor
    Q: torch.Tensor

    def rows(self, r0: int, r1: int) -> _Swept:
        return _Swept(self.scales16[r0:r1].clone(), self.codes[r0:r1], self.Q[r0:r1])


def _finish(
    spec: MatrixSpec, layout: list[int], signs: torch.Tensor | None, swept: _Swept
) -> tuple[QuantizedMatrix, torch.Tensor]:
    out_f, in_f = swept.Q.shape
    q = QuantizedMatrix(
        out_features=out_f,
        in_features=in_f,
        p=spec.p,
        n=spec.n,
        group_size=spec.group_size,
        layout=layout,
        sign_seed=spec.sign_seed,
        codes=pack_codes(swept.codes.reshape(-1), int(math.log2(spec.n))),
        scales=swept.scales16,
        scale_rule=spec.scale_rule,
    )
    w_hat = unrotate(swept.Q.to(torch.float32), layout, signs)  # (out, in) float32
    return q, w_hat


def gptq_higgs(
    W: torch.Tensor,
    hessian: torch.Tensor,
    spec: MatrixSpec,
    grid: torch.Tensor | None = None,
    *,
    damp: float = DEFAULT_DAMP,
    block: int = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> tuple[QuantizedMatrix, torch.Tensor]:
    """Calibrated HIGGS of W (out, in) as `spec` says, with the input Hessian 2 X^T X / tokens
    (in, in) of the UNROTATED inputs. Returns (q, W_hat float32 (out, in) = dequantize_matrix(q)).

    dtype: precision of the sweep (float32; float64 for the tests against the reference)."""
    return gptq_higgs_many([W], hessian, spec, grid, damp=damp, block=block, dtype=dtype)[0]


def gptq_higgs_many(
    Ws: list[torch.Tensor],
    hessian: torch.Tensor,
    spec: MatrixSpec,
    grid: torch.Tensor | None = None,
    *,
    damp: float = DEFAULT_DAMP,
    block: int = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[QuantizedMatrix, torch.Tensor]]:
    """`gptq_higgs` of several matrices with the same input (q/k/v, gate/up): rows never
    interact in the sweep, so the matrices are stacked and swept once, with one Cholesky."""
    if not Ws:
        return []
    widths = {int(w.shape[1]) if w.dim() == 2 else -1 for w in Ws}
    if len(widths) != 1:
        raise InvalidConfigError(
            f"matrices sharing a Hessian must have one width, got {sorted(widths)}"
        )
    rows = [int(w.shape[0]) for w in Ws]
    W = Ws[0] if len(Ws) == 1 else torch.cat([w.to(torch.float32) for w in Ws], 0)
    layout, lens, signs, g, y, scales16 = _higgs_setup(W, spec, grid)
    _check_block(block, spec.p)
    out_f, in_f = W.shape
    check_hessian(hessian, in_f)
    h = prepare_hessian(rotate_hessian(hessian, layout, signs), damp)
    U = inverse_cholesky_upper(h, dtype)
    s_col = _column_scales(scales16, lens, dtype)  # (out, in)
    inv_col = torch.where(s_col > 0, 1.0 / s_col, torch.zeros_like(s_col))
    gd = g.to(dtype)
    codes = _sweep_grid(y.to(dtype), U, spec.p, block, inv_col, nearest_searcher(g), gd, s_col)
    Q = gd.index_select(0, codes.reshape(-1)).reshape(out_f, in_f) * s_col
    swept = _Swept(scales16, codes, Q)
    res = []
    r0 = 0
    for r in rows:
        res.append(_finish(spec, layout, signs, swept.rows(r0, r0 + r)))
        r0 += r
    return res


def gptq_higgs_reference(
    W: torch.Tensor,
    hessian: torch.Tensor,
    spec: MatrixSpec,
    grid: torch.Tensor | None = None,
    *,
    damp: float = DEFAULT_DAMP,
) -> tuple[QuantizedMatrix, torch.Tensor]:
    """Slow twin of `gptq_higgs` (float64, no Cholesky, no lazy batching): after quantizing
    the tuple S of columns, every remaining column is corrected by the optimal-brain-quantizer
    step  W_R -= (W_S - Q_S) Hinv_SS^{-1} Hinv_SR  and Hinv is replaced by the inverse Hessian
    of the remaining columns, Hinv_RR - Hinv_RS Hinv_SS^{-1} Hinv_SR."""
    p = spec.p
    layout, lens, signs, g, y, scales16 = _higgs_setup(W, spec, grid)
    out_f, in_f = W.shape
    check_hessian(hessian, in_f)
    h = prepare_hessian(rotate_hessian(hessian, layout, signs), damp)
    hinv = torch.linalg.inv(h)  # (in, in) float64, for the remaining columns j..
    s_col = _column_scales(scales16, lens, torch.float64)
    g64 = g.to(torch.float64)
    Wr = y.clone()  # (out, in) float64
    Q = torch.zeros_like(Wr)
    codes = torch.empty(out_f, in_f // p, dtype=torch.int64)
    for j in range(0, in_f, p):
        s = s_col[:, j : j + p]
        z = torch.where(s > 0, Wr[:, j : j + p] / s, torch.zeros_like(s))
        c = nearest_points(z.to(torch.float32).contiguous(), g)
        codes[:, j // p] = c
        Q[:, j : j + p] = g64[c] * s
        d = Wr[:, j : j + p] - Q[:, j : j + p]  # (out, p)
        k = p  # size of S
        hss = hinv[:k, :k]
        hsr = hinv[:k, k:]
        Wr[:, j + p :] -= d @ torch.linalg.solve(hss, hsr)
        hinv = hinv[k:, k:] - hsr.T @ torch.linalg.solve(hss, hsr)
    return _finish(spec, layout, signs, _Swept(scales16, codes, Q))


def gptq_rtn(
    W: torch.Tensor,
    hessian: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    damp: float = DEFAULT_DAMP,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, float]:
    """Standard GPTQ (asymmetric uniform `bits`-bit grid, min-max fp16 scale and zero point per
    group of `group_size` columns of a row, natural column order) in the original basis.
    Returns (W_hat float32 (out, in), bits per weight = bits + 32 / group_size)."""
    if not isinstance(W, torch.Tensor) or W.dim() != 2 or W.numel() == 0:
        raise InvalidConfigError("W must be a non-empty 2-D tensor")
    if not bool(torch.isfinite(W).all()):
        raise InvalidConfigError(f"W has {int((~torch.isfinite(W)).sum())} non-finite values")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise InvalidConfigError(f"bits={bits!r} must be an integer in 1..8")
    if not isinstance(group_size, int) or group_size < 1:
        raise InvalidConfigError(f"group_size={group_size!r} must be a positive integer")
    out_f, in_f = W.shape
    check_hessian(hessian, in_f)
    _check_block(block, 1)
    maxq = (1 << bits) - 1
    U = inverse_cholesky_upper(prepare_hessian(hessian, damp), torch.float32)
    state: dict[str, torch.Tensor] = {}

    def quantize_cols(j: int, w: torch.Tensor) -> torch.Tensor:
        if j % group_size == 0:  # the group's scale/zero from the current (updated) weights
            grp = Wfull[:, j : j + group_size]
            lo = grp.amin(1, keepdim=True).clamp(max=0)
            hi = grp.amax(1, keepdim=True).clamp(min=0)
            scale = ((hi - lo) / maxq).to(torch.float16).to(torch.float32)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = torch.round(-lo / scale).to(torch.float16).to(torch.float32)
            state["scale"], state["zero"] = scale, zero
        scale, zero = state["scale"], state["zero"]
        qi = torch.clamp(torch.round(w / scale + zero), 0, maxq)
        return (qi - zero) * scale

    Wfull = W.to(torch.float32).clone()
    # The group start reads the updated columns: the sweep writes block results back into
    # Wfull before the next block, and groups never start mid-block when block % g == 0.
    if block % group_size and group_size % block:
        raise InvalidConfigError(f"block={block} and group_size={group_size} must nest")
    Q = sweep_with_writeback(Wfull, U, block, quantize_cols)
    ngroups = (in_f + group_size - 1) // group_size
    return Q, (bits * W.numel() + 32 * out_f * ngroups) / W.numel()


def sweep_with_writeback(
    W: torch.Tensor, U: torch.Tensor, block: int, quantize_cols: ColumnQuantizer
) -> torch.Tensor:
    """The GPTQ sweep for p = 1 with a column quantizer that may read W's later columns of the
    current block in their updated state (W1 is written back into W as the sweep goes)."""
    _out_f, in_f = W.shape
    Q = torch.empty_like(W)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1 = W[:, i1:i2]  # a view: in-block updates are visible through W
        Err = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for j in range(i2 - i1):
            w = W1[:, j : j + 1].clone()
            q = quantize_cols(i1 + j, w)
            Q[:, i1 + j : i1 + j + 1] = q
            e = (w - q) / U1[j, j]
            Err[:, j : j + 1] = e
            if j + 1 < i2 - i1:
                W1[:, j + 1 :] -= e @ U1[j : j + 1, j + 1 :]
        if i2 < in_f:
            W[:, i2:] -= Err @ U[i1:i2, i2:]
    return Q


def output_error(X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor) -> float:
    """||X W^T - X W_hat^T||_F^2 / ||X W^T||_F^2 (float64)."""
    x = X.to(torch.float64)
    ref = x @ W.to(torch.float64).T
    diff = ref - x @ W_hat.to(torch.float64).T
    den = float(ref.square().sum())
    return float(diff.square().sum()) / den if den > 0 else float(diff.square().sum())
