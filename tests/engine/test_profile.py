"""Profiles on a tiny real checkpoint: noise injection, the Fisher estimate, resume and cache."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from devtools.profiles import get_profile
from higgs_engine.dynamic import calibration_windows
from higgs_engine.errors import CancelledError, InvalidConfigError, ProfileNotFoundError
from higgs_engine.model_loading import load_float_model
from higgs_engine.planning.profile import Profile, ProfileConfig, ProfileRequest
from higgs_engine.profile import BlockReplay, ProfileRun, compute_profile, fit_through_origin
from tests.fixtures import TINY_TEXT, build_tiny_checkpoint

CFG = ProfileConfig(context=32, windows=2, data_free="random")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("prof") / "llama")


@pytest.fixture(scope="module")
def noise_profile(ckpt: Path) -> Profile:
    return get_profile(ckpt, CFG)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[int]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0] * len(x)
        for k, i in enumerate(order):
            r[i] = k
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def test_fit_through_origin() -> None:
    assert fit_through_origin([1.0, 2.0], [2.0, 4.0]) == 2.0
    assert fit_through_origin([0.005, 0.02], [0.01, 0.03]) == pytest.approx(
        (0.005 * 0.01 + 0.02 * 0.03) / (0.005**2 + 0.02**2)
    )


def test_noise_profile_is_linear_and_covers_every_layer(noise_profile: Profile) -> None:
    names = [la.name for la in noise_profile.layers]
    assert len(names) == 14 and names[0] == "model.layers.0.self_attn.q_proj"
    assert noise_profile.complete and noise_profile.calibration == "random:0"
    for la in noise_profile.layers:
        assert la.alpha > 0
        assert [p[0] for p in la.points] == [0.005, 0.02]
        # KL grows with the noise level roughly linearly (KL/t^2 within 2x between levels)
        r = (la.points[1][1] / 0.02) / (la.points[0][1] / 0.005)
        assert 0.5 < r < 2.0, (la.name, la.points)
    # forwards: base (capture + check + base log-probs) + layers x levels x windows
    assert noise_profile.cost["forward_passes"] >= 14 * 2 * 2


def test_profile_is_deterministic(ckpt: Path, noise_profile: Profile) -> None:
    again = get_profile(ckpt, CFG)
    assert json.dumps(again.layers and [la.__dict__ for la in again.layers]) == json.dumps(
        [la.__dict__ for la in noise_profile.layers]
    )


def test_replay_from_a_block_matches_the_full_forward(ckpt: Path) -> None:
    model, _ = load_float_model(ckpt)
    windows = calibration_windows(model, None, None, CFG)
    runner = BlockReplay(model, windows)
    assert runner.blocks is not None  # llama: the fast path is used
    w = dict(model.named_modules())["model.layers.1.mlp.up_proj"].weight.data
    w.mul_(1.5)  # a changed layer in block 1: replay must see it
    fast = runner.log_probs(1, "model.layers.1.mlp.up_proj")
    slow = runner.log_probs(1)  # full forward
    assert runner.block_of("model.layers.1.mlp.up_proj") == 1
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_interrupted_profile_resumes_where_it_stopped(
    ckpt: Path, tmp_path: Path, noise_profile: Profile
) -> None:
    partial = tmp_path / "p.json"
    calls: list[tuple[str, int, int]] = []

    def stop_after_5(stage: str, done: int, total: int) -> bool:
        calls.append((stage, done, total))
        return done < 5

    model, _ = load_float_model(ckpt)
    windows = calibration_windows(model, None, None, CFG)
    names = [la.name for la in noise_profile.layers]

    def run(progress: Callable[[str, int, int], bool | None]) -> Profile:
        request = ProfileRequest(
            noise_profile.model, noise_profile.revision, "random:0", CFG, tuple(names)
        )
        return compute_profile(model, ProfileRun(request, partial, progress), windows)

    with pytest.raises(CancelledError):
        run(stop_after_5)
    saved = Profile.load(partial)
    assert not saved.complete and len(saved.layers) == 5
    calls.clear()

    def record(stage: str, done: int, total: int) -> None:
        calls.append((stage, done, total))

    done = run(record)
    assert calls[0] == ("probing", 5, 14)  # layers: continued from layer 5, not from 0
    assert done.complete
    assert [la.alpha for la in done.layers] == [la.alpha for la in noise_profile.layers]
    # the weights were restored after every perturbation
    ref, _ = load_float_model(ckpt)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_profile_cache_is_reused_and_keyed(ckpt: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cfg = ProfileConfig(context=16, windows=1, levels=(0.01,))
    first = get_profile(ckpt, cfg, cache_dir=cache, out=tmp_path / "out.json")
    assert (tmp_path / "out.json").is_file() and len(list(cache.glob("profile-*.json"))) == 1
    calls: list[object] = []
    again = get_profile(ckpt, cfg, cache_dir=cache, progress=lambda *a: calls.append(a))
    assert calls == [] and again.to_dict() == first.to_dict()
    # another metric / token budget / calibration text is another key
    with pytest.raises(ProfileNotFoundError):
        get_profile(
            ckpt,
            ProfileConfig(context=16, windows=2, levels=(0.01,)),
            cache_dir=cache,
            compute=False,
        )
    with pytest.raises(ProfileNotFoundError):
        get_profile(ckpt, cfg, text=TINY_TEXT * 4, cache_dir=cache, compute=False)


def test_ppl_metric_on_text(ckpt: Path) -> None:
    cfg = ProfileConfig(metric="ppl", context=32, windows=2, levels=(0.01, 0.02))
    prof = get_profile(ckpt, cfg, text=TINY_TEXT * 12)
    assert prof.calibration.startswith("text:") and prof.base["ppl"] > 1
    assert all(math.isfinite(la.alpha) for la in prof.layers)
    with pytest.raises(InvalidConfigError, match="windows"):
        get_profile(ckpt, ProfileConfig(context=32, windows=500), text=TINY_TEXT)


def test_fisher_profile_agrees_with_noise_injection(ckpt: Path, noise_profile: Profile) -> None:
    fast = get_profile(
        ckpt, ProfileConfig(method="fisher", context=32, windows=2, fisher_samples=8)
    )
    assert fast.cost["backward_passes"] == 16 and fast.cost["forward_passes"] == 2
    a = [la.alpha for la in noise_profile.layers]
    b = [la.alpha for la in fast.layers]
    assert spearman(a, b) > 0.8
    # same scale, not just the same order: the derivation predicts the KL itself
    ratios = sorted(y / x for x, y in zip(a, b, strict=True))
    assert 0.5 < ratios[len(ratios) // 2] < 2.0


def test_bad_profile_configs_name_the_value() -> None:
    with pytest.raises(InvalidConfigError, match="metric='bits'"):
        ProfileConfig(metric="bits")
    with pytest.raises(InvalidConfigError, match=r"\[1.5\]"):
        ProfileConfig(levels=(0.01, 1.5))
    with pytest.raises(InvalidConfigError, match="windows=0"):
        ProfileConfig(windows=0)


def test_profile_of_a_missing_layer_is_an_error(ckpt: Path) -> None:
    model, _ = load_float_model(ckpt)
    windows = calibration_windows(model, None, None, CFG)
    request = ProfileRequest("x", None, "random:0", CFG, ("model.nope",))
    with pytest.raises(InvalidConfigError, match=r"model\.nope"):
        compute_profile(model, ProfileRun(request), windows)


def test_self_generated_profile_is_cached_with_its_text(ckpt: Path, tmp_path: Path) -> None:
    cfg = ProfileConfig(method="fisher", context=16, windows=2, fisher_samples=1)
    assert cfg.data_free == "self"  # the data-free default
    prof = get_profile(ckpt, cfg, cache_dir=tmp_path)
    assert prof.calibration == "self:t1:p0.95:0"
    gen = list(tmp_path.glob("selfgen-*.safetensors"))
    assert len(gen) == 1 and len(list(tmp_path.glob("profile-*.json"))) == 1
    # random tokens are another calibration, with another key
    rnd = ProfileConfig(
        method="fisher", context=16, windows=2, fisher_samples=1, data_free="random"
    )
    assert get_profile(ckpt, rnd, cache_dir=tmp_path).calibration == "random:0"
    assert len(list(tmp_path.glob("profile-*.json"))) == 2
    # second call: served from the cache, nothing measured
    again = get_profile(ckpt, cfg, cache_dir=tmp_path, compute=False)
    assert [la.alpha for la in again.layers] == [la.alpha for la in prof.layers]
    # the windows are the generated tokens
    from safetensors.torch import load_file

    from higgs_engine.dynamic import calibration_windows

    model, tok = load_float_model(ckpt)
    wins = calibration_windows(model, tok, None, cfg, revision="r", cache_dir=tmp_path / "x")
    assert wins.shape == (2, 16)
    assert torch.equal(wins, load_file(str(next((tmp_path / "x").glob("selfgen-*"))))["tokens"])


def test_old_profile_config_without_data_free_reads_as_random() -> None:
    d = ProfileConfig().to_dict()
    del d["data_free"]
    assert ProfileConfig.from_dict(d).data_free == "random"
    with pytest.raises(InvalidConfigError, match="data_free='web'"):
        ProfileConfig(data_free="web")


def test_data_free_progress_generates_tokens_then_profiles_windows(
    ckpt: Path, tmp_path: Path
) -> None:
    """Generating the text is its own stage counted in tokens; the Fisher passes are
    "profiling" counted in windows (each: one forward and fisher_samples backward passes)."""
    cfg = ProfileConfig(method="fisher", context=16, windows=3, fisher_samples=2)
    calls: list[tuple[str, int, int]] = []

    def progress(stage: str, done: int, total: int) -> bool:
        calls.append((stage, done, total))
        return True

    get_profile(ckpt, cfg, cache_dir=tmp_path, progress=progress)
    stages = [c[0] for c in calls]
    first_profiling = stages.index("profiling")
    assert set(stages[:first_profiling]) == {"generating"}
    assert set(stages[first_profiling:]) == {"profiling"}
    gen = calls[:first_profiling]
    assert gen[0] == ("generating", 0, 3 * 16) and gen[-1] == ("generating", 3 * 16, 3 * 16)
    assert [c[1:] for c in calls[first_profiling:]] == [(i, 3) for i in range(4)]
