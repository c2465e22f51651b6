"""Dynamic HIGGS verbs: `higgs profile`, `higgs plan`, and the dynamic targets of `higgs quantize`.

`register` adds the `profile` and `plan` verbs; `add_quantize_args(parser)` and
`dynamic_job(args, config)` (the engine job for --avg-bits / --max-ppl-increase / --profile)
are the hooks `higgs quantize` calls. Heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from higgs_cli.common import (
    CliError,
    StageBars,
    default_profile_cache,
    dynamic_target,
    load_profile,
    profile_config,
    profile_source,
    quiet_libraries,
    read_text_option,
)
from higgs_engine.planning.profile import DEFAULT_PROFILE


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return x


def _levels(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--levels {text!r} must be comma-separated numbers like 0.005,0.02"
        ) from None
    if not vals or any(not (math.isfinite(v) and 0 < v < 1) for v in vals):
        raise argparse.ArgumentTypeError(
            f"--levels {text!r}: every level must be a relative MSE t^2 in (0, 1)"
        )
    return vals


def _add_profile_options(p: Any, prefix: str = "") -> None:
    """Options that decide how a profile is measured (prefixed with --profile- under quantize)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        f"--{prefix}text", default=None, metavar="FILE", help="calibration text (UTF-8)"
    )
    src.add_argument(
        f"--{prefix}random-tokens",
        action="store_true",
        help="calibrate on seeded random tokens instead of text the model generates itself "
        "(the data-free default without a text, cached per model revision)",
    )
    p.add_argument(
        f"--{prefix}metric",
        choices=["auto", "kl", "ppl", "cos"],
        default="auto",
        help="auto (default): KL from the base model for a causal LM (works on random tokens), "
        "1 - cos of the mean-pooled final hidden state for an encoder (e.g. BERT); or kl, "
        "ppl (perplexity, needs a text) or cos explicitly",
    )
    method = p.add_mutually_exclusive_group()
    method.add_argument(
        f"--{prefix}fast",
        action="store_true",
        help="estimate alphas from Fisher statistics, a few backward passes (the default)",
    )
    method.add_argument(
        f"--{prefix}noise",
        action="store_true",
        help="measure alphas by noise injection, one layer at a time (slow; the paper's method)",
    )
    p.add_argument(
        f"--{prefix}tokens",
        type=int,
        default=DEFAULT_PROFILE.tokens,
        metavar="N",
        help=f"calibration token budget (default {DEFAULT_PROFILE.tokens})",
    )
    p.add_argument(
        f"--{prefix}context",
        type=int,
        default=512,
        metavar="T",
        help="tokens per window (default 512; an encoder's windows are at most 128)",
    )
    p.add_argument(
        f"--{prefix}levels",
        type=_levels,
        default=(0.005, 0.02),
        metavar="T2[,T2]",
        help="noise levels t^2 (default 0.005,0.02)",
    )
    p.add_argument(
        f"--{prefix}samples",
        type=int,
        default=DEFAULT_PROFILE.fisher_samples,
        metavar="K",
        help=f"label draws per window for --fast (default {DEFAULT_PROFILE.fisher_samples})",
    )
    p.add_argument(f"--{prefix}seed", type=int, default=0, metavar="S", help="seed (default 0)")
    p.add_argument(
        f"--{prefix}cache",
        default=None,
        metavar="DIR",
        help="profile and generated-text cache, reused when model, revision, data, metric and "
        "budget match (default $XDG_CACHE_HOME/higgs/profiles, i.e. ~/.cache/higgs/profiles)",
    )


def register(subparsers: Any) -> None:
    pr = subparsers.add_parser(
        "profile",
        help="measure a model's per-layer sensitivity profile (alpha per layer)",
        description=(
            "Measure alpha_l for every quantizable layer of SOURCE so that the metric change of any "
            "per-layer quantization is predicted as sum alpha_l * t_l^2. Resumable: rerun the same "
            "command after an interruption and it continues from the last finished layer."
        ),
    )
    pr.add_argument("source", metavar="SOURCE", help="checkpoint directory or Hub id")
    pr.add_argument(
        "--out", required=True, metavar="PROFILE.json", help="where to write the profile"
    )
    _add_profile_options(pr)
    pr.add_argument(
        "--skip",
        action="append",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="fnmatch pattern(s) of module names not to profile",
    )
    pr.add_argument("--revision", default=None, metavar="R", help="Hub revision")
    pr.add_argument("--token", default=None, metavar="T", help="Hub token")
    pr.add_argument("--json", action="store_true", help="print a summary as JSON")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(handler=cmd_profile)

    pl = subparsers.add_parser(
        "plan",
        help="predicted quality versus size (Pareto curve) from a profile, without quantizing",
        description=(
            "Print the Pareto curve of predicted metric change versus average bits per weight "
            "(scales, grids and 16-bit layers counted) and, with a target, the allocation for it."
        ),
    )
    pl.add_argument("source", metavar="SOURCE", help="checkpoint directory or Hub id")
    pl.add_argument("--profile", required=True, metavar="PROFILE.json")
    tgt = pl.add_mutually_exclusive_group()
    tgt.add_argument("--avg-bits", type=_positive_float, default=None, metavar="B")
    tgt.add_argument(
        "--max-ppl-increase",
        type=_positive_float,
        default=None,
        metavar="R",
        help="relative perplexity increase bound (0.05 = 5%%)",
    )
    pl.add_argument(
        "--max-code-bits",
        type=_positive_float,
        default=None,
        metavar="B",
        help="leave out grids above B code bits (e.g. those your kernels lack)",
    )
    pl.add_argument("--group-size", type=int, default=256, metavar="G")
    pl.add_argument("--rotation-block", type=int, default=1024, metavar="H")
    pl.add_argument(
        "--step",
        type=_positive_float,
        default=0.25,
        metavar="BITS",
        help="spacing of the printed curve in bits per weight (default 0.25)",
    )
    pl.add_argument("--skip", action="append", nargs="+", default=[], metavar="PATTERN")
    pl.add_argument("--revision", default=None, metavar="R")
    pl.add_argument("--token", default=None, metavar="T")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(handler=cmd_plan)


def add_quantize_args(q: argparse.ArgumentParser) -> None:
    """The dynamic-target options of `higgs quantize`."""
    g = q.add_argument_group("dynamic HIGGS (per-layer bit allocation)")
    tgt = g.add_mutually_exclusive_group()
    tgt.add_argument(
        "--avg-bits",
        type=_positive_float,
        default=None,
        metavar="B",
        help="average bits per weight over the linear layers, everything counted",
    )
    tgt.add_argument(
        "--max-ppl-increase",
        type=_positive_float,
        default=None,
        metavar="R",
        help="smallest model whose predicted perplexity increase is at most R (0.05 = 5%%)",
    )
    g.add_argument(
        "--max-code-bits",
        type=_positive_float,
        default=None,
        metavar="B",
        help="leave out grids above B code bits (e.g. those your kernels lack)",
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="PROFILE.json",
        help="use this profile (default: compute one, cached under --profile-cache)",
    )
    _add_profile_options(g, "profile-")


def _skip(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(pat for group in args.skip for pat in group)


def cmd_profile(args: argparse.Namespace) -> int:
    cfg = profile_config(args)
    text = read_text_option(args)
    from higgs_engine.job import ProfileSource, QuantizeJob, measure_profile
    from higgs_engine.planning.profile import ProfileDirectory, ProfileFile

    quiet_libraries()  # transformers' own loading bar and warnings: stderr is ours
    bar = StageBars(args.quiet)
    cache = Path(args.cache) if args.cache else default_profile_cache()
    how = ProfileSource(
        config=cfg,
        text=text,
        stores=(ProfileFile(Path(args.out)), ProfileDirectory(cache)),
        selfgen_cache=cache,
        skip=_skip(args),
    )
    try:
        job = QuantizeJob(args.source, profile=how, revision=args.revision, token=args.token)
        prof = measure_profile(job, bar)
    finally:
        bar.close()
    alphas = sorted(prof.alphas().items(), key=lambda kv: kv[1])
    summary = {
        "out": args.out,
        "layers": len(alphas),
        "metric": prof.metric,
        "method": prof.method,
        "calibration": prof.calibration,
        "tokens": cfg.tokens,
        "cost": prof.cost,
        "alpha_min": alphas[0],
        "alpha_max": alphas[-1],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    spread = alphas[-1][1] / alphas[0][1] if alphas[0][1] > 0 else math.inf
    print(
        f"profiled {len(alphas)} layers ({prof.method}, metric {prof.metric}, {cfg.tokens} tokens of "
        f"{prof.calibration.split(':')[0]}) in {prof.cost['seconds']:.1f} s, "
        f"{int(prof.cost['forward_passes'])} forward / {int(prof.cost['backward_passes'])} backward passes"
    )
    print(
        f"alpha from {alphas[0][1]:.4g} ({alphas[0][0]}) to {alphas[-1][1]:.4g} ({alphas[-1][0]}), spread {spread:.0f}x"
    )
    print(f"wrote {args.out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from higgs_engine.planning.config import HiggsConfig

    cfg = HiggsConfig(
        group_size=args.group_size, rotation_block=args.rotation_block, skip=_skip(args)
    )
    target = dynamic_target(args.avg_bits, args.max_ppl_increase)
    prof = load_profile(args.profile)
    from higgs_engine.planning.plans import plan_allocation, ppl_increase_from
    from higgs_engine.sources import resolve_model

    names = resolve_model(args.source, args.revision, args.token).layer_names(cfg.skip)
    from higgs_engine.planning.options import option_menu

    opts = option_menu(max_code_bits=args.max_code_bits)
    plan = plan_allocation(prof, cfg, target, names=names, options=opts, pareto_step=args.step)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    m = plan.metric
    print(
        f"Pareto curve of {args.source} from a {prof.method} profile (metric {m}); {plan.conversion}"
    )
    print(f"{'bits/weight':>12}  {'predicted ' + m:>14}  {'pred. ppl increase':>18}")

    def pct(predicted: float, sign: str = "") -> str:
        inc = ppl_increase_from(m, predicted)  # None: a cos profile has no perplexity
        return "n/a" if inc is None else f"{sign}{100 * inc:.2f}%"

    for pt in plan.pareto:
        print(f"{pt.avg_bits:12.4f}  {pt.predicted:14.5f}  {pct(pt.predicted):>18}")
    if target is not None:
        a = plan.allocation
        hist = ", ".join(f"{k}: {v}" for k, v in a.histogram().items())
        print(
            f"target {target.to_dict()}: {a.avg_bits:.4f} bits per weight, predicted {m} {a.predicted:.5f} "
            f"(ppl {pct(a.predicted, '+')}); layers {hist}"
        )
    return 0


def dynamic_job(
    args: argparse.Namespace,
    config: Any,
    *,
    calibration: Any = None,
    calibration_text: str | None = None,
) -> Any:
    """The engine job (higgs_engine.job.QuantizeJob) of `higgs quantize` with a dynamic
    target, or of uniform HIGGS with --profile (the report then carries the predicted change);
    None when neither applies (the caller then builds plain uniform HIGGS's)."""
    target = dynamic_target(
        getattr(args, "avg_bits", None), getattr(args, "max_ppl_increase", None)
    )
    if target is None and not getattr(args, "profile", None):
        return None
    if target is not None and (
        getattr(args, "bits", None) is not None or getattr(args, "n", None) is not None
    ):
        raise CliError(
            "--bits / --n fix one grid for every layer; drop them with --avg-bits or --max-ppl-increase"
        )
    from higgs_engine.job import ProfileSource, QuantizeJob

    if target is None:
        source = ProfileSource(profile=load_profile(args.profile))
    else:
        from higgs_engine.planning.options import option_menu

        # profile and calibration share the user's text when --profile-text is not given
        source = profile_source(
            args,
            fallback_text=calibration_text,
            menu=tuple(option_menu(max_code_bits=args.max_code_bits)),
        )
    return QuantizeJob(
        args.source,
        config,
        target=target,
        calibration=calibration,
        profile=source,
        device=getattr(args, "device", None),
        revision=args.revision,
        token=args.token,
        overwrite=bool(getattr(args, "overwrite", False)),
        threads=getattr(args, "threads", None),
    )
