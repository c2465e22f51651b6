"""A compressed-tensors job, the `compressed-tensors` kind of the one JobPlan (higgs_engine.job).

    plan    each linear layer's scheme, as data: `bits` 4 (int4 symmetric W4A16, group 128
            where the width allows it, else 64, else 32) or 8 (int8 per channel) for every
            layer; or a target (avg_bits / max_ppl_increase) allocated over vLLM's menu
            (higgs_engine.ct.plan) from the model's profile (stages "profiling", "measuring",
            "allocating"). A layer no kernel takes stays 16-bit, with the reason.
    write   the checkpoint into <out>/compressed-tensors (stage "quantizing"), and the Report:
            every layer's scheme, bits (every scale counted) and t^2, the kept layers and why.
            A calibrated job first runs GPTQ in each block layer's scheme over the calibration
            text (higgs_engine.ct.calibrated, stage "calibrating").

The plan's entry (JobPlan.ct) is plain JSON, checked by `check_ct_plan` when a JobPlan is
built: a service stores it and the worker writes exactly what it says.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.ct.schemes import CtScheme, ct_scheme
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.ct_targets import CT_BITS, CT_DTYPES, CT_FORMAT
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.report import LayerReport, Report

if TYPE_CHECKING:
    from higgs_engine.calibration import Calibration
    from higgs_engine.dynamic import ProfileSource
    from higgs_engine.planning.plans import Target
    from higgs_engine.planning.profile import Profile
    from higgs_engine.sources import ResolvedModel

__all__ = [
    "CT_PLAN_KEYS",
    "check_ct_plan",
    "plan_ct",
    "write_ct",
]

CT_PLAN_KEYS = frozenset({"bits", "dtype", "target", "schemes", "reasons", "allocation"})


def check_ct_plan(d: Mapping[str, Any]) -> None:
    """A plan's compressed-tensors entry, checked (InvalidConfigError naming the field): its
    keys, `bits` 4 / 8 or a target, a 16-bit dtype, a known scheme per layer, a reason per
    kept layer."""
    if not isinstance(d, Mapping) or set(d) != CT_PLAN_KEYS:
        got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
        raise InvalidConfigError(f"ct: {got} are not the keys {sorted(CT_PLAN_KEYS)}", field="ct")
    if (d["bits"] is None) == (d["target"] is None):
        raise InvalidConfigError("ct: give exactly one of bits and target", field="bits")
    if d["bits"] is not None and d["bits"] not in CT_BITS:
        raise InvalidConfigError(
            f"bits={d['bits']!r}: compressed-tensors takes 4 (int4 W4A16) or 8 (int8 per "
            "channel); give avg_bits for a mix",
            field="bits",
        )
    if d["dtype"] not in CT_DTYPES:
        raise InvalidConfigError(
            f"dtype={d['dtype']!r} must be one of {list(CT_DTYPES)}", field="dtype"
        )
    schemes, reasons = d["schemes"], d["reasons"]
    if not isinstance(schemes, Mapping) or not isinstance(reasons, Mapping):
        raise InvalidConfigError("ct: schemes and reasons map layer names", field="ct")
    for name, scheme in schemes.items():
        if not isinstance(name, str) or not isinstance(scheme, str):
            raise InvalidConfigError(f"ct: schemes[{name!r}]={scheme!r} is not a name", field="ct")
        ct_scheme(scheme)  # raises naming an unknown scheme
    for name, why in reasons.items():
        if not isinstance(why, str) or not why:
            raise InvalidConfigError(f"ct: reasons[{name!r}] must be a sentence", field="ct")
        if schemes.get(name, "keep") != "keep":
            raise InvalidConfigError(
                f"ct: layer {name!r} has a reason to stay 16-bit but scheme {schemes[name]!r}",
                field="ct",
            )


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def plan_ct(
    model: ResolvedModel,
    bits: int | None,
    target: Target | None,
    how: ProfileSource,
    dtype: str = "float16",
    progress: ProgressCallback | None = None,
    device: str | None = None,
) -> tuple[dict[str, Any], Profile | None]:
    """The plan's compressed-tensors entry for `model` (one scheme per linear layer) and the
    profile it was allocated with (None for uniform bits); the JobPlan made from it checks the
    schemes."""
    entry: dict[str, Any] = {
        "bits": bits,
        "dtype": dtype,
        "target": None if target is None else target.to_dict(),
        "allocation": None,
    }
    check_ct_plan({**entry, "schemes": {}, "reasons": {}})  # bits or target, dtype: before work
    if bits is not None:
        from higgs_engine.ct.writer import uniform_assignment

        assignment = uniform_assignment(model.path, bits)
        profile = None
    else:
        assert target is not None
        assignment, profile, allocation = _allocate(model, target, how, dtype, progress, device)
        entry["allocation"] = allocation
    entry["schemes"] = {n: s.name for n, s in sorted(assignment.schemes.items())}
    entry["reasons"] = dict(sorted(assignment.reasons.items()))
    for name in entry["reasons"]:
        entry["schemes"].setdefault(name, "keep")
    plain: dict[str, Any] = json.loads(json.dumps(entry))
    return plain, profile


def _allocate(
    model: ResolvedModel,
    target: Target,
    how: ProfileSource,
    dtype: str,
    progress: ProgressCallback | None,
    device: str | None,
) -> tuple[Any, Profile, dict[str, Any]]:
    """The allocator's schemes for `target` over vLLM's menu, from the model's profile."""
    from higgs_engine.ct.plan import allocate_schemes, measure_options
    from higgs_engine.dynamic import obtain_profile
    from higgs_engine.planning.plans import metric_bound_for_ppl, ppl_increase_from

    t0 = time.perf_counter()
    found = obtain_profile(model, how, model.layer_names(), progress, device)
    profile = found.profile
    t1 = time.perf_counter()
    measured = measure_options(model.path, dtype=dtype, progress=progress)
    t2 = time.perf_counter()
    report(progress, "allocating", 0, 1)
    if target.avg_bits is not None:
        alloc = allocate_schemes(measured, profile, avg_bits=target.avg_bits)
    else:
        assert target.max_ppl_increase is not None
        bound = metric_bound_for_ppl(profile.metric, target.max_ppl_increase)
        alloc = allocate_schemes(measured, profile, max_predicted=bound)
    report(progress, "allocating", 1, 1)
    histogram: dict[str, int] = {}
    for s in alloc.assignment.schemes.values():
        histogram[s.name] = histogram.get(s.name, 0) + 1
    allocation = {
        "avg_bits": alloc.avg_bits,
        f"predicted_{profile.metric}": alloc.predicted,
        "predicted_ppl_increase": ppl_increase_from(profile.metric, alloc.predicted),
        "histogram": dict(sorted(histogram.items())),
        "profile_reused": found.reused,
        "profiling_s": found.seconds,
        "measuring_s": t2 - t1,
        "allocating_s": time.perf_counter() - t2,
        "planning_s": time.perf_counter() - t0,
    }
    return alloc.assignment, profile, allocation


# ---------------------------------------------------------------------------------------------
# write
# ---------------------------------------------------------------------------------------------


def write_ct(
    entry: Mapping[str, Any],
    model: ResolvedModel,
    tmp: Path,
    progress: ProgressCallback | None,
    timings: dict[str, float],
    calibration: Calibration | None = None,
) -> Report:
    """The plan's checkpoint written into `tmp`/compressed-tensors (`tmp` created here; the
    artifact's directory is named after its format, as the others are), loaded by
    transformers through compressed-tensors (a failure raises CorruptCheckpointError), and its
    Report (report.json is the caller's to write, once, after its annotations). With
    `calibration`, the layers inside the transformer blocks are quantized by GPTQ in their
    schemes first (higgs_engine.ct.calibrated, stage "calibrating"); the rest data-free."""
    from higgs_engine.artifact_check import verify_compressed_tensors
    from higgs_engine.ct.writer import CtAssignment, write_compressed_tensors

    check_ct_plan(entry)
    schemes: dict[str, CtScheme] = {n: ct_scheme(s) for n, s in entry["schemes"].items()}
    assignment = CtAssignment(schemes, dict(entry["reasons"]))
    dtype = str(entry["dtype"])
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    layers = None
    if calibration is not None:
        from higgs_engine.ct.calibrated import calibrated_layers

        layers, calibrated = calibrated_layers(model, assignment, calibration, dtype, progress)
        timings["calibrating"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    summary = write_compressed_tensors(
        model.path, assignment, tmp / CT_FORMAT, dtype=dtype, progress=progress, layers=layers
    )
    if layers is not None:
        summary["calibration"] = calibrated
    timings["quantizing"] = time.perf_counter() - t1
    # checked before success by the loader its users run (higgs_engine.artifact_check)
    t1 = time.perf_counter()
    report(progress, "packaging", 0, 1)
    summary["load_check"] = verify_compressed_tensors(tmp / CT_FORMAT)
    timings["packaging"] = time.perf_counter() - t1
    report(progress, "packaging", 1, 1)
    return _report(entry, model, tmp / CT_FORMAT, summary, timings)


def _report(
    entry: Mapping[str, Any],
    model: ResolvedModel,
    out: Path,
    summary: dict[str, Any],
    timings: dict[str, float],
) -> Report:
    import compressed_tensors

    from higgs_engine.run_core import versions
    from higgs_engine.safetensors_stream import CheckpointReader

    layers = [
        LayerReport(
            name=str(e["name"]),
            shape=[int(x) for x in e["shape"]],
            p=0,
            n=0,
            bits=float(e["bits_per_weight"]),
            rel_error=float(e["t2"]),
            bytes=math.ceil(int(e["bits"]) / 8),
            type=str(e["scheme"]),
        )
        for e in summary["layers"]
    ]
    with CheckpointReader(model.path) as reader:
        params_total = sum(reader.numel(k) for k in reader)
        bytes_before = reader.total_bytes
    bytes_after = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    metrics = {k: v for k, v in summary.items() if k != "layers"}
    metrics["file_bytes"] = bytes_after
    timings = dict(timings)
    alloc = entry["allocation"]
    if alloc is not None:
        metrics["allocation"] = dict(alloc)
        if alloc["profile_reused"] is None:  # measured in this run
            timings["profiling"] = float(alloc["profiling_s"])
        timings["measuring"] = float(alloc["measuring_s"])
        timings["allocating"] = float(alloc["allocating_s"])
    config: dict[str, Any] = {
        "format": CT_FORMAT,
        "bits": entry["bits"],
        "dtype": entry["dtype"],
        "target": entry["target"],
    }
    return Report(
        bits_per_weight=float(summary["bits_per_weight"]),
        bits_per_param_total=8.0 * int(summary["weights_bytes"]) / max(params_total, 1),
        bytes_before=bytes_before,
        bytes_after=bytes_after,
        params_total=params_total,
        params_quantized=sum(
            e["shape"][0] * e["shape"][1] for e in summary["layers"] if e["scheme"] != "keep"
        ),
        layers=layers,
        timings=timings,
        config=config,
        source={
            "id": model.id,
            "revision": model.revision,
            "kind": model.kind,
            "architecture": (model.config.get("architectures") or [None])[0],
            "model_type": model.config.get("model_type"),
        },
        versions={**versions(), "compressed_tensors": compressed_tensors.__version__},
        seed=0,
        formats=[CT_FORMAT],
        metrics=json.loads(json.dumps(metrics)),
    )
