"""Choosing each layer's compressed-tensors scheme with the linearity theorem.

1. For each linear layer and each scheme of the menu that vLLM runs for its shape, the relative
   error t^2 = ||W_hat - W||^2 / ||W||^2 of our quantizer (higgs_engine.ct.quantizer), on
   evenly spaced rows when the layer is large (a mean over rows: a few hundred thousand
   values pin it well), and the bits the layer stores with it (every scale and zero point).
2. The model's profile gives alpha per layer; planning.allocator's exact DP picks one scheme
   per allocation unit: least predicted change sum(alpha * t^2) within a bit budget over the
   linear layers, or the fewest bits within a predicted bound.

vLLM fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj and runs one scheme per
fused layer, so those layers form one unit (their costs and errors summed) and get one scheme.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from higgs_engine.ct.quantizer import dequantize, quantize_layer, relative_error
from higgs_engine.ct.schemes import CT_MENU, CtScheme
from higgs_engine.ct.writer import CtAssignment, ct_layers
from higgs_engine.errors import InvalidConfigError
from higgs_engine.formats.base import torch_dtype
from higgs_engine.model_structure import LayerSpec
from higgs_engine.planning.allocator import DPTable, Problem, solve
from higgs_engine.planning.profile import Profile
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.safetensors_stream import CheckpointReader

__all__ = [
    "DEFAULT_SAMPLE_VALUES",
    "FUSED",
    "CtAllocation",
    "CtMeasurement",
    "allocate_schemes",
    "build_ct_problem",
    "fusion_units",
    "measure_options",
    "predicted_change",
]

DEFAULT_SAMPLE_VALUES = 1 << 18
# Layers vLLM runs as one fused Linear (one scheme): siblings under the same parent module.
FUSED: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
)


@dataclass(frozen=True)
class CtMeasurement:
    """Every linear layer's t^2 and stored bits with every menu scheme (inf: vLLM runs no
    kernel for that scheme on the layer's shape, or the layer cannot be quantized at all)."""

    layers: tuple[LayerSpec, ...]
    menu: tuple[CtScheme, ...]
    t2: np.ndarray  # (L, J) float64
    bits: np.ndarray  # (L, J) float64
    refused: dict[str, dict[str, str]]  # layer -> {scheme: why vLLM runs no kernel for it}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.layers]


def _sample_rows(n_rows: int, cols: int, sample_values: int) -> torch.Tensor | None:
    k = max(1, sample_values // max(cols, 1))
    if k >= n_rows:
        return None
    rows: torch.Tensor = torch.unique(torch.linspace(0, n_rows - 1, k).round().to(torch.int64))
    return rows


def measure_options(
    source: Path,
    menu: Sequence[CtScheme] = CT_MENU,
    *,
    dtype: str = "float16",
    sample_values: int = DEFAULT_SAMPLE_VALUES,
    progress: ProgressCallback | None = None,
) -> CtMeasurement:
    """t^2 and bits of every linear layer of `source` with every scheme of `menu` (stage
    "measuring", layers done/total). A GPT-2 Conv1D layer can only be kept."""
    td = torch_dtype(dtype)
    scale_bits = 8 * torch.tensor([], dtype=td).element_size()
    specs = ct_layers(Path(source))
    t2 = np.full((len(specs), len(menu)), np.inf)
    bits = np.full((len(specs), len(menu)), np.inf)
    refused: dict[str, dict[str, str]] = {}
    report(progress, "measuring", 0, len(specs))
    with CheckpointReader(Path(source)) as reader:
        for i, spec in enumerate(specs):
            w = spec.weight(reader)
            rows = _sample_rows(spec.out_features, spec.in_features, sample_values)
            ws = w if rows is None else w[rows]
            why: dict[str, str] = {}
            for j, scheme in enumerate(menu):
                reason = scheme.unfit_reason(spec.out_features, spec.in_features)
                if reason is None and spec.transposed and not scheme.keep:
                    reason = "a GPT-2 Conv1D, not a Linear"
                if reason is not None:
                    why[scheme.name] = reason
                    continue
                bits[i, j] = scheme.layer_bits(spec.out_features, spec.in_features, scale_bits)
                t2[i, j] = (
                    0.0
                    if scheme.keep
                    else relative_error(ws, dequantize(quantize_layer(ws, scheme, td)))
                )
            refused[spec.name] = why
            report(progress, "measuring", i + 1, len(specs))
    return CtMeasurement(tuple(specs), tuple(menu), t2, bits, refused)


def fusion_units(names: Sequence[str]) -> list[list[int]]:
    """Indices of `names` grouped into allocation units: the members of a fused set (FUSED,
    same parent module) together, every other layer alone; units ordered by first member."""
    units: dict[tuple[str, int], list[int]] = {}
    for i, name in enumerate(names):
        parent, _, leaf = name.rpartition(".")
        key = (name, -1)
        for k, fused in enumerate(FUSED):
            if leaf in fused:
                key = (parent, k)
        units.setdefault(key, []).append(i)
    return sorted(units.values(), key=lambda u: u[0])


def _alphas(m: CtMeasurement, alphas: Mapping[str, float] | Profile) -> np.ndarray:
    """alpha per measured layer; a layer the profile lacks gets the largest alpha (kept
    accurate rather than guessed cheap)."""
    a = alphas.alphas() if isinstance(alphas, Profile) else dict(alphas)
    known = [float(a[n]) for n in m.names if n in a]
    if not known:
        raise InvalidConfigError(
            "the profile names none of the checkpoint's linear layers; profile the same model"
        )
    bad = [n for n in m.names if n in a and not (math.isfinite(a[n]) and a[n] >= 0)]
    if bad:
        raise InvalidConfigError(f"alpha must be finite and >= 0; bad for layers {bad[:5]}")
    worst = max(known)
    return np.array([float(a.get(n, worst)) for n in m.names], dtype=np.float64)


def build_ct_problem(
    m: CtMeasurement, alphas: Mapping[str, float] | Profile
) -> tuple[Problem, list[list[int]]]:
    """The allocator's instance over allocation units (fusion_units): cost = the members'
    bits summed, error = sum of alpha * t^2 (inf where a member cannot take the scheme)."""
    a = _alphas(m, alphas)
    units = fusion_units(m.names)
    err = a[:, None] * np.where(np.isfinite(m.t2), m.t2, 0.0)
    err = np.where(np.isfinite(m.bits), err, np.inf)
    cost = np.array([m.bits[u].sum(axis=0) for u in units], dtype=np.float64)  # inf stays inf
    error = np.array([err[u].sum(axis=0) for u in units], dtype=np.float64)
    if not np.all(np.isfinite(cost).any(axis=1)):
        raise InvalidConfigError("some layer has no scheme at all; keep 16-bit on the menu")
    numel = np.array([sum(m.layers[i].numel for i in u) for u in units], dtype=np.int64)
    problem = Problem(
        names=tuple("+".join(m.names[i] for i in u) for u in units),
        numel=numel,
        options=m.menu,  # type: ignore[arg-type]
        cost_bits=cost,
        error=np.ascontiguousarray(error),
        grid_cost=np.zeros(len(m.menu)),
    )
    return problem, units


@dataclass(frozen=True)
class CtAllocation:
    assignment: CtAssignment
    predicted: float  # sum of alpha * t^2 of the chosen schemes (the profile's metric)
    avg_bits: float  # over the linear layers, every scale and zero point counted
    total_bits: float


def _allocation(
    m: CtMeasurement, problem: Problem, units: list[list[int]], choice: Sequence[int]
) -> CtAllocation:
    schemes: dict[str, CtScheme] = {}
    reasons: dict[str, str] = {}
    for unit, j in zip(units, choice, strict=True):
        for i in unit:
            schemes[m.names[i]] = m.menu[j]
            if m.menu[j].keep:
                reasons[m.names[i]] = "the allocator kept it 16-bit"
    idx = np.arange(len(units))
    ch = np.asarray(choice, dtype=np.int64)
    predicted = float(math.fsum(problem.error[idx, ch].tolist()))
    total = float(problem.cost_bits[idx, ch].sum())
    return CtAllocation(
        CtAssignment(schemes, reasons), predicted, total / problem.total_numel, total
    )


def allocate_schemes(
    m: CtMeasurement,
    alphas: Mapping[str, float] | Profile,
    *,
    avg_bits: float | None = None,
    max_predicted: float | None = None,
    resolution: float = 1e-4,
) -> CtAllocation:
    """Least predicted change with at most `avg_bits` bits per linear weight (every scale and
    zero point counted), or the fewest bits whose predicted change is at most `max_predicted`.
    A budget below every layer's cheapest scheme raises InfeasibleTargetError naming the
    smallest possible."""
    problem, units = build_ct_problem(m, alphas)
    if avg_bits is not None and max_predicted is None:
        cap = min(avg_bits, problem.max_avg_bits())
        table: DPTable = solve(problem, cap, resolution)  # raises below the smallest budget
        alloc = table.allocate(cap)
    elif max_predicted is not None and avg_bits is None:
        alloc = solve(problem, None, resolution).smallest_within(max_predicted)
    else:
        raise InvalidConfigError("give exactly one of avg_bits and max_predicted")
    return _allocation(m, problem, units, alloc.choice)


def predicted_change(
    m: CtMeasurement, alphas: Mapping[str, float] | Profile, assignment: CtAssignment
) -> float:
    """sum(alpha * t^2) of an assignment (a layer not assigned counts as kept: 0)."""
    a = _alphas(m, alphas)
    pos = {s.name: j for j, s in enumerate(m.menu)}
    total = []
    for i, name in enumerate(m.names):
        scheme = assignment.scheme_of(name)
        if scheme.keep:
            continue
        if scheme.name not in pos or not math.isfinite(float(m.t2[i, pos[scheme.name]])):
            raise InvalidConfigError(f"layer {name} was not measured with scheme {scheme.name}")
        total.append(float(a[i] * m.t2[i, pos[scheme.name]]))
    return math.fsum(total)
