"""higgs_engine.job: one QuantizeJob, one plan, one run(). Uniform, dynamic and given-profile
jobs; the caller's annotate runs on the staged output before the one write of report.json,
which is what run() returns; the model is resolved once per run; a JobPlan is data that
round-trips and runs part by part to run()'s artifacts; the CLI and the worker reach the
orchestration only through job.py (the forbidden names generated from the engine)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from devtools.import_graph import names_taken, public_functions, sources
from higgs_engine.errors import InvalidConfigError
from higgs_engine.job import (
    CalibrationRequest,
    JobPlan,
    ProfileSource,
    QuantizeJob,
    RunInputs,
    assemble,
    plan,
    run,
    run_part,
)
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.options import option_menu
from higgs_engine.planning.plans import Target
from higgs_engine.planning.profile import Profile
from higgs_engine.report import Report
from higgs_engine.sources import resolve_model
from tests.fixtures import build_tiny_checkpoint, count_resolutions, measure_tiny_profile
from tests.test_import_graph import ENGINE_LAYERS

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
    assert len(plans) == 1 and plans[0].kind == "dynamic"
    assert plans[0].dynamic.reused == "given"
    assert plans[0].dynamic.allocation == rep.metrics["allocation"]
    assert plans[0].config.overrides  # the allocation's grids, one per layer
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


# ---------------------------------------------------------------------------------------------
# The model resolved once; the plan as data
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    return count_resolutions(monkeypatch)


def test_a_uniform_run_of_a_sharded_source_resolves_once(
    sharded: Path, tmp_path: Path, resolutions: dict[str, list[int]]
) -> None:
    """Planned, quantized part by part and assembled: one resolution for all of it."""
    rep = run(QuantizeJob(sharded, CFG), tmp_path / "out")
    assert len(rep.metrics["parts"]) >= 3
    assert {k: v[0] for k, v in resolutions.items()} == dict.fromkeys(resolutions, 1)


def test_a_dynamic_run_measuring_its_profile_resolves_once(
    ckpt: Path, tmp_path: Path, resolutions: dict[str, list[int]]
) -> None:
    """Profile measured (the model loaded in float), allocated, quantized: one resolution."""
    from higgs_engine.planning.profile import ProfileConfig, ProfileDirectory

    how = ProfileSource(
        config=ProfileConfig(method="fisher", windows=1, context=16, data_free="random"),
        stores=(ProfileDirectory(tmp_path / "profiles"),),
        menu=tuple(option_menu(max_code_bits=3.0)),
    )
    rep = run(QuantizeJob(ckpt, target=Target(avg_bits=2.5), profile=how), tmp_path / "out")
    assert rep.metrics["allocation"] and rep.timings["profiling"] > 0
    assert {k: v[0] for k, v in resolutions.items()} == dict.fromkeys(resolutions, 1)


def test_a_resolved_model_is_not_resolved_again(
    ckpt: Path, tmp_path: Path, resolutions: dict[str, list[int]]
) -> None:
    model = resolve_model(ckpt)
    rep = run(QuantizeJob(model, CFG), tmp_path / "out")
    assert {k: v[0] for k, v in resolutions.items()} == dict.fromkeys(resolutions, 1)
    assert rep.source["id"] == str(ckpt) and rep.source["kind"] == "local"


def test_the_report_names_the_source_as_the_caller_named_it(ckpt: Path, tmp_path: Path) -> None:
    """A caller's identity for the model (a service's model id and pinned revision) is what
    the report says, with nothing patched after the run."""
    model = resolve_model(ckpt).named("org/tiny", "a" * 40, "hub")
    rep = run(QuantizeJob(model, CFG), tmp_path / "out")
    assert (rep.source["id"], rep.source["revision"], rep.source["kind"]) == (
        "org/tiny",
        "a" * 40,
        "hub",
    )
    assert rep.source["architecture"] == "LlamaForCausalLM"


def test_a_plan_round_trips_and_runs_to_the_same_artifacts(
    sharded: Path, profile: Profile, tmp_path: Path
) -> None:
    """plan -> to_dict -> JSON -> from_dict is the same plan; its parts run and assembled
    from the stored plan (as a service's workers do) give run()'s artifacts byte for byte."""
    from higgs_engine.parts import read_part

    job = QuantizeJob(
        sharded,
        target=Target(avg_bits=2.5),
        profile=ProfileSource(profile=profile, menu=tuple(option_menu(max_code_bits=3.0))),
    )
    planned = plan(job)
    assert planned.kind == "dynamic" and planned.sharded and sum(planned.totals) == 14
    stored = json.loads(json.dumps(planned.to_dict()))
    again = JobPlan.from_dict(stored)
    assert again == planned
    model = resolve_model(sharded)
    dirs = []
    for part in again.parts:
        d = tmp_path / "parts" / str(part.index)
        run_part(again, part.index, d, RunInputs(model))
        dirs.append(d)
    rep = assemble(again, [read_part(d) for d in dirs], tmp_path / "a", RunInputs(model))
    for d in dirs:  # the metadata-only assembly: the shards go beside its small files
        for rel in read_part(d)["files"]:
            (tmp_path / "a" / rel).write_bytes((d / rel).read_bytes())
    whole = run(job, tmp_path / "w")

    def digests(root: Path) -> dict[str, str]:
        return {
            p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "report.json"
        }

    assert digests(tmp_path / "a") == digests(tmp_path / "w")
    assert rep.metrics["allocation"] == whole.metrics["allocation"]
    assert [r.alpha for r in rep.layers] == [r.alpha for r in whole.layers]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"version": 9}, "version"),
        ({"kind": "sideways"}, "kind"),
        ({"threads": 0}, "threads"),
        ({"totals": []}, "totals"),
        ({"dynamic": None}, "dynamic"),
        ({"source": {"id": "x"}}, "source"),
    ],
)
def test_a_plan_that_cannot_be_run_fails_naming_the_field(
    ckpt: Path, profile: Profile, change: dict[str, Any], field: str
) -> None:
    job = QuantizeJob(
        ckpt,
        target=Target(avg_bits=2.5),
        profile=ProfileSource(profile=profile, menu=tuple(option_menu(max_code_bits=3.0))),
    )
    good = plan(job).to_dict()
    if field == "totals":
        good["parts"] = [{"index": 0, "shards": ["model.safetensors"]}]
    with pytest.raises(InvalidConfigError, match=field):
        JobPlan.from_dict({**good, **change})


def test_a_job_that_cannot_be_planned_fails_at_construction() -> None:
    from higgs_engine.job import GgufOptions

    with pytest.raises(InvalidConfigError, match=r"^threads"):
        QuantizeJob("m", threads=0)
    with pytest.raises(InvalidConfigError, match=r"^config"):
        QuantizeJob("m", HiggsConfig(p=1, n=4), gguf=GgufOptions(bits=4))
    with pytest.raises(InvalidConfigError, match=r"^calibration"):
        QuantizeJob("m", calibration=CalibrationRequest(None), gguf=GgufOptions(bits=4))


def test_threads_reach_the_run(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    seen: list[int] = []
    before = torch.get_num_threads()

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "quantizing":
            seen.append(torch.get_num_threads())

    run(QuantizeJob(ckpt, CFG, threads=3), tmp_path / "out", progress)
    assert seen and set(seen) == {3}
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------------------------------------
# The worker and the CLI reach the orchestration only through job.py
# ---------------------------------------------------------------------------------------------

# Layers of devtools' engine layer table whose modules are the orchestration; `job` (the
# entry point above them) is how the worker and the CLI reach it.
ORCHESTRATION_LAYERS = ("run core", "orchestrators")
# Public functions of those modules that orchestrate nothing (they read or evaluate files);
# each must still exist (a name that no longer does fails the test).
TOOLS = {
    ("higgs_engine.calibration", "read_calibration_file"),
    ("higgs_engine.gguf.convert", "convert_checkpoint"),
    ("higgs_engine.gguf.evaluate", "evaluate_gguf"),
    ("higgs_engine.gguf.plan", "read_gguf"),
}


def orchestration_functions(root: Path) -> set[tuple[str, str]]:
    """(module, public function) of every module in the orchestration layers, generated from
    the engine's layer table and the modules' source."""
    names = {n for layer, mods in ENGINE_LAYERS if layer in ORCHESTRATION_LAYERS for n in mods}
    out: set[tuple[str, str]] = set()
    for module, path in sources(root, ("higgs_engine",)).items():
        rel = module.removeprefix("higgs_engine.")
        if any(rel == n or rel.startswith(n + ".") for n in names):
            out |= {(module, f) for f in public_functions(path)}
    return out


def reaches_past_job(root: Path, package: str) -> dict[str, list[str]]:
    """{file: ["module.function", ...]} of the orchestration functions `package` takes from
    anywhere but higgs_engine.job."""
    import higgs_engine.job

    forbidden = {
        (m, f)
        for m, f in orchestration_functions(root) - TOOLS
        if f not in higgs_engine.job.__all__
    }
    found: dict[str, list[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        hits = sorted(f"{m}.{f}" for m, f in names_taken(root, path) & forbidden)
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


def test_the_forbidden_list_is_the_engines_orchestration() -> None:
    made = orchestration_functions(ROOT)
    names = {f for _, f in made}
    # what the hand-written list named, the part-by-part stages and the dynamic plan
    assert {"quantize_checkpoint", "quantize_part", "assemble_metadata", "assemble_parts"} <= names
    assert {
        "plan_dynamic",
        "obtain_profile",
        "run_gguf_plan",
        "plan_gguf",
        "stream_tensors",
    } <= names
    assert made >= TOOLS, "a tool named in TOOLS is gone: remove it from the list"


@pytest.mark.parametrize("package", ["higgs_cli", "worker"])
def test_cli_and_worker_reach_the_orchestration_only_through_job(package: str) -> None:
    assert reaches_past_job(ROOT, package) == {}


def test_the_scanner_sees_every_way_in(tmp_path: Path) -> None:
    (tmp_path / "higgs_engine").mkdir()
    for name in ("__init__", "parts", "pipeline", "job"):
        (tmp_path / "higgs_engine" / f"{name}.py").write_text(
            "def quantize_part():\n    pass\ndef run():\n    pass\n"
            if name == "parts"
            else "def quantize_checkpoint():\n    pass\n"
        )
    pkg = tmp_path / "worker"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "def f():\n    from higgs_engine import pipeline\n    pipeline.quantize_checkpoint(1)\n"
    )
    (pkg / "b.py").write_text("from higgs_engine.parts import quantize_part as q\n")
    (pkg / "c.py").write_text("import higgs_engine.parts\nhiggs_engine.parts.quantize_part()\n")
    (pkg / "d.py").write_text("from higgs_engine.parts import run\n")  # job's own name
    assert reaches_past_job(tmp_path, "worker") == {
        "worker/a.py": ["higgs_engine.pipeline.quantize_checkpoint"],
        "worker/b.py": ["higgs_engine.parts.quantize_part"],
        "worker/c.py": ["higgs_engine.parts.quantize_part"],
    }
