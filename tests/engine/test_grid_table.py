"""The torch-free MSE table and layout agree with the torch modules they stand in for."""

from __future__ import annotations

import pytest

from higgs_engine import grids, hadamard
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning import grid_table, layout


def test_grid_table_matches_grids() -> None:
    table = grid_table.grid_mse_table()
    assert sorted(table) == grids.available_grids()
    for (p, n), mse in table.items():
        assert grid_table.grid_mse(p, n) == grids.grid_mse(p, n) == mse


def test_unknown_grid_is_a_clear_error() -> None:
    with pytest.raises(InvalidConfigError, match="p=3"):
        grid_table.grid_mse(3, 8)


def test_layout_is_the_one_hadamard_uses() -> None:
    assert hadamard.block_layout is layout.block_layout
    assert layout.block_layout(576, 1024) == [512, 64]
    assert layout.block_layout(1000, 1024) == [512, 256, 128, 64, 32, 8]
