"""Quantize / dequantize one weight matrix with HIGGS (docs/algorithm.md section 1).

W (out, in) -> rotate each row blockwise (y = Hn D x) -> per scale group of g rotated values,
s = RMS in fp16 -> z = y / s cut into p-tuples -> index of the nearest point of the (p, n)
Gaussian grid -> codes bit-packed at log2(n) bits per tuple.

Dequantize: W_hat = D Hn (s * grid[codes]) blockwise. `higgs_matmul` avoids the inverse rotation
by rotating the activations instead: x @ W_hat^T = (Hn D x) @ (s * grid[codes])^T.

Bits accounting (`QuantizedMatrix.bits_per_weight`): exact code bits plus 16 bits per fp16 scale,
divided by the number of weights. The grid itself (n * p fp32 values) is shared by every matrix
that uses it, so it is NOT counted here: the pipeline counts each grid once per artifact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.grids import get_grid
from higgs_engine.hadamard import block_layout, random_signs, rotate, unrotate
from higgs_engine.nearest import nearest_points, nearest_points_reference
from higgs_engine.packing import pack_codes, packed_nbytes, unpack_codes
from higgs_engine.planning.config import SCALE_RULES as CONFIG_SCALE_RULES
from higgs_engine.planning.config import MatrixSpec
from higgs_engine.planning.layout import is_power_of_two
from higgs_engine.scale_search import TABLE_MAX_POINTS, scale_table_for, score_multipliers

__all__ = [
    "SCALE_SEARCHES",
    "MatrixSpec",
    "QuantizedMatrix",
    "check_inputs",
    "column_groups",
    "dequantize_matrix",
    "fit_scales",
    "group_lengths",
    "group_rms",
    "higgs_matmul",
    "nearest_points",
    "nearest_points_reference",
    "quantize_matrix",
    "quantize_matrix_full",
    "relative_error",
    "rotated_weight",
]

FORMAT = "higgs-matrix"
FORMAT_VERSION = 1
# Elements per row chunk: bounds the temporaries (rotated rows, tuples, codes) to a few
# tens of MB whatever the matrix size.
CHUNK_ELEMENTS = 1 << 21
FP16_MAX = 65504.0

# How a scale group's scale s is chosen (z = y / s is coded against the N(0, 1) grid):
# - "rms": s = RMS of the group (the paper's rule);
# - "mse": s = m * RMS with the multiplier m in MSE_MULTIPLIERS (1 included) that minimises the
#   group's actual reconstruction error ||y - s * grid[nearest(y / s)]||^2;
# - "unbiased": codes from the RMS scale, then s rescaled so that the reconstruction's
#   projection on y is y itself (<y, y_hat> = ||y||^2): the error is orthogonal to the weights.
#   An MSE-optimal quantizer shrinks (y_hat = (1 - t^2) y + noise); this removes the shrinkage
#   at the price of a slightly larger MSE.
# - "mse-unbiased": the "mse" codes and scale, then rescaled as "unbiased".
SCALE_RULES = CONFIG_SCALE_RULES
MSE_MULTIPLIERS: tuple[float, ...] = tuple(round(0.80 + 0.025 * k, 3) for k in range(17))
# How the "mse" rules search the multipliers: "table" scores every candidate from the grid's
# scoring table (higgs_engine.scale_search; 2-D grids of up to TABLE_MAX_POINTS points, the
# exact search for the others) and codes only the winner; "exact" codes every candidate (`_mse_scales`, one nearest-point
# pass per multiplier: the twin the table is tested and benchmarked against).
SCALE_SEARCHES = ("table", "exact")


def group_lengths(layout: Sequence[int], group_size: int) -> list[int]:
    """Lengths of the scale groups of one row: g-sized groups, or the whole block if shorter."""
    out: list[int] = []
    for h in layout:
        if h >= group_size:
            out.extend([group_size] * (h // group_size))
        else:
            out.append(h)
    return out


@dataclass(eq=False)
class QuantizedMatrix:
    """A HIGGS-quantized (out_features, in_features) matrix.

    codes: uint8 little-endian bit stream of out*in/p codes of log2(n) bits, row-major tuples.
    scales: float16 (out_features, groups per row), groups in row order (see `group_lengths`).
    """

    out_features: int
    in_features: int
    p: int
    n: int
    group_size: int
    layout: list[int]
    sign_seed: int | None
    codes: torch.Tensor
    scales: torch.Tensor
    # How the scales were chosen (see SCALE_RULES). Informational: dequantization only reads
    # codes and scales, so a matrix loads bit-exactly whatever its rule.
    scale_rule: str = "rms"
    _group_lens: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layout = [int(h) for h in self.layout]
        self._group_lens = group_lengths(self.layout, self.group_size)

    @property
    def bits(self) -> int:
        """Code bits per p-tuple."""
        return int(math.log2(self.n))

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def num_codes(self) -> int:
        return self.numel // self.p

    @property
    def group_lens(self) -> list[int]:
        return list(self._group_lens)

    def bits_per_weight(self) -> float:
        """(code bits + 16 * number of scales) / number of weights; grids are counted by the
        pipeline, once per artifact."""
        return (self.num_codes * self.bits + 16 * self.scales.numel()) / self.numel

    def nbytes(self) -> int:
        """Bytes of the stored tensors (packed codes + fp16 scales)."""
        return self.codes.numel() + 2 * self.scales.numel()

    def signs(self) -> torch.Tensor | None:
        return None if self.sign_seed is None else random_signs(self.in_features, self.sign_seed)

    def meta(self) -> dict[str, Any]:
        """JSON-able description that, with `to_tensors()`, restores the matrix exactly."""
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "out_features": self.out_features,
            "in_features": self.in_features,
            "p": self.p,
            "n": self.n,
            "group_size": self.group_size,
            "layout": list(self.layout),
            "sign_seed": self.sign_seed,
            "scale_rule": self.scale_rule,
        }

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes.contiguous(), "scales": self.scales.contiguous()}

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> QuantizedMatrix:
        """Rebuild from `to_tensors()` + `meta()`; raises CorruptCheckpointError on mismatch."""
        try:
            if meta.get("format") != FORMAT or int(meta["version"]) != FORMAT_VERSION:
                raise CorruptCheckpointError(
                    f"matrix meta format {meta.get('format')!r} v{meta.get('version')!r} "
                    f"is not {FORMAT} v{FORMAT_VERSION}"
                )
            q = cls(
                out_features=int(meta["out_features"]),
                in_features=int(meta["in_features"]),
                p=int(meta["p"]),
                n=int(meta["n"]),
                group_size=int(meta["group_size"]),
                layout=[int(h) for h in meta["layout"]],
                sign_seed=None if meta["sign_seed"] is None else int(meta["sign_seed"]),
                codes=tensors["codes"],
                scales=tensors["scales"],
                # matrices written before scale rules existed used the RMS scale
                scale_rule=str(meta.get("scale_rule", "rms")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"quantized matrix meta/tensors are incomplete: {e!r}"
            ) from e
        q.validate()
        return q

    def validate(self) -> None:
        """Check internal consistency (shapes, dtypes, sizes); CorruptCheckpointError if not."""
        if sum(self.layout) != self.in_features or any(not is_power_of_two(h) for h in self.layout):
            raise CorruptCheckpointError(
                f"layout {self.layout} does not cover in_features={self.in_features} with powers of two"
            )
        if self.n < 2 or not is_power_of_two(self.n) or self.p < 1 or self.in_features % self.p:
            raise CorruptCheckpointError(
                f"bad grid p={self.p}, n={self.n} for in_features={self.in_features}"
            )
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 1:
            raise CorruptCheckpointError(
                f"codes must be 1-D uint8, got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        need = packed_nbytes(self.num_codes, self.bits)
        if self.codes.numel() != need:
            raise CorruptCheckpointError(f"codes hold {self.codes.numel()} bytes, expected {need}")
        want = (self.out_features, len(self._group_lens))
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != want:
            raise CorruptCheckpointError(
                f"scales must be float16 {want}, got {self.scales.dtype} {tuple(self.scales.shape)}"
            )


# ----------------------------------------------------------------------------- validation


def check_inputs(W: torch.Tensor, p: int, n: int, group_size: int, rotation_block: int) -> None:
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        shape = tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
        raise InvalidConfigError(f"W must be a 2-D tensor, got {shape}")
    if not W.dtype.is_floating_point:
        raise InvalidConfigError(f"W must be floating point, got {W.dtype}")
    if W.numel() == 0:
        raise InvalidConfigError(f"W of shape {tuple(W.shape)} is empty")
    if not isinstance(p, int) or p < 1:
        raise InvalidConfigError(f"p={p!r} must be a positive integer")
    if not isinstance(n, int) or n < 2 or not is_power_of_two(n) or n > 1 << 12:
        raise InvalidConfigError(f"n={n!r} must be a power of two in 2..4096")
    if not isinstance(group_size, int) or not is_power_of_two(group_size) or group_size < p:
        raise InvalidConfigError(f"group_size={group_size!r} must be a power of two >= p={p}")
    if group_size % p:
        raise InvalidConfigError(f"group_size={group_size} is not a multiple of p={p}")
    if not isinstance(rotation_block, int) or not is_power_of_two(rotation_block):
        raise InvalidConfigError(f"rotation_block={rotation_block!r} must be a power of two")
    if W.shape[1] % p:
        raise InvalidConfigError(f"in_features={W.shape[1]} is not divisible by p={p}")


def _raise_non_finite(W: torch.Tensor) -> None:
    bad = int((~torch.isfinite(W)).sum())
    if bad:
        raise InvalidConfigError(f"W has {bad} non-finite values (nan or inf)")


def _row_chunk(in_features: int) -> int:
    # A multiple of 8 rows keeps every chunk's code stream byte-aligned for any bit width.
    return max(8, (CHUNK_ELEMENTS // in_features) // 8 * 8)


def group_rms(y: torch.Tensor, group_lens: Sequence[int], group_size: int) -> torch.Tensor:
    """RMS of each scale group: (rows, in) -> (rows, groups), float32."""
    rows, _width = y.shape
    full = sum(length for length in group_lens if length == group_size)
    parts = []
    if full:
        seg = y[:, :full].reshape(rows, full // group_size, group_size)  # (rows, G, g)
        parts.append(seg.square().mean(-1))
    start = full
    for length in group_lens[full // group_size :]:
        parts.append(y[:, start : start + length].square().mean(-1, keepdim=True))
        start += length
    return torch.cat(parts, dim=1).sqrt() if len(parts) > 1 else parts[0].sqrt()


def _group_sum(x: torch.Tensor, group_lens: Sequence[int], group_size: int) -> torch.Tensor:
    """Sum of each scale group: (rows, in) -> (rows, groups), float32 (contiguous views, no
    scatter: the fast twin of `_group_sums`)."""
    rows = x.shape[0]
    nfull = sum(1 for length in group_lens if length == group_size)
    parts = []
    if nfull:
        parts.append(x[:, : nfull * group_size].reshape(rows, nfull, group_size).sum(-1))
    start = nfull * group_size
    for length in group_lens[nfull:]:
        parts.append(x[:, start : start + length].sum(-1, keepdim=True))
        start += length
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _scale_groups_(
    y: torch.Tensor, factors: torch.Tensor, group_lens: Sequence[int], group_size: int
) -> torch.Tensor:
    """In place: multiply each scale group of y (rows, in) by factors (rows, groups)."""
    rows = y.shape[0]
    nfull = sum(1 for length in group_lens if length == group_size)
    full = nfull * group_size
    if nfull:
        # A view, not a gather: the full groups are contiguous runs of g columns.
        y[:, :full].view(rows, nfull, group_size).mul_(factors[:, :nfull, None])  # (rows, G, g)
    start = full
    for k, length in enumerate(group_lens[nfull:], start=nfull):
        y[:, start : start + length].mul_(factors[:, k : k + 1])
        start += length
    return y


def _scaled(
    y: torch.Tensor, factors: torch.Tensor, group_lens: Sequence[int], group_size: int
) -> torch.Tensor:
    """A new tensor: each scale group of y (rows, in) times factors (rows, groups); the same
    values as `_scale_groups_(y.clone(), ...)` in one pass over y instead of two."""
    rows = y.shape[0]
    nfull = sum(1 for length in group_lens if length == group_size)
    full = nfull * group_size
    out = torch.empty_like(y)
    if nfull:
        torch.mul(
            y[:, :full].view(rows, nfull, group_size),
            factors[:, :nfull, None],
            out=out[:, :full].view(rows, nfull, group_size),
        )
    start = full
    for k, length in enumerate(group_lens[nfull:], start=nfull):
        torch.mul(
            y[:, start : start + length],
            factors[:, k : k + 1],
            out=out[:, start : start + length],
        )
        start += length
    return out


# ----------------------------------------------------------------------------- scales


def column_groups(group_lens: Sequence[int], device: torch.device) -> torch.Tensor:
    """Scale-group index of every column of a row: (in,) int64."""
    return torch.repeat_interleave(
        torch.arange(len(group_lens), device=device),
        torch.tensor(list(group_lens), device=device),
    )


def _codes_for(
    y: torch.Tensor,
    s16: torch.Tensor,
    group_lens: Sequence[int],
    group_size: int,
    grid: torch.Tensor,
    search: str,
    inplace: bool = False,
) -> torch.Tensor:
    """Nearest grid tuples of y / s (rows, in) for fp16 scales s (rows, groups): (rows*in/p,).

    Divides by the stored fp16 scale so dequantization sees exactly what was coded; an all-zero
    group (s = 0) maps to z = 0 and dequantizes to 0. `inplace` lets y be overwritten."""
    s = s16.to(torch.float32)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    if inplace:
        z = _scale_groups_(y, inv, group_lens, group_size)
    else:
        z = _scaled(y, inv, group_lens, group_size)
    return nearest_points(z.reshape(-1, grid.shape[1]), grid, search)


def _group_sums(x: torch.Tensor, col_group: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group sums of x (rows, in) -> (rows, groups), float64 (exact enough to compare)."""
    out = torch.zeros(x.shape[0], groups, dtype=torch.float64, device=x.device)
    return out.index_add_(1, col_group, x.to(torch.float64))


def _recon(
    codes: torch.Tensor,
    s16: torch.Tensor,
    grid: torch.Tensor,
    group_lens: Sequence[int],
    group_size: int,
) -> torch.Tensor:
    """s * grid[codes] as (rows, in) float32 for fp16 scales s (rows, groups)."""
    rows = s16.shape[0]
    yq = grid.index_select(0, codes).reshape(rows, -1)
    return _scale_groups_(yq, s16.to(torch.float32), group_lens, group_size)


def _fp16_scale(s: torch.Tensor) -> torch.Tensor:
    return s.clamp(max=FP16_MAX).to(torch.float16)


def fit_scales(
    y: torch.Tensor,
    rms: torch.Tensor,
    group_lens: Sequence[int],
    group_size: int,
    grid: torch.Tensor,
    search: str,
    rule: str,
    scale_search: str = "table",
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scales (rows, groups) and codes (rows*in/p,) of rotated rows y under `rule`
    ("mse" or "unbiased", see SCALE_RULES; `scale_search`, see SCALE_SEARCHES). y is left
    unchanged."""

    def _unbias(
        y: torch.Tensor, s16: torch.Tensor, codes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # s -> s * <y, y> / <y, s * g> = <y, y> / <y, g>: the reconstruction's projection on
        # y is y (a group whose <y, s * g> is not positive keeps s, as the reference does);
        # <y, y> of a group is its length times its mean square, RMS^2
        num = rms.square() * lens_t
        yg = grid.index_select(0, codes).view(y.shape).mul_(y)  # (rows, in)
        den = _group_sum(yg, group_lens, group_size)
        ok = (den > 0) & (s16 > 0)
        s = torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), s16.float())
        return _fp16_scale(s), codes

    lens_t = torch.tensor(list(group_lens), dtype=torch.float32, device=y.device)
    if rule == "unbiased":
        s16 = rms.to(torch.float16)
        return _unbias(y, s16, _codes_for(y, s16, group_lens, group_size, grid, search))
    if scale_search == "table" and _table_search_applies(grid):
        s16, codes = _mse_scales_table(y, rms, group_lens, group_size, grid, search)
    else:
        col_group = column_groups(group_lens, y.device)  # (in,) group of each column
        s16, codes = _mse_scales(y, rms, group_lens, group_size, grid, search, col_group)
    if rule == "mse-unbiased":
        return _unbias(y, s16, codes)
    return s16, codes


def _mse_scales(
    y: torch.Tensor,
    rms: torch.Tensor,
    group_lens: Sequence[int],
    group_size: int,
    grid: torch.Tensor,
    search: str,
    col_group: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multiplier of the RMS scale with the smallest actual group error; ties keep the
    earlier candidate. Returns fp16 scales (rows, groups) and codes (rows*in/p,)."""
    rows, width = y.shape
    groups = len(group_lens)
    p = grid.shape[1]
    tuple_group = col_group[::p]  # (in/p,) group of each p-tuple
    best_err = torch.full((rows, groups), math.inf, dtype=torch.float64, device=y.device)
    best_s16 = torch.zeros(rows, groups, dtype=torch.float16, device=y.device)
    best_codes = torch.zeros(rows, width // p, dtype=torch.int64, device=y.device)
    for m in MSE_MULTIPLIERS:
        s16 = _fp16_scale(rms * m)
        codes = _codes_for(y, s16, group_lens, group_size, grid, search)
        rec = _recon(codes, s16, grid, group_lens, group_size)
        err = _group_sums((y - rec).square(), col_group, groups)
        better = err < best_err  # (rows, groups)
        best_err = torch.where(better, err, best_err)
        best_s16 = torch.where(better, s16, best_s16)
        take = better.index_select(1, tuple_group)  # (rows, in/p)
        best_codes = torch.where(take, codes.view(rows, -1).to(torch.int64), best_codes)
    return best_s16, best_codes.reshape(-1)


def _table_search_applies(grid: torch.Tensor) -> bool:
    """The scoring table serves 2-D grids of 16..TABLE_MAX_POINTS points, on every device (the
    same multipliers on the CPU and on an accelerator); 1-D and finer grids keep the exact
    search."""
    return grid.shape[1] == 2 and 8 < grid.shape[0] <= TABLE_MAX_POINTS


def _mse_scales_table(
    y: torch.Tensor,
    rms: torch.Tensor,
    group_lens: Sequence[int],
    group_size: int,
    grid: torch.Tensor,
    search: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_mse_scales` with the candidates scored from the grid's table
    (higgs_engine.scale_search) and only the winner coded: one nearest-point pass instead of
    one per multiplier. Same outputs: fp16 scales (rows, groups) and codes (rows*in/p,)."""
    table = scale_table_for(grid, MSE_MULTIPLIERS, max(group_lens), y.device)
    inv = torch.where(rms > 0, 1.0 / rms, torch.zeros_like(rms))
    z = _scaled(y, inv, group_lens, group_size)  # (rows, in)
    best = score_multipliers(z, group_lens, group_size, table).argmin(-1)  # (rows, groups)
    mult = torch.tensor(MSE_MULTIPLIERS, dtype=torch.float32, device=y.device)
    s16 = _fp16_scale(rms * mult.index_select(0, best.view(-1)).view(best.shape))
    return s16, _codes_for(y, s16, group_lens, group_size, grid, search)


def fit_scales_reference(
    y: torch.Tensor, group_lens: Sequence[int], grid: torch.Tensor, rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow twin of the scale rules: one group of one row at a time, plain loops, the
    nearest point by exhaustive search. y: rotated rows (rows, in) float32. Returns fp16
    scales (rows, groups) and codes (rows, in/p) int64."""
    if rule not in SCALE_RULES:
        raise InvalidConfigError(f"scale_rule={rule!r} must be one of {list(SCALE_RULES)}")
    rows = y.shape[0]
    p = grid.shape[1]
    scales = torch.zeros(rows, len(group_lens), dtype=torch.float16)
    codes = torch.zeros(rows, y.shape[1] // p, dtype=torch.int64)

    def code(seg: torch.Tensor, s16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = float(s16)
        z = seg / s if s > 0 else torch.zeros_like(seg)
        c = nearest_points_reference(z.reshape(-1, p), grid)
        return c, grid[c].reshape(-1) * s

    for r in range(rows):
        start = 0
        for k, length in enumerate(group_lens):
            seg = y[r, start : start + length].float()
            rms16 = seg.square().mean().sqrt().to(torch.float16)
            best = code(seg, rms16)
            s16 = rms16
            if rule in ("mse", "mse-unbiased"):
                best_err = math.inf
                for m in MSE_MULTIPLIERS:
                    cand = torch.tensor(float(seg.square().mean().sqrt()) * m)
                    c16 = cand.clamp(max=FP16_MAX).to(torch.float16)
                    got = code(seg, c16)
                    err = float((seg.double() - got[1].double()).square().sum())
                    if err < best_err:
                        best_err, best, s16 = err, got, c16
            if rule in ("unbiased", "mse-unbiased"):
                num = float((seg.double() * seg.double()).sum())
                den = float((seg.double() * best[1].double()).sum())
                s16 = torch.tensor(
                    float(s16) * (num / den if den > 0 else 1.0), dtype=torch.float64
                )
                s16 = s16.clamp(max=FP16_MAX).to(torch.float16)
            scales[r, k] = s16
            codes[r, start // p : (start + length) // p] = best[0]
            start += length
    return scales, codes


# ----------------------------------------------------------------------------- quantize


def quantize_matrix(
    W: torch.Tensor,
    spec: MatrixSpec,
    grid: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    search: str = "auto",
    scale_search: str = "table",
) -> QuantizedMatrix:
    """HIGGS-quantize W (out, in) as `spec` says (grid, scale groups, rotation, signs, scale
    rule). `grid` overrides the shipped (p, n) grid (tests, research).

    device: where the rotation and the nearest-point search run (default: the CPU, whatever
    W's device); search: "auto", "lookup" or "matmul" (see `nearest_points`); scale_search:
    how the "mse" rules search their multiplier (see SCALE_SEARCHES)."""
    q, _ = quantize_matrix_full(
        W,
        spec,
        grid,
        device=device,
        search=search,
        dequantized=False,
        scale_search=scale_search,
    )
    return q


@dataclass(frozen=True)
class _Rows:
    """What every row chunk of one matrix shares: its spec, the grid on the device, the block
    layout and scale group lengths, the signs, and how the codes are searched."""

    spec: MatrixSpec
    grid: torch.Tensor  # (n, p) float32 on `device`
    layout: list[int]
    lens: list[int]
    signs: torch.Tensor | None
    device: torch.device
    search: str
    scale_search: str


def _prepare(
    W: torch.Tensor,
    spec: MatrixSpec,
    grid: torch.Tensor | None,
    device: torch.device | str | None,
    search: str,
    scale_search: str,
) -> _Rows:
    """Check W and the spec, and build what every row chunk shares."""
    p, n = spec.p, spec.n
    check_inputs(W, p, n, spec.group_size, spec.rotation_block)
    if spec.scale_rule not in SCALE_RULES:
        raise InvalidConfigError(
            f"scale_rule={spec.scale_rule!r} must be one of {list(SCALE_RULES)}"
        )
    if scale_search not in SCALE_SEARCHES:
        raise InvalidConfigError(
            f"scale_search={scale_search!r} must be one of {list(SCALE_SEARCHES)}"
        )
    dev = torch.device("cpu") if device is None else torch.device(device)
    in_f = W.shape[1]
    if grid is None:
        grid = get_grid(p, n)
    elif tuple(grid.shape) != (n, p):
        raise InvalidConfigError(f"grid of shape {tuple(grid.shape)} is not ({n}, {p})")
    layout = block_layout(in_f, spec.rotation_block)
    lens = group_lengths(layout, spec.group_size)
    bad = [length for length in lens if length % p]
    if bad:
        raise InvalidConfigError(
            f"scale group of length {bad[0]} (layout {layout}) is not divisible by p={p}"
        )
    signs = None if spec.sign_seed is None else random_signs(in_f, spec.sign_seed).to(dev)
    g = grid.to(device=dev, dtype=torch.float32)
    return _Rows(spec, g, layout, lens, signs, dev, search, scale_search)


def _code_rows(W: torch.Tensor, r0: int, r1: int, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 scales (rows, G), codes (rows*in/p,)) of the rows W[r0:r1]."""
    spec = rows.spec
    w = W[r0:r1].to(device=rows.device, dtype=torch.float32)  # (rows, in)
    y = rotate(w, rows.layout, rows.signs)  # (rows, in)
    rms = group_rms(y, rows.lens, spec.group_size)  # (rows, G)
    # A nan/inf weight makes its group's RMS non-finite: checking the (rows, G) RMS is
    # much cheaper than scanning W, and the full scan only runs to name the count.
    if not bool(torch.isfinite(rms).all()):
        _raise_non_finite(W)
    if bool((rms > FP16_MAX).any()):
        raise InvalidConfigError(
            f"a scale group RMS of {float(rms.max()):.4g} in rows {r0}.. exceeds the fp16 range"
        )
    if spec.scale_rule == "rms":
        s16 = rms.to(torch.float16)
        # y is not needed after its codes: the search may overwrite it
        return s16, _codes_for(y, s16, rows.lens, spec.group_size, rows.grid, rows.search, True)
    return fit_scales(
        y,
        rms,
        rows.lens,
        spec.group_size,
        rows.grid,
        rows.search,
        spec.scale_rule,
        rows.scale_search,
    )


def _dequantize_rows(codes: torch.Tensor, s16: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """W_hat (rows, in) float32 of one chunk's codes and scales, on the CPU."""
    yq = rows.grid.index_select(0, codes).reshape(s16.shape[0], -1)  # (rows, in)
    yq = _scale_groups_(yq, s16.to(torch.float32), rows.lens, rows.spec.group_size)
    return unrotate(yq, rows.layout, rows.signs).cpu()


def quantize_matrix_full(
    W: torch.Tensor,
    spec: MatrixSpec,
    grid: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    search: str = "auto",
    dequantized: bool = True,
    scale_search: str = "table",
) -> tuple[QuantizedMatrix, torch.Tensor | None]:
    """`quantize_matrix` that also returns W_hat (out, in) float32 on the CPU, computed from the
    codes while they are at hand (no pack / unpack round trip): the same values as
    `dequantize_matrix(q)`, which the tests check."""
    rows = _prepare(W, spec, grid, device, search, scale_search)
    out_f, in_f = W.shape
    scales = torch.empty(out_f, len(rows.lens), dtype=torch.float16)
    w_hat = torch.empty(out_f, in_f, dtype=torch.float32) if dequantized else None
    packed: list[torch.Tensor] = []
    step = _row_chunk(in_f)
    for r0 in range(0, out_f, step):
        s16, codes = _code_rows(W, r0, r0 + step, rows)
        scales[r0 : r0 + step] = s16.cpu()
        if w_hat is not None:
            w_hat[r0 : r0 + step] = _dequantize_rows(codes, s16, rows)
        packed.append(pack_codes(codes.cpu(), int(math.log2(spec.n))))
    q = QuantizedMatrix(
        out_features=out_f,
        in_features=in_f,
        p=spec.p,
        n=spec.n,
        group_size=spec.group_size,
        layout=rows.layout,
        sign_seed=spec.sign_seed,
        codes=torch.cat(packed) if len(packed) > 1 else packed[0],
        scales=scales,
        scale_rule=spec.scale_rule,
    )
    return q, w_hat


def _chunk_rotated(q: QuantizedMatrix, r0: int, r1: int, grid: torch.Tensor) -> torch.Tensor:
    """Rotated-domain weights s * grid[codes] for rows r0..r1: (rows, in) float32."""
    per_row = q.in_features // q.p
    b0 = r0 * per_row * q.bits // 8  # byte-aligned because r0 is a multiple of 8
    count = (r1 - r0) * per_row
    b1 = b0 + packed_nbytes(count, q.bits)
    codes = unpack_codes(q.codes[b0:b1], q.bits, count)
    y = grid.index_select(0, codes).reshape(r1 - r0, q.in_features)  # (rows, in)
    return _scale_groups_(y, q.scales[r0:r1].to(torch.float32), q.group_lens, q.group_size)


def _grid_for(q: QuantizedMatrix, grid: torch.Tensor | None) -> torch.Tensor:
    g = get_grid(q.p, q.n) if grid is None else grid
    if tuple(g.shape) != (q.n, q.p):
        raise InvalidConfigError(f"grid of shape {tuple(g.shape)} is not ({q.n}, {q.p})")
    return g.to(torch.float32)


def rotated_weight(q: QuantizedMatrix, grid: torch.Tensor | None = None) -> torch.Tensor:
    """s * grid[codes] as an (out, in) float32 matrix in the rotated basis."""
    q.validate()
    g = _grid_for(q, grid)
    out = torch.empty(q.out_features, q.in_features, dtype=torch.float32)
    step = _row_chunk(q.in_features)
    for r0 in range(0, q.out_features, step):
        r1 = min(r0 + step, q.out_features)
        out[r0:r1] = _chunk_rotated(q, r0, r1, g)
    return out


def dequantize_matrix(q: QuantizedMatrix, grid: torch.Tensor | None = None) -> torch.Tensor:
    """W_hat = D Hn (s * grid[codes]) blockwise: (out, in) float32."""
    q.validate()
    g = _grid_for(q, grid)
    signs = q.signs()
    out = torch.empty(q.out_features, q.in_features, dtype=torch.float32)
    step = _row_chunk(q.in_features)
    for r0 in range(0, q.out_features, step):
        r1 = min(r0 + step, q.out_features)
        out[r0:r1] = unrotate(_chunk_rotated(q, r0, r1, g), q.layout, signs)
    return out


def higgs_matmul(
    x: torch.Tensor, q: QuantizedMatrix, w_rot: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W_hat^T without the inverse rotation: rotate x blockwise and multiply by the
    rotated-domain weights (pass a cached `rotated_weight(q)` as w_rot to skip unpacking).
    x: (..., in) -> (..., out), in x's dtype."""
    if x.shape[-1] != q.in_features:
        raise InvalidConfigError(
            f"x has last dim {x.shape[-1]}, the matrix expects {q.in_features}"
        )
    if w_rot is None:
        w_rot = rotated_weight(q)
    xr = rotate(x, q.layout, q.signs())  # (..., in) float32 (float64 for float64 x)
    y = xr @ w_rot.to(device=xr.device, dtype=xr.dtype).T  # (..., out)
    return y.to(x.dtype)


def relative_error(W: torch.Tensor, W_hat: torch.Tensor) -> float:
    """t^2 = ||W_hat - W||_F^2 / ||W||_F^2 (float64 accumulation, row chunks)."""
    if W.shape != W_hat.shape:
        raise InvalidConfigError(f"shapes differ: {tuple(W.shape)} vs {tuple(W_hat.shape)}")
    w2 = W.reshape(W.shape[0], -1) if W.dim() > 1 else W.reshape(1, -1)
    h2 = W_hat.reshape(w2.shape)
    num = 0.0
    den = 0.0
    step = max(1, CHUNK_ELEMENTS // max(1, w2.shape[1]))
    for r0 in range(0, w2.shape[0], step):
        a = w2[r0 : r0 + step].to(torch.float64)
        b = h2[r0 : r0 + step].to(torch.float64)
        num += float((b - a).square().sum())
        den += float(a.square().sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
