"""Sensitivity profiles of encoders (no causal LM head): the "cos" metric, its Gauss-Newton
fast estimate against noise injection, framed data-free windows, and how a checkpoint's kind
picks the metric."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from devtools.profiles import get_profile
from higgs_engine.dynamic import (
    calibration_windows,
    encoder_windows,
    profile_config_for,
)
from higgs_engine.errors import InvalidConfigError
from higgs_engine.model_loading import load_float_model
from higgs_engine.model_structure import load_config, model_kind
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.plans import Target, plan_allocation, ppl_increase_from
from higgs_engine.planning.profile import (
    Profile,
    ProfileConfig,
    ProfileRequest,
    resolve_profile_config,
)
from higgs_engine.profile import BlockReplay
from higgs_engine.sources import resolve_model
from tests.engine.test_profile import spearman
from tests.fixtures import TINY_TEXT, build_tiny_checkpoint, build_tiny_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = ProfileConfig(context=32, windows=4, data_free="random")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("enc") / "bert")


@pytest.fixture(scope="module")
def noise_profile(bert: Path) -> Profile:
    return get_profile(bert, ProfileConfig(context=32, windows=8, data_free="random"))


def test_resolution_picks_the_metric_from_the_model_kind() -> None:
    auto = ProfileConfig()
    assert auto.metric == "auto"
    assert resolve_profile_config(auto, "causal").metric == "kl"
    assert resolve_profile_config(auto, "causal").data_free == "self"
    enc = resolve_profile_config(auto, "encoder", max_positions=512)
    # sentence-length windows, the same token budget
    assert (enc.metric, enc.data_free, enc.context, enc.windows) == ("cos", "random", 128, 16)
    # resolving twice changes nothing; explicit choices that fit the kind are kept
    assert resolve_profile_config(enc, "encoder", 512) == enc
    short = ProfileConfig(context=32, windows=3)
    assert resolve_profile_config(short, "encoder", 512).context == 32
    assert resolve_profile_config(ProfileConfig(metric="ppl"), "causal").metric == "ppl"


def test_resolution_keeps_the_token_budget_under_an_encoders_position_limit() -> None:
    enc = resolve_profile_config(ProfileConfig(context=100, windows=4), "encoder", 64)
    assert (enc.context, enc.windows, enc.tokens) == (64, 6, 384)


def test_resolution_rejects_metrics_the_model_cannot_have() -> None:
    with pytest.raises(InvalidConfigError, match="metric='kl' needs a causal LM head"):
        resolve_profile_config(ProfileConfig(metric="kl"), "encoder")
    with pytest.raises(InvalidConfigError, match="metric='ppl'"):
        resolve_profile_config(ProfileConfig(metric="ppl"), "encoder")
    with pytest.raises(InvalidConfigError, match="metric='cos'"):
        resolve_profile_config(ProfileConfig(metric="cos"), "causal")
    with pytest.raises(InvalidConfigError, match="'decoder'"):
        resolve_profile_config(ProfileConfig(), "decoder")


def test_model_kind_from_the_checkpoint(bert: Path, tmp_path: Path) -> None:
    llama = build_tiny_checkpoint("llama", tmp_path / "llama", tokenizer=False)
    assert model_kind(load_config(llama)) == "causal"
    assert model_kind(load_config(bert)) == "encoder"
    assert profile_config_for(resolve_model(bert), ProfileConfig()).metric == "cos"
    assert profile_config_for(resolve_model(llama), ProfileConfig()).metric == "kl"


def test_encoder_windows_are_framed_by_cls_and_sep(bert: Path) -> None:
    model, tok = load_float_model(bert)
    assert type(model).__name__ == "BertModel"
    cfg = resolve_profile_config(CFG, "encoder", 128)
    rnd = calibration_windows(model, tok, None, CFG)
    assert rnd.shape == (4, 32)
    assert bool((rnd[:, 0] == tok.cls_token_id).all()) and bool(
        (rnd[:, -1] == tok.sep_token_id).all()
    )
    assert torch.equal(rnd, calibration_windows(model, tok, None, CFG))  # seeded
    txt = calibration_windows(model, tok, TINY_TEXT * 4, CFG)
    inner = tok(TINY_TEXT * 4, add_special_tokens=False)["input_ids"][:30]
    assert txt[0, 1:-1].tolist() == inner and int(txt[1, 0]) == tok.cls_token_id
    # an encoder cannot generate text: asking for it directly is an error naming why
    with pytest.raises(InvalidConfigError, match="cannot"):
        encoder_windows(model, tok, None, ProfileConfig(metric="cos", data_free="self"))
    with pytest.raises(InvalidConfigError, match=r"only 0 windows|fewer than one window"):
        calibration_windows(model, tok, "short text", cfg)


def test_encoder_replay_matches_the_full_forward(bert: Path) -> None:
    model, tok = load_float_model(bert)
    windows = calibration_windows(model, tok, None, CFG)
    runner = BlockReplay(model, windows, "encoder")
    assert runner.blocks is not None and runner.block_prefix[1] == "encoder.layer.1."
    full = runner.output(2)
    assert full.shape == (64,)
    assert torch.allclose(runner.output(2, "encoder.layer.1.output.dense"), full, atol=1e-5)
    with torch.no_grad():  # a perturbation in block 1 is seen by the replay from block 1
        w = dict(model.named_parameters())["encoder.layer.1.output.dense.weight"]
        orig = w.clone()
        w.mul_(1.5)
        replay = runner.output(2, "encoder.layer.1.output.dense")
        direct = model(input_ids=windows[2:3]).last_hidden_state[0].mean(0)
        w.copy_(orig)
    assert not torch.allclose(replay, full, atol=1e-4)
    assert torch.allclose(replay, direct, atol=1e-4)


def test_noise_profile_of_an_encoder_uses_cos(noise_profile: Profile) -> None:
    p = noise_profile
    assert p.metric == "cos" and p.config["data_free"] == "random" and p.complete
    assert p.calibration == "random:0" and p.base["embedding_norm"] > 0 and "ppl" not in p.base
    names = [la.name for la in p.layers]
    assert names[0] == "encoder.layer.0.attention.self.query" and names[-1] == "pooler.dense"
    for la in p.layers:
        if la.name == "pooler.dense":  # not on the way to the hidden state: rounding only
            assert abs(la.alpha) < 1e-9
            continue
        assert la.alpha > 0, la
        r = (la.points[1][1] / 0.02) / (la.points[0][1] / 0.005)
        assert 0.25 < r < 4.0, (la.name, la.points)


def test_gauss_newton_estimate_agrees_with_noise_injection(
    bert: Path, noise_profile: Profile
) -> None:
    fast = get_profile(
        bert, ProfileConfig(method="fisher", context=32, windows=8, fisher_samples=32)
    )
    assert fast.metric == "cos" and fast.method == "fisher"
    assert fast.cost["forward_passes"] == 1 and fast.cost["backward_passes"] == 32
    a = [la.alpha for la in noise_profile.layers if la.name != "pooler.dense"]
    b = [la.alpha for la in fast.layers if la.name != "pooler.dense"]
    assert fast.alphas()["pooler.dense"] == 0.0
    assert spearman(a, b) > 0.7, (a, b)
    ratios = sorted(y / x for x, y in zip(a, b, strict=True))
    assert 0.5 < ratios[len(ratios) // 2] < 2.0, ratios


def test_cos_and_kl_profiles_never_share_a_cache_entry(noise_profile: Profile) -> None:
    cos_cfg = ProfileConfig.from_dict(noise_profile.config)
    kl_cfg = ProfileConfig(**{**noise_profile.config, "metric": "kl", "levels": (0.005, 0.02)})
    layers = tuple(noise_profile.alphas())
    for cfg, ok in ((cos_cfg, True), (kl_cfg, False)):
        req = ProfileRequest("m", noise_profile.revision, noise_profile.calibration, cfg, layers)
        assert req.accepts(noise_profile) is ok
    same = ProfileRequest("m", noise_profile.revision, noise_profile.calibration, cos_cfg)
    other = ProfileRequest("m", noise_profile.revision, noise_profile.calibration, kl_cfg)
    assert same.key != other.key


def test_a_cos_profile_plans_bits_but_not_perplexity(noise_profile: Profile) -> None:
    plan = plan_allocation(noise_profile, HiggsConfig(), Target(avg_bits=3.5))
    assert plan.allocation.avg_bits <= 3.5 and plan.metric == "cos"
    assert plan.to_dict()["allocation"]["predicted_ppl_increase"] is None
    assert ppl_increase_from("cos", 0.1) is None and math.isclose(
        ppl_increase_from("kl", 0.0) or 0.0, 0.0
    )
    with pytest.raises(InvalidConfigError, match="avg_bits instead"):
        plan_allocation(noise_profile, HiggsConfig(), Target(max_ppl_increase=0.05))


def test_explicit_kl_on_an_encoder_is_an_error(bert: Path) -> None:
    with pytest.raises(InvalidConfigError, match="encoder"):
        get_profile(bert, ProfileConfig(metric="kl", context=32, windows=1, data_free="random"))
