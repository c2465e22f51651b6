"""The DP allocator against brute force, plus determinism, infeasibility and the Pareto curve."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from higgs_engine.errors import InfeasibleTargetError, InvalidConfigError
from higgs_engine.planning.allocator import (
    AllocLayer,
    DPTable,
    Option,
    allocate,
    brute_force,
    build_problem,
    default_options,
    grid_bits,
    layer_bits,
    solve,
)
from higgs_engine.planning.config import SUPPORTED_GRIDS, HiggsConfig, MatrixSpec

# Per-coordinate MSEs close to the real grids', so instances look like real ones; the
# allocator itself takes any non-negative numbers.
FAKE_MSE = {
    (1, 2): 0.3634,
    (1, 4): 0.1175,
    (1, 8): 0.03454,
    (2, 16): 0.107,
    (2, 64): 0.0295,
    (2, 256): 0.0078,
}


def fake_mse(o: Option) -> float:
    if (o.p, o.n) in FAKE_MSE:
        return FAKE_MSE[(o.p, o.n)]
    return 0.36 * 2 ** (-2 * math.log2(o.n) / o.p)


SMALL_MENU = (
    Option(1, 2),
    Option(2, 16),
    Option(2, 64),
    Option(1, 8),
    Option(2, 256),
    Option(0, 0),
)


def test_default_options_cover_every_grid_and_fp16() -> None:
    opts = default_options()
    grids = {(o.p, o.n) for o in opts if not o.keep}
    assert grids == {(p, n) for p, ns in SUPPORTED_GRIDS.items() for n in ns}
    assert opts[-1].keep
    assert len(opts) == 8 + 11 + 1


def test_layer_bits_counts_scales_of_the_real_block_layout() -> None:
    # 576 = 512 + 64 with g=256: 2 + 1 = 3 fp16 scales per row
    bits = layer_bits(Option(2, 256), 576, 576, group_size=256, rotation_block=1024)
    assert bits == 576 * 576 * 4 + 16 * 576 * 3
    # 1536 = 1024 + 512 -> 4 + 2 groups of 256
    assert layer_bits(Option(1, 16), 10, 1536) == 10 * 1536 * 4 + 16 * 10 * 6
    # p=2, n=8: 3 bits per pair = 1.5 bits per weight; a 64-block is one group
    assert layer_bits(Option(2, 8), 4, 64, group_size=256) == 4 * 64 * 1.5 + 16 * 4
    assert layer_bits(Option(0, 0), 3, 7) == 16 * 21
    assert layer_bits(Option(0, 0), 3, 7, keep_bits=32) == 32 * 21
    # the grid is paid once per artifact: n points of p fp16 coordinates
    assert grid_bits(Option(2, 256)) == 32 * 512 and grid_bits(Option(0, 0)) == 0
    # p=2, n=8 on an odd number of pairs: 3-bit codes padded to a whole byte
    assert layer_bits(Option(2, 8), 1, 6, group_size=256) == 16 + 2 * 16  # 6 = 4 + 2: two blocks


@pytest.mark.parametrize("shape", [(8, 64), (5, 96), (3, 576), (4, 1000), (2, 6)])
@pytest.mark.parametrize("grid", [(1, 2), (1, 8), (2, 8), (2, 16), (2, 64)])
@pytest.mark.parametrize("group_size", [32, 256])
def test_layer_bits_match_the_quantizer_byte_for_byte(
    shape: tuple[int, int], grid: tuple[int, int], group_size: int
) -> None:
    import torch

    from higgs_engine.quantize import quantize_matrix

    q = quantize_matrix(
        torch.randn(*shape, generator=torch.Generator().manual_seed(0)),
        MatrixSpec(*grid, group_size=group_size),
    )
    stored = 8 * sum(t.numel() * t.element_size() for t in q.to_tensors().values())
    assert layer_bits(Option(*grid), *shape, group_size=group_size) == stored


def test_grid_storage_is_counted_once_per_distinct_grid() -> None:
    layers = [AllocLayer("a", 64, 64, 1.0), AllocLayer("b", 64, 64, 1.0)]
    problem = build_problem(layers, [Option(2, 16), Option(2, 256)], mse=fake_mse)
    one = 2 * layer_bits(Option(2, 256), 64, 64) + grid_bits(Option(2, 256))
    assert problem.total_bits([1, 1]) == one
    two = layer_bits(Option(2, 16), 64, 64) + layer_bits(Option(2, 256), 64, 64)
    assert problem.total_bits([0, 1]) == two + grid_bits(Option(2, 16)) + grid_bits(Option(2, 256))


def test_odd_widths_cannot_take_p2_grids() -> None:
    problem = build_problem(
        [AllocLayer("odd", 8, 63, 1.0)], [Option(2, 256), Option(1, 16), Option(0, 0)], mse=fake_mse
    )
    assert not problem.allowed[0, 0]
    a = solve(problem).allocate(100.0)
    assert a.options[0] in (Option(1, 16), Option(0, 0))
    with pytest.raises(InvalidConfigError, match="no allowed option"):
        build_problem([AllocLayer("odd", 8, 63, 1.0)], [Option(2, 256)], mse=fake_mse)


def test_layer_bits_rejects_bad_shapes() -> None:
    with pytest.raises(InvalidConfigError, match="-1"):
        layer_bits(Option(2, 256), -1, 64)


def random_layers(rng: np.random.Generator, n_layers: int) -> list[AllocLayer]:
    widths = [64, 96, 128, 192, 256]
    return [
        AllocLayer(
            f"l{i}", int(rng.choice(widths)), int(rng.choice(widths)), float(rng.lognormal(0, 2))
        )
        for i in range(n_layers)
    ]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_layers=st.integers(1, 4),
    n_opts=st.integers(1, 5),
    frac=st.floats(0.0, 1.0),
    resolution=st.sampled_from([1e-3, 1e-2, 0.05]),
)
def test_dp_matches_brute_force(
    seed: int, n_layers: int, n_opts: int, frac: float, resolution: float
) -> None:
    rng = np.random.default_rng(seed)
    menu = tuple(sorted(rng.choice(len(SMALL_MENU), size=n_opts, replace=False).tolist()))
    problem = build_problem(
        random_layers(rng, n_layers), [SMALL_MENU[i] for i in menu], mse=fake_mse
    )
    lo, hi = problem.min_avg_bits(), problem.max_avg_bits()
    avg = lo + frac * (hi - lo)
    table = DPTable(problem, None, resolution)
    # exact for the discretisation: the table's answer for any budget of b units is the best
    # error over every assignment whose discretised cost fits in b
    b = round(frac * table.capacity)
    ref = brute_force(problem, b, table.units)
    assert ref is not None  # the cheapest assignment always fits
    assert table.allocate_units(b).predicted == pytest.approx(ref[0], rel=1e-12, abs=1e-15)
    # the real size (layers + each distinct grid once) never exceeds the budget
    a = table.allocate(avg)
    assert a.total_bits <= avg * problem.total_numel * (1 + 1e-12)
    assert a.total_bits == problem.total_bits(a.choice)
    # against the continuous problem: at least as good as the best real-cost assignment with one
    # unit per layer and every grid's storage taken off the budget
    slack_budget = avg * problem.total_numel - n_layers * table.unit - table.all_grid_bits
    real_best = min(
        (
            math.fsum(problem.error[i, j] for i, j in enumerate(ch))
            for ch in np.ndindex(*([len(menu)] * n_layers))
            if problem.total_bits(ch) <= slack_budget
        ),
        default=math.inf,
    )
    assert a.predicted <= real_best + 1e-12


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), n_layers=st.integers(1, 4), bound=st.floats(0.0, 1.0))
def test_dual_is_the_smallest_within_the_bound(seed: int, n_layers: int, bound: float) -> None:
    rng = np.random.default_rng(seed)
    problem = build_problem(random_layers(rng, n_layers), SMALL_MENU, mse=fake_mse)
    table = solve(problem, None, 1e-2)
    r = bound * float(problem.error.max(axis=1).sum())
    a = table.smallest_within(r)
    assert a.predicted <= r + 1e-12
    units = sum(int(table.units[i, j]) for i, j in enumerate(a.choice))
    # no assignment with fewer discretised units meets the bound
    for ch in np.ndindex(*([len(SMALL_MENU)] * n_layers)):
        e = math.fsum(problem.error[i, j] for i, j in enumerate(ch))
        if e <= r - 1e-12:
            assert sum(int(table.units[i, j]) for i, j in enumerate(ch)) >= units


def test_same_input_same_allocation_byte_for_byte() -> None:
    rng = np.random.default_rng(3)
    layers = random_layers(rng, 30)
    # many exact ties: identical layers with identical alphas
    layers += [AllocLayer(f"tie{i}", 128, 128, 1.0) for i in range(6)]
    runs = []
    for _ in range(2):
        problem = build_problem(layers, default_options(), mse=fake_mse)
        table = solve(problem, None, 1e-3)
        runs.append(
            pickle.dumps((table.allocate(4.0), table.smallest_within(0.5), table.pareto(0.1)))
        )
        runs.append(pickle.dumps(table.pointers.tobytes()))
    assert runs[0] == runs[2] and runs[1] == runs[3]


def test_allocate_with_a_capped_table_equals_the_full_table() -> None:
    rng = np.random.default_rng(5)
    problem = build_problem(random_layers(rng, 12), default_options(), mse=fake_mse)
    full = solve(problem, None, 1e-3)
    for bits in (2.0, 3.08, 4.08, 5.5):
        assert allocate(problem, bits, 1e-3) == full.allocate(bits)


def test_infeasible_budget_names_the_budget_and_the_minimum() -> None:
    problem = build_problem([AllocLayer("a", 64, 64, 1.0)], [Option(2, 256)], mse=fake_mse)
    min_bits = problem.min_avg_bits()
    with pytest.raises(InfeasibleTargetError) as e:
        allocate(problem, 2.0)
    assert "avg_bits=2" in str(e.value) and f"{min_bits:.4f}" in str(e.value)
    with pytest.raises(InfeasibleTargetError, match="predicted increase"):
        solve(problem).smallest_within(0.0)
    with pytest.raises(InvalidConfigError, match="nan"):
        allocate(problem, float("nan"))


def test_bad_alpha_and_empty_inputs_are_rejected() -> None:
    with pytest.raises(InvalidConfigError, match="alpha"):
        build_problem([AllocLayer("a", 64, 64, -1.0)], mse=fake_mse)
    with pytest.raises(InvalidConfigError, match="no layers"):
        build_problem([], mse=fake_mse)
    with pytest.raises(InvalidConfigError, match="resolution"):
        solve(build_problem([AllocLayer("a", 64, 64, 1.0)], mse=fake_mse), None, 0.0)


def test_pareto_curve_is_monotone_and_ends_at_zero_error() -> None:
    rng = np.random.default_rng(7)
    problem = build_problem(random_layers(rng, 20), default_options(), mse=fake_mse)
    table = solve(problem, None, 1e-3)
    for pts in (table.pareto(), table.pareto(0.25)):
        bits = [p.avg_bits for p in pts]
        pred = [p.predicted for p in pts]
        assert all(x < y for x, y in zip(pred[1:], pred[:-1], strict=True))
        assert bits[0] == pytest.approx(problem.min_avg_bits())
        assert pred[-1] == 0.0  # everything in 16 bits
    # the primal reaches every point once given the rounding slack (one unit per layer)
    for p in table.pareto(0.5):
        slack = len(problem.names) * table.resolution + table.all_grid_bits / problem.total_numel
        assert table.allocate(p.avg_bits + slack).predicted <= p.predicted + 1e-12


def test_more_bits_never_predict_worse_and_sensitive_layers_get_more() -> None:
    layers = [AllocLayer("quiet", 256, 256, 0.01), AllocLayer("loud", 256, 256, 10.0)]
    problem = build_problem(layers, default_options(), mse=fake_mse)
    table = solve(problem)
    prev = math.inf
    for bits in np.linspace(problem.min_avg_bits(), 8, 30):
        a = table.allocate(float(bits))
        assert a.predicted <= prev
        prev = a.predicted
    a = table.allocate(4.0)
    assert problem.cost_bits[1, a.choice[1]] > problem.cost_bits[0, a.choice[0]]


def test_overrides_make_a_valid_config() -> None:
    layers = [AllocLayer(f"m.{i}", 64, 128, float(i + 1)) for i in range(5)]
    a = allocate(build_problem(layers, default_options(), mse=fake_mse), 5.0)
    cfg = HiggsConfig(overrides=a.overrides())
    for name, o in zip(a.names, a.options, strict=True):
        assert cfg.grid_for(name) == (None if o.keep else (o.p, o.n))


def test_measured_mse_replaces_grid_mse() -> None:
    layers = [AllocLayer("a", 64, 64, 2.0)]
    measured = np.array([[0.5, 0.25]])
    problem = build_problem(layers, [Option(2, 16), Option(2, 256)], measured_mse=measured)
    assert problem.error.tolist() == [[1.0, 0.5]]
    with pytest.raises(InvalidConfigError, match="shape"):
        build_problem(layers, [Option(2, 16)], measured_mse=measured)
