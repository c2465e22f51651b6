"""Nearest grid point search: the speed lever of HIGGS quantization.

nearest_points(z, grid) returns, for each row of z (M, p), the index of the grid point (n, p)
closest in Euclidean distance. Fast paths:
- p = 1: the grid is sorted once, and torch.bucketize on the midpoints gives the cell.
- p = 2: a lookup table over a fine square cell grid. A cell whose 4 corners have the same
  nearest grid point lies entirely in that point's Voronoi region (regions are convex), so it
  stores that point; other cells store a short candidate list (every point within
  d(centre) + 2 * half-diagonal of the cell centre, a guaranteed superset) that is checked
  exactly. Tuples outside the table fall back to brute force. The table is built through a
  coarser level of candidate lists, so building costs O(cells * few) rather than O(cells * n).
- otherwise: chunked brute force, argmin over ||c||^2 - 2 z.c.
- tuples on an accelerator (CUDA): `nearest_points_matmul`, docs/algorithm.md's chunked matrix
  product argmax 2 z.c - ||c||^2 in float32 on the device, whose two best points are then
  re-checked in float64 so that float32 rounding cannot pick the wrong point at a near-tie.
nearest_points_reference is the float64 brute-force twin the fast paths are tested against;
the two agree except at near-ties, where the distances achieved agree to float rounding.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from higgs_engine.errors import InvalidConfigError

__all__ = [
    "SEARCH_METHODS",
    "PointLookup",
    "build_lookup",
    "nearest_points",
    "nearest_points_brute",
    "nearest_points_matmul",
    "nearest_points_reference",
    "nearest_searcher",
]

BRUTE_CHUNK_ELEMENTS = 1 << 22  # tuples x grid points per brute-force chunk


def _check(z: torch.Tensor, grid: torch.Tensor) -> None:
    if grid.dim() != 2 or z.dim() != 2 or z.shape[1] != grid.shape[1]:
        raise InvalidConfigError(
            f"points {tuple(z.shape)} and grid {tuple(grid.shape)} must be (M, p) and (n, p)"
        )
    if grid.shape[0] == 0:
        raise InvalidConfigError("grid is empty")


def nearest_points_reference(z: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Float64 brute force over explicit squared differences (slow, obviously correct)."""
    _check(z, grid)
    g = grid.to(torch.float64)
    out = torch.empty(z.shape[0], dtype=torch.int64)
    step = max(1, BRUTE_CHUNK_ELEMENTS // (g.numel()))
    for s in range(0, z.shape[0], step):
        zz = z[s : s + step].to(torch.float64)  # (k, p)
        d = (zz[:, None, :] - g[None, :, :]).square().sum(-1)  # (k, n)
        out[s : s + step] = d.argmin(1)
    return out


def nearest_points_brute(z: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Chunked brute force in float32 via one matmul per chunk."""
    _check(z, grid)
    g = grid.to(torch.float32)
    half_norm = 0.5 * g.square().sum(1)  # (n,)
    out = torch.empty(z.shape[0], dtype=torch.int64)
    step = max(1, BRUTE_CHUNK_ELEMENTS // g.shape[0])
    for s in range(0, z.shape[0], step):
        zz = z[s : s + step].to(torch.float32)  # (k, p)
        # argmin ||z - c||^2 = argmin (||c||^2 / 2 - z.c); addmm fuses the two terms.
        d = torch.addmm(half_norm[None, :], zz, g.T, alpha=-1.0)  # (k, n)
        out[s : s + step] = d.argmin(1)
    return out


def nearest_points_matmul(z: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Device-agnostic search (the GPU path), result on z's device.

    Per chunk: float32 scores ||c||^2 / 2 - z.c as one matmul, the two best points, then their
    exact float64 distances. fp32 alone picks the wrong point at rare near-ties; with the
    re-check it agrees with `nearest_points_reference` except where three points are tied to
    float32 rounding (a Voronoi vertex), and even then the distance achieved is the same to
    rounding."""
    _check(z, grid)
    dev = z.device
    g = grid.to(device=dev, dtype=torch.float32)
    g64 = grid.to(device=dev, dtype=torch.float64)
    half_norm = 0.5 * g.square().sum(1)  # (n,)
    k = min(2, g.shape[0])
    out = torch.empty(z.shape[0], dtype=torch.int64, device=dev)
    step = max(1, BRUTE_CHUNK_ELEMENTS // g.shape[0])
    for s in range(0, z.shape[0], step):
        zz = z[s : s + step]
        d = torch.addmm(half_norm[None, :], zz.to(torch.float32), g.T, alpha=-1.0)  # (c, n)
        top = d.topk(k, dim=1, largest=False, sorted=True).indices  # (c, k)
        exact = (g64[top] - zz.to(torch.float64)[:, None, :]).square().sum(-1)  # (c, k)
        # argmin keeps the first of equal distances: the fp32 winner, or the lower index
        # when fp32 also tied (topk is sorted, ties in index order on every device we use).
        out[s : s + step] = top.gather(1, exact.argmin(1, keepdim=True)).squeeze(1)
    return out


# ----------------------------------------------------------------------------- p = 1


@dataclass(frozen=True)
class Lookup1D:
    """Cell table for a 1-D grid: `table` (cells,) int16 holds the bucket (index in sorted
    order) shared by the whole cell, or -1 when the cell holds a midpoint or is a border cell
    (those values go through torch.bucketize exactly)."""

    mids: torch.Tensor  # (n-1,) float32, sorted
    order: torch.Tensor  # (n,) sorted position -> grid index
    lo: float
    cell: float
    cells: int
    table: torch.Tensor
    sorted_input: bool  # the grid is already sorted: no index remapping needed


@lru_cache(maxsize=64)
def _lookup_1d(key: bytes) -> Lookup1D:
    g = torch.frombuffer(bytearray(key), dtype=torch.float32)
    vals, order = g.sort()
    mids = ((vals[1:] + vals[:-1]) / 2).contiguous()
    if vals.numel() < 2:
        return Lookup1D(mids, order, 0.0, 1.0, 1, torch.full((1,), -1, dtype=torch.int16), True)
    spacing = float((vals[1:] - vals[:-1]).min())
    lo, hi = float(vals[0]) - spacing, float(vals[-1]) + spacing
    # Cells of a quarter of the smallest spacing: few cells hold a midpoint.
    cells = int(min(1 << 16, max(4, math.ceil((hi - lo) / (spacing / 4)))))
    cell = (hi - lo) / cells
    edges = (lo + cell * torch.arange(cells + 1, dtype=torch.float64)).to(torch.float32)
    b = torch.bucketize(edges, mids)
    table = torch.where(b[1:] == b[:-1], b[:-1], -1)
    table[0] = table[-1] = -1  # clamped out-of-range values land here
    ident = bool((order == torch.arange(order.numel())).all())
    return Lookup1D(mids, order, lo, cell, cells, table.to(torch.int16), ident)


def _nearest_1d(z: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return _nearest_1d_lut(z, _lookup_1d(grid.to(torch.float32).contiguous().numpy().tobytes()))


def _nearest_1d_lut(z: torch.Tensor, lut: Lookup1D) -> torch.Tensor:
    x = z.reshape(-1).to(torch.float32)
    f = (x - lut.lo).mul_(1.0 / lut.cell).clamp_(0, lut.cells - 1).to(torch.int64)  # (M,)
    t = torch.gather(lut.table, 0, f).to(torch.int64)
    sel = (t < 0).nonzero().squeeze(1)
    if sel.numel():
        # right=False: a value exactly on a midpoint goes to the lower point, like argmin.
        t[sel] = torch.bucketize(x[sel], lut.mids)
    return t if lut.sorted_input else lut.order[t]


# ----------------------------------------------------------------------------- p = 2


def _ring_candidates(
    centres: torch.Tensor, half_diag: float, grid: torch.Tensor, pool: torch.Tensor
) -> torch.Tensor:
    """Candidate lists for square cells given by their centres (k, 2), float64.

    Any point x of a cell is within half_diag of its centre c, so the nearest grid point of x is
    within d(c) + 2 * half_diag of c, where d(c) is c's nearest distance (triangle inequality
    twice). Every grid point within that radius is a candidate: a guaranteed superset.
    `pool` (k, P) is a known superset per cell (an enclosing cell's candidates, or all points).
    Returns candidates (k, K) int64, each row padded with its first entry.
    """
    k = centres.shape[0]
    oks, pools = [], []
    step = max(1, BRUTE_CHUNK_ELEMENTS // pool.shape[1])
    kmax = 1
    for s in range(0, k, step):
        pl = pool[s : s + step]
        d = (grid[pl] - centres[s : s + step, None, :]).square().sum(-1).sqrt()  # (c, P)
        ok = d <= d.amin(1, keepdim=True) + 2 * half_diag + 1e-9
        # Padding repeats a list's first entry: keep only its first occurrence.
        ok[:, 1:] &= pl[:, 1:] != pl[:, :1]
        kmax = max(kmax, int(ok.to(torch.int32).sum(1).max()))
        oks.append(ok)
        pools.append(pl)
    out = torch.empty(k, kmax, dtype=torch.int64)
    row = 0
    for ok, pl in zip(oks, pools, strict=True):
        # A stable sort of "not kept" puts the kept candidates first, in pool order.
        order = (~ok).to(torch.int8).argsort(dim=1, stable=True)[:, :kmax]
        cand = pl.gather(1, order)
        kept = ok.gather(1, order)
        out[row : row + ok.shape[0]] = torch.where(kept, cand, cand[:, :1])
        row += ok.shape[0]
    return out


def _coarse_candidates(
    g: torch.Tensor, lo: float, extent: float, want: int
) -> tuple[torch.Tensor, int]:
    """Candidate lists on a cc x cc cell grid (cc = 8 * 2^k >= want, capped), built level by
    level: each level's lists are the pools of its four children, so no level costs cells * n."""
    n = g.shape[0]
    cc = 8
    iy, ix = torch.meshgrid(torch.arange(cc), torch.arange(cc), indexing="ij")
    cell = 2 * extent / cc
    pool = torch.arange(n).expand(cc * cc, n)
    cand = _ring_candidates(
        _cell_centres(lo, cell, ix.reshape(-1), iy.reshape(-1)), cell * math.sqrt(0.5), g, pool
    )
    while cc < want:
        cc2 = cc * 2
        cell = 2 * extent / cc2
        iy, ix = torch.meshgrid(torch.arange(cc2), torch.arange(cc2), indexing="ij")
        ix, iy = ix.reshape(-1), iy.reshape(-1)
        pool = cand[(iy // 2) * cc + ix // 2]  # (cc2^2, K_parent)
        cand = _ring_candidates(_cell_centres(lo, cell, ix, iy), cell * math.sqrt(0.5), g, pool)
        cc = cc2
    return cand, cc


def _cell_centres(lo: float, cell: float, ix: torch.Tensor, iy: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [lo + cell * (ix.to(torch.float64) + 0.5), lo + cell * (iy.to(torch.float64) + 0.5)], 1
    )


def _central_spacing(g: torch.Tensor) -> float:
    """Median nearest-neighbour distance among the grid points closest to the origin."""
    n = g.shape[0]
    if n < 3:
        return float(torch.cdist(g, g).max()) if n == 2 else 1.0
    central = g[g.norm(dim=1).argsort()[: max(3, n // 4)]]
    d = torch.cdist(central, g)
    d[d == 0] = math.inf  # the point itself
    return float(d.amin(1).median())


@dataclass(frozen=True)
class PointLookup:
    """Two-level cell lookup tables for a 2-D grid over the box [lo, -lo]^2.

    Coarse level: `coarse` (cc * cc, Kc) int64 candidate lists (guaranteed supersets).
    Fine level, f x f fine cells per coarse cell: `table` (cells * cells,) int16 (int32 if
    needed) indexed by iy * cells + ix; >= 0 is the unique nearest point of every point in the
    cell, < 0 encodes -1 - k, row k of `candidates` (U, K) int64, the distinct candidate lists
    (each padded with its first entry). Border cells are always ambiguous.
    """

    grid: torch.Tensor  # (n, 2) float32
    lo: float
    cell: float  # fine cell width
    cells: int  # fine cells per axis
    table: torch.Tensor
    candidates: torch.Tensor
    coarse: torch.Tensor
    factor: int  # fine cells per coarse cell, per axis

    @property
    def extent(self) -> float:
        return -self.lo

    @property
    def ambiguous_fraction(self) -> float:
        return float((self.table < 0).float().mean())


def _exact_via_coarse(
    z: torch.Tensor, grid: torch.Tensor, coarse: torch.Tensor, lo: float, ccell: float, cc: int
) -> torch.Tensor:
    """Exact nearest (float64) for points inside the box using the coarse candidate lists."""
    ix = ((z[:, 0] - lo) / ccell).floor_().clamp_(0, cc - 1).long()
    iy = ((z[:, 1] - lo) / ccell).floor_().clamp_(0, cc - 1).long()
    cell = iy.mul_(cc).add_(ix)  # (M,)
    gx, gy = grid[:, 0].contiguous(), grid[:, 1].contiguous()
    k = coarse.shape[1]
    out = torch.empty(z.shape[0], dtype=torch.int64)
    step = max(1, BRUTE_CHUNK_ELEMENTS // k)
    for s in range(0, z.shape[0], step):
        c = cell[s : s + step]
        # index_select on flat indices is much faster than advanced indexing on CPU.
        cand = coarse.index_select(0, c)  # (c, K)
        flat = cand.reshape(-1)
        dx = gx.index_select(0, flat).view(-1, k) - z[s : s + step, 0:1]  # (c, K)
        dy = gy.index_select(0, flat).view(-1, k) - z[s : s + step, 1:2]
        d = dx.square_().add_(dy.square_())
        out[s : s + step] = cand.gather(1, d.argmin(1, keepdim=True)).squeeze(1)
    return out


def nearest_points_exact_2d(
    z: torch.Tensor, grid: torch.Tensor, max_cells: int = 1024
) -> torch.Tensor:
    """Exact float64 nearest points for many 2-D queries (grid building, table corners):
    candidate supersets on a cell grid covering both the queries and the grid, then an exact
    check of the few candidates. Agrees with `nearest_points_reference` (up to exact ties)."""
    _check(z, grid)
    g = grid.to(torch.float64)
    zz = z.to(torch.float64)
    extent = max(float(g.abs().max()), float(zz.abs().max()) if zz.numel() else 0.0) * 1.001 + 1e-9
    spacing = _central_spacing(g)
    coarse, cc = _coarse_candidates(
        g, -extent, extent, min(max_cells, math.ceil(4 * extent / spacing))
    )
    return _exact_via_coarse(zz, g, coarse, -extent, 2 * extent / cc, cc)


def build_lookup(
    grid: torch.Tensor, fine_per_spacing: int = 32, max_cells: int = 2048
) -> PointLookup:
    """Build the two-level tables for a 2-D grid (deterministic, float64 geometry)."""
    if not 8 <= max_cells <= 4096:
        # _nearest_2d computes flat cell indices in float32: exact below 2^24 = 4096^2.
        raise InvalidConfigError(f"max_cells={max_cells} must be in 8..4096")
    g = grid.to(torch.float64)
    extent = float(g.abs().max()) * 1.05 + 1e-6
    lo = -extent
    spacing = _central_spacing(g)
    # Coarse cells of about half the central spacing keep the coarse lists short (~6 entries).
    coarse, cc = _coarse_candidates(
        g, lo, extent, min(max_cells // 4, math.ceil(4 * extent / spacing))
    )
    ccell = 2 * extent / cc
    # Fine cells: a power-of-two subdivision so each fine cell lies inside one coarse cell.
    factor = 1
    while cc * factor * 2 <= max_cells and ccell / factor > spacing / fine_per_spacing:
        factor *= 2
    cells = cc * factor
    cell = ccell / factor
    # Nearest point of every fine-cell corner; a cell whose 4 corners agree lies inside one
    # (convex) Voronoi region.
    ax = lo + cell * torch.arange(cells + 1, dtype=torch.float64)
    cy, cx = torch.meshgrid(ax, ax, indexing="ij")
    corners = torch.stack([cx.reshape(-1), cy.reshape(-1)], 1)  # (C, 2) as (x, y)
    cn = _exact_via_coarse(corners, g, coarse, lo, ccell, cc).reshape(
        cells + 1, cells + 1
    )  # [iy, ix]
    first = cn[:-1, :-1]
    same = (first == cn[1:, :-1]) & (first == cn[:-1, 1:]) & (first == cn[1:, 1:])
    # Border cells also take tuples from outside the box (indices are clamped), so they always
    # go through the exact check, which tests for "outside" on that small subset only.
    same[0, :] = same[-1, :] = same[:, 0] = same[:, -1] = False
    table = first.clone()
    amb_y, amb_x = (~same).nonzero(as_tuple=True)
    centres = _cell_centres(lo, cell, amb_x, amb_y)
    pool = coarse[(amb_y // factor) * cc + (amb_x // factor)]  # (A, Kc)
    cand = _ring_candidates(centres, cell * math.sqrt(0.5), g, pool)
    # Many ambiguous cells share a candidate list (along one Voronoi edge): store each once.
    candidates, inverse = torch.unique(cand, dim=0, return_inverse=True)
    table[amb_y, amb_x] = -1 - inverse
    small = max(int(g.shape[0]), candidates.shape[0]) < 32767
    return PointLookup(
        grid=grid.to(torch.float32).contiguous(),
        lo=lo,
        cell=cell,
        cells=cells,
        table=table.reshape(-1).to(torch.int16 if small else torch.int32).contiguous(),
        candidates=candidates,
        coarse=coarse,
        factor=factor,
    )


@lru_cache(maxsize=16)
def _cached_lookup(digest: str, shape: tuple[int, int], data: bytes) -> PointLookup:
    g = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
    return build_lookup(g)


def lookup_for(grid: torch.Tensor) -> PointLookup:
    """The (cached) lookup tables of a 2-D grid, keyed by its float32 bytes."""
    g = grid.to(torch.float32).contiguous()
    data = g.numpy().tobytes()
    return _cached_lookup(hashlib.sha1(data).hexdigest(), (g.shape[0], g.shape[1]), data)


def _nearest_2d(z: torch.Tensor, lut: PointLookup) -> torch.Tensor:
    z = z.to(torch.float32)
    # (M, 2) fine cell coordinates, clamped into the table (outside tuples land in border cells)
    # and truncated; the flat index iy * cells + ix stays below 2^24, so float32 holds it
    # exactly and a single conversion to int64 suffices.
    u = (z - lut.lo).mul_(1.0 / lut.cell).clamp_(0, lut.cells - 1).trunc_()
    flat = u[:, 1].mul(lut.cells).add_(u[:, 0]).to(torch.int64)  # (M,)
    # torch.gather is several times faster than advanced indexing on CPU.
    t = torch.gather(lut.table, 0, flat).to(torch.int64)  # (M,)
    sel = (t < 0).nonzero().squeeze(1)
    if sel.numel():
        # coordinate-major (K, A) candidates and distances, the first minimum over K by
        # min(0) (as argmin(1); reductions over a short last dimension are slow on the CPU)
        zx = z[:, 0].index_select(0, sel)  # (A,)
        zy = z[:, 1].index_select(0, sel)
        rows = t.index_select(0, sel).neg_().sub_(1)  # candidate list of each tuple
        cand = lut.candidates.T.contiguous().index_select(1, rows)  # (K, A)
        flat = cand.view(-1)
        k = cand.shape[0]
        dx = lut.grid[:, 0].index_select(0, flat).view(k, -1).sub_(zx)  # (K, A)
        dy = lut.grid[:, 1].index_select(0, flat).view(k, -1).sub_(zy)
        d = dx.square_().add_(dy.square_())
        res = cand.gather(0, d.min(0, keepdim=True).indices).squeeze(0)
        if float(zx.abs().max()) >= lut.extent or float(zy.abs().max()) >= lut.extent:
            far = ((zx.abs() >= lut.extent) | (zy.abs() >= lut.extent)).nonzero().squeeze(1)
            zf = torch.stack([zx.index_select(0, far), zy.index_select(0, far)], 1)
            res[far] = nearest_points_brute(zf, lut.grid)
        t.index_copy_(0, sel, res)
    return t


class PairSearch:
    """`_nearest_2d` for many small batches of pairs given coordinate-major, zt (2, M) (the
    GPTQ sweep: one column pair of every row per call), with few tensor operations per call
    and every operation on contiguous rows of length M: every cell of the fine table points at
    a candidate list, the unambiguous cells at a list repeating their one point, so every
    tuple takes the same path. The candidate lists, their order and the float32 distances are
    those of `_nearest_2d`: same result."""

    def __init__(self, lut: PointLookup) -> None:
        n = int(lut.grid.shape[0])
        k = int(lut.candidates.shape[1])
        single = torch.arange(n, dtype=torch.int64)[:, None].expand(n, k)
        # (K, n + U): column r is candidate list r (the first n: the single points).
        self.cands_t = torch.cat([single, lut.candidates]).T.contiguous()
        t = lut.table.to(torch.int64)
        self.table = torch.where(t >= 0, t, n - 1 - t).to(torch.int32)  # cell -> list
        self.grid = lut.grid  # (n, 2) float32
        self.gx, self.gy = lut.grid[:, 0].contiguous(), lut.grid[:, 1].contiguous()
        self.k = k
        self.lo = lut.lo
        self.inv_cell = 1.0 / lut.cell
        self.top = float(lut.cells - 1)
        self.cells = float(lut.cells)
        self.extent = lut.extent
        self.half_norm = 0.5 * lut.grid.square().sum(1)  # as nearest_points_brute

    def __call__(self, zt: torch.Tensor) -> torch.Tensor:
        zt = zt.to(torch.float32)
        x, y = zt[0], zt[1]  # (M,) each
        # Same cell arithmetic as _nearest_2d (float32, flat index exact below 2^24).
        u = (zt - self.lo).mul_(self.inv_cell).clamp_(0, self.top).trunc_()  # (2, M)
        flat = torch.add(u[0], u[1], alpha=self.cells).to(torch.int64)  # iy * cells + ix
        cand = self.cands_t.index_select(1, self.table.index_select(0, flat))  # (K, M)
        flat_cand = cand.view(-1)
        # dx^2 + dy^2 per candidate: the float32 sum of `_nearest_2d`'s .square().sum(-1).
        dx = self.gx.index_select(0, flat_cand).view(self.k, -1).sub_(x)  # (K, M)
        dy = self.gy.index_select(0, flat_cand).view(self.k, -1).sub_(y)
        d = dx.square_().add_(dy.square_())
        # min(0) over the K rows (first minimum, as argmin(1)); argmin(0) is several times slower.
        res = cand.gather(0, d.min(0, keepdim=True).indices).squeeze(0)
        lo, hi = torch.aminmax(zt)
        if -float(lo) >= self.extent or float(hi) >= self.extent:
            # Tuples outside the tables: nearest_points_brute's arithmetic on just those (its
            # per-call set-up and reductions over the short axis cost more than the search).
            far = ((x.abs() >= self.extent) | (y.abs() >= self.extent)).nonzero().squeeze(1)
            zf = zt.index_select(1, far).T
            d_far = torch.addmm(self.half_norm[None, :], zf, self.grid.T, alpha=-1.0)
            res[far] = d_far.argmin(1)
        return res


@lru_cache(maxsize=16)
def _pair_search(digest: str, shape: tuple[int, int], data: bytes) -> PairSearch:
    return PairSearch(_cached_lookup(digest, shape, data))


def nearest_searcher(grid: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`nearest_points(zt.T, grid)` for CPU tuples given coordinate-major, zt (p, M), with
    the grid's lookup tables prepared once: for callers that search many small batches
    against one grid (the GPTQ sweep)."""
    if grid.dim() != 2 or grid.shape[0] == 0:
        raise InvalidConfigError(f"grid of shape {tuple(grid.shape)} must be (n, p), n >= 1")
    g = grid.to(torch.float32).contiguous()
    p = int(g.shape[1])
    if p == 1:
        lut1 = _lookup_1d(g.numpy().tobytes())
        return lambda zt: _nearest_1d_lut(zt, lut1)
    if p == 2 and g.shape[0] > 8:
        data = g.numpy().tobytes()
        return _pair_search(hashlib.sha1(data).hexdigest(), (g.shape[0], 2), data)
    return lambda zt: nearest_points_brute(zt.T, g)


SEARCH_METHODS = ("auto", "lookup", "matmul")


def nearest_points(z: torch.Tensor, grid: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Index (M,) int64 of the nearest grid point (n, p) for each row of z (M, p), on z's device.

    method "auto": the CPU lookup tables for tuples on the CPU, `nearest_points_matmul` for
    tuples on an accelerator; "lookup" / "matmul" force one (tests, benchmarks)."""
    _check(z, grid)
    if method not in SEARCH_METHODS:
        raise InvalidConfigError(f"search method {method!r} is not one of {SEARCH_METHODS}")
    p = grid.shape[1]
    if z.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=z.device)
    if method == "matmul" or (method == "auto" and z.device.type != "cpu"):
        return nearest_points_matmul(z, grid)
    if z.device.type != "cpu":  # the lookup tables live on the CPU
        return nearest_points(z.cpu(), grid.cpu(), "lookup").to(z.device)
    if p == 1:
        return _nearest_1d(z, grid)
    if p == 2 and grid.shape[0] > 8:
        return _nearest_2d(z, lookup_for(grid))
    return nearest_points_brute(z, grid)
