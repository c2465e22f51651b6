"""The torch-free half of the engine: everything needed to decide what to quantize and how.

    config      HiggsConfig / LayerOverride, the shipped grids and their code bits
    layout      power-of-two rotation block layouts, the one power-of-two check
    grid_table  each shipped grid's MSE, read from the grid file's header with json alone
    profile     the sensitivity profile as data: ProfileConfig, Profile, cache keys, lookup
    allocator   the exact multiple-choice knapsack over per-layer options, the option menu
    plans       targets, predicted quality, allocations and the config they give
    stages      the stages a run reports progress in, and the unit each counts

The API process imports this package (and higgs_engine.errors) and nothing else of the engine;
tests/app/test_import_rules.py checks that no module it reaches imports torch, anywhere.

numpy is allowed here, in the allocator only: its DP fills layers x budget units x options
cells (about 210 x 1.5e5 x 20 for a SmolLM2-sized model at the default 1e-4 bits resolution)
in vectorised passes, one per (layer, option); a pure-Python loop over ~6e8 cells is not an
option for a request handler. The API image therefore installs numpy (one wheel, no native
dependencies); it never installs torch.
Measurement (profiles), quantization and checkpoint I/O stay in the rest of higgs_engine.
"""
