"""higgs_engine.job: one QuantizeJob, one run(). Uniform, dynamic and given-profile jobs; the
caller's annotate runs on the staged output before the one write of report.json, which is
what run() returns; the CLI and the worker quantize only through run()."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devtools.import_graph import names_used
from higgs_engine.job import ProfileSource, QuantizeJob, run
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.options import option_menu
from higgs_engine.planning.plans import Target
from higgs_engine.planning.profile import Profile
from higgs_engine.report import Report
from tests.fixtures import build_tiny_checkpoint, measure_tiny_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CFG = HiggsConfig(p=1, n=4)  # a small grid: fast tables


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("job") / "llama")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("job") / "sharded"
    return build_tiny_checkpoint("llama", dest, max_shard_size="60KB")


@pytest.fixture(scope="module")
def profile(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Profile:
    return Profile.load(measure_tiny_profile(ckpt, tmp_path_factory.mktemp("p") / "p.json"))


@pytest.fixture
def saves(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path a Report is saved to during the test."""
    seen: list[Path] = []
    original = Report.save

    def save(self: Report, path: Path) -> None:
        seen.append(Path(path))
        original(self, path)

    monkeypatch.setattr(Report, "save", save)
    return seen


class Recorder:
    """A job's annotate: checks the staged directory and what the report holds by then."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.calls: list[dict[str, Any]] = []

    def __call__(self, rep: Report, staged: Path) -> None:
        self.calls.append(
            {
                "staged": staged,
                "out_exists": self.out.exists(),
                "report_json": (staged / "report.json").exists(),
                "native": sorted(p.name for p in (staged / "native").iterdir()),
                "metrics": set(rep.metrics),
            }
        )
        rep.metrics["caller"] = {"said": "hello"}


def _check_single_write(rep: Report, out: Path, rec: Recorder, saves: list[Path]) -> None:
    assert len(rec.calls) == 1
    call = rec.calls[0]
    # annotate ran on the complete staged artifacts, before report.json and the rename
    assert call["staged"] != out and call["staged"].parent == out.parent
    assert not call["out_exists"] and not call["report_json"]
    assert "config.json" in call["native"]
    assert [p.name for p in saves] == ["report.json"]  # written once...
    assert saves[0].parent == call["staged"]  # ...into the staged directory
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(rep.to_dict()))  # what run() returned
    assert on_disk["metrics"]["caller"] == {"said": "hello"}
    assert not list(out.parent.glob(f".{out.name}.*"))  # nothing staged is left


def test_uniform_job(ckpt: Path, tmp_path: Path, saves: list[Path]) -> None:
    out = tmp_path / "out"
    rec = Recorder(out)
    rep = run(QuantizeJob(ckpt, CFG, annotate=rec), out)
    _check_single_write(rep, out, rec, saves)
    assert {(r.p, r.n) for r in rep.layers if r.p} == {(1, 4)}
    assert all(r.alpha is None for r in rep.layers)
    assert "allocation" not in rep.metrics


def test_given_profile_with_a_uniform_target(
    ckpt: Path, profile: Profile, tmp_path: Path, saves: list[Path]
) -> None:
    """What `higgs quantize --profile` asks: uniform grids, each layer's alpha and the
    predicted change in the report, already there when the caller's annotate runs."""
    out = tmp_path / "out"
    rec = Recorder(out)
    rep = run(QuantizeJob(ckpt, CFG, profile=ProfileSource(profile=profile), annotate=rec), out)
    _check_single_write(rep, out, rec, saves)
    assert "predicted_kl" in rec.calls[0]["metrics"]
    alphas = profile.alphas()
    assert all(r.alpha == alphas[r.name] for r in rep.layers if r.p)
    assert {(r.p, r.n) for r in rep.layers if r.p} == {(1, 4)}


def test_dynamic_job(ckpt: Path, profile: Profile, tmp_path: Path, saves: list[Path]) -> None:
    out = tmp_path / "out"
    rec = Recorder(out)
    plans: list[Any] = []
    stages: list[str] = []
    job = QuantizeJob(
        ckpt,
        target=Target(avg_bits=2.5),
        profile=ProfileSource(profile=profile, menu=tuple(option_menu(max_code_bits=3.0))),
        annotate=rec,
        on_plan=plans.append,
    )
    rep = run(job, out, lambda s, d, t: stages.append(s))
    _check_single_write(rep, out, rec, saves)
    assert stages.index("allocating") < stages.index("quantizing")
    # the dynamic annotations are in before the caller's
    assert {"allocation", "target", "predicted_kl"} <= rec.calls[0]["metrics"]
    assert rep.metrics["target"] == {"avg_bits": 2.5}
    assert len(plans) == 1 and plans[0].profile.reused == "given"
    assert plans[0].plan.allocation.avg_bits == rep.metrics["allocation"]["avg_bits"]
    assert len({(r.p, r.n) for r in rep.layers}) > 1
    assert rep.bits_per_weight <= 2.5 + 1e-9


def test_sharded_source_annotates_before_the_one_write(
    sharded: Path, tmp_path: Path, saves: list[Path]
) -> None:
    """Part by part: the parts' shards are in the staged directory when annotate runs, and
    report.json is written once, after it."""
    out = tmp_path / "out"
    rec = Recorder(out)
    rep = run(QuantizeJob(sharded, CFG, annotate=rec), out)
    _check_single_write(rep, out, rec, saves)
    assert rep.metrics["parts"]
    index = json.loads((out / "native" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) <= set(rec.calls[0]["native"])


def test_a_failing_annotate_leaves_nothing(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"

    def fail(rep: Report, staged: Path) -> None:
        raise RuntimeError("the caller's annotation failed")

    with pytest.raises(RuntimeError, match="caller's annotation"):
        run(QuantizeJob(ckpt, CFG, annotate=fail), out)
    assert not out.exists()
    assert not list(tmp_path.iterdir())


# The stages the CLI and the worker must not call themselves: they build a QuantizeJob and
# call higgs_engine.job.run.
FORBIDDEN = {"quantize_checkpoint", "run_dynamic", "run_gguf_plan", "plan_gguf", "assemble_parts"}


@pytest.mark.parametrize("package", ["higgs_cli", "worker"])
def test_cli_and_worker_quantize_only_through_run(package: str) -> None:
    found = {
        str(path.relative_to(ROOT)): sorted(names_used(path) & FORBIDDEN)
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_the_scanner_sees_a_call(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text(
        "def f():\n    from higgs_engine import pipeline\n    pipeline.quantize_checkpoint(1)\n"
    )
    assert "quantize_checkpoint" in names_used(mod)
