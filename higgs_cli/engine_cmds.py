"""Engine verbs of the `higgs` command: `quantize` and `eval`.

Only argparse is imported at module level; torch / transformers load inside the handlers.
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
    calibration_request,
    calibration_text,
    quiet_libraries,
)
from higgs_engine.planning.config import (
    DEFAULT_FORMATS,
    DEFAULT_METHOD,
    DEFAULT_SCALE_RULE,
    DEFAULT_SIGN_SEED,
    FORMAT_NAMES,
    METHOD_NAMES,
    SCALE_RULES,
    SCOPES,
    WHOLE_FILE_FORMATS,
    WRITER_FORMATS,
)


def check_formats(value: str) -> None:
    """--format: comma separated names of higgs_engine.planning.config.FORMAT_NAMES (one
    CliError line naming the bad value otherwise)."""
    names = [f.strip() for f in value.split(",") if f.strip()]
    if not names or any(f not in FORMAT_NAMES for f in names):
        raise CliError(
            f"--format {value!r}: the formats must each be one of {', '.join(FORMAT_NAMES)}"
        )


def _sign_seed(value: str) -> int | None:
    """--sign-seed: an integer seed (HiggsConfig checks its range), or "none" for no signs."""
    if value.strip().lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer seed or none") from None


def register(subparsers: Any) -> None:
    q = subparsers.add_parser(
        "quantize",
        help="quantize a Hugging Face checkpoint with HIGGS",
        description=(
            "Quantize SOURCE (a checkpoint directory, a .gguf file or a Hub id) and write "
            "DIR/native, DIR/dequantized and DIR/report.json; with --format gguf, "
            "DIR/gguf/*.gguf for llama.cpp (its own types, chosen per tensor by the allocator)."
        ),
    )
    q.add_argument("source", metavar="SOURCE", help="checkpoint directory, .gguf file or Hub id")
    q.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist)")
    q.add_argument(
        "--bits",
        type=float,
        metavar="B",
        help="code bits per weight, log2(n)/p (4 -> p=2 n=256, 4.5 -> p=2 n=512); default 4",
    )
    q.add_argument("--p", type=int, metavar="P", help="grid dimension (1 or 2)")
    q.add_argument("--n", type=int, metavar="N", help="grid size (a power of two)")
    q.add_argument(
        "--group-size", type=int, default=256, metavar="G", help="scale group (default 256)"
    )
    q.add_argument(
        "--rotation-block",
        type=int,
        default=1024,
        metavar="H",
        help="largest Hadamard block (default 1024)",
    )
    q.add_argument(
        "--sign-seed",
        type=_sign_seed,
        default=DEFAULT_SIGN_SEED,
        metavar="S|none",
        help=f"seed of the random signs before the rotation, or none (default {DEFAULT_SIGN_SEED})",
    )
    q.add_argument(
        "--scale-rule",
        choices=SCALE_RULES,
        default=DEFAULT_SCALE_RULE,
        help=f"how each group's scale is chosen (default {DEFAULT_SCALE_RULE}; rms is the paper's)",
    )
    q.add_argument(
        "--scope",
        choices=SCOPES,
        default=None,
        help="what HIGGS quantizes: linear (the linear layers, the default) or all (also the "
        "token embedding and an untied output head, at the same bits or allocated like any "
        "layer); --format gguf always quantizes the embedding",
    )
    q.add_argument(
        "--format",
        default=",".join(DEFAULT_FORMATS),
        metavar="F[,F]",
        help=f"artifacts to write: any of {', '.join(WRITER_FORMATS)} (default "
        f"{','.join(DEFAULT_FORMATS)}); or one of {', '.join(WHOLE_FILE_FORMATS)} alone "
        "(gguf: a llama.cpp file; compressed-tensors: a checkpoint vLLM and transformers load)",
    )
    q.add_argument(
        "--method",
        choices=METHOD_NAMES,
        default=DEFAULT_METHOD,
        help="how each layer is quantized: higgs (data-free HIGGS, the default), higgs-gptq "
        "(calibrated HIGGS: needs --calibration), or a baseline at the same bits: rtn "
        "(round-to-nearest integers per --group-size group), nf4 / nf4-dq (4-bit NormalFloat "
        "per --group-size block); the baselines write --format dequantized only, with --bits",
    )
    q.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "bfloat16", "float32"],
        help="dtype of 16-bit tensors and of the dequantized checkpoint",
    )
    q.add_argument(
        "--skip",
        action="append",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="fnmatch pattern(s) of module names to keep in 16 bits",
    )
    q.add_argument(
        "--revision", default=None, metavar="R", help="Hub revision (branch, tag or sha)"
    )
    q.add_argument(
        "--token",
        default=None,
        metavar="T",
        help="Hub token (default: huggingface_hub's own HF_TOKEN / login)",
    )
    q.add_argument(
        "--device",
        default="auto",
        help="where rotation and search run: cpu, cuda, cuda:N or auto (default: CUDA if usable)",
    )
    q.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for the run: torch's; with --format gguf llama.cpp's measuring, "
        "quantizing and evaluating too (default: torch's own choice; llama.cpp every core)",
    )
    q.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    q.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    c = q.add_argument_group("calibrated HIGGS (GPTQ with HIGGS grids)")
    c.add_argument(
        "--calibration",
        default=None,
        metavar="FILE|self",
        help="UTF-8 text whose activations guide the rounding (same artifact format and size), "
        "or `self` for text the model generates itself (cached); with --avg-bits the profile "
        "uses the same text unless --profile-text is given",
    )
    c.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        metavar="N",
        help="calibration tokens to use (default 8192; the text must have at least N)",
    )
    dyn = _dynamic_hooks()
    if dyn is not None:
        dyn.add_quantize_args(q)  # --avg-bits / --max-ppl-increase / --profile ...
    from higgs_cli import gguf_cmds

    gguf_cmds.add_quantize_args(q)
    q.set_defaults(handler=cmd_quantize)

    e = subparsers.add_parser(
        "eval",
        help="perplexity / KL of a model or artifact on a text file",
        description=(
            "Perplexity of MODEL (checkpoint dir, native or dequantized artifact, or a "
            "`higgs quantize` output dir) over non-overlapping windows of a text file, and the "
            "KL divergence from BASE's next-token distribution."
        ),
    )
    e.add_argument("model", metavar="MODEL")
    e.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file")
    e.add_argument("--base", default=None, metavar="BASE", help="base model for KL")
    e.add_argument(
        "--context", type=int, default=512, metavar="T", help="tokens per window (default 512)"
    )
    e.add_argument(
        "--windows", type=int, default=40, metavar="W", help="number of windows (default 40)"
    )
    e.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    e.add_argument("--json", action="store_true", help='print {"ppl", "kl", "tokens"} as JSON')
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(handler=cmd_eval)


def _dynamic_hooks() -> Any:
    """higgs_cli.dynamic_cmds (dynamic HIGGS options of `quantize`), or None if absent."""
    try:
        from higgs_cli import dynamic_cmds
    except ModuleNotFoundError:
        return None
    return dynamic_cmds


def _engine_config(args: argparse.Namespace) -> Any:
    from higgs_engine.planning.config import HiggsConfig

    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    skip = tuple(pat for group in args.skip for pat in group)
    kw = {
        "group_size": args.group_size,
        "rotation_block": args.rotation_block,
        "sign_seed": args.sign_seed,
        "scale_rule": args.scale_rule,
        "skip": skip,
        "formats": formats,
        "dtype": args.dtype,
        "scope": args.scope or "linear",
        "method": args.method,
    }
    if args.bits is not None and (not math.isfinite(args.bits) or args.bits <= 0):
        raise CliError(f"--bits {args.bits:g} must be a positive number")
    if args.p is not None and args.n is not None:
        if args.bits is not None:
            return HiggsConfig.from_bits(args.bits, p=args.p, n=args.n, **kw)
        return HiggsConfig(p=args.p, n=args.n, **kw)
    if args.n is not None:  # --n alone: the default grid dimension
        return (
            HiggsConfig(p=2, n=args.n, **kw)
            if args.bits is None
            else HiggsConfig.from_bits(args.bits, p=2, n=args.n, **kw)
        )
    return HiggsConfig.from_bits(4.0 if args.bits is None else args.bits, p=args.p, **kw)


def _quantize_whole_file(args: argparse.Namespace, fmt: Any) -> int:
    """A whole-file format's run (`fmt`: higgs_cli.gguf_cmds or ct_cmds, with their
    `quantize(args, progress)` and `summary_lines(report, out)`), its bars and its summary."""
    quiet_libraries()
    bars = StageBars(args.quiet)
    try:
        rep = fmt.quantize(args, bars)
    finally:
        bars.close()
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, sort_keys=True))
    else:
        print("\n".join(fmt.summary_lines(rep, Path(args.out))))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from higgs_cli import ct_cmds, gguf_cmds

    check_formats(args.format)
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads {args.threads} must be at least 1")
    if ct_cmds.wants_ct(args):
        return _quantize_whole_file(args, ct_cmds)
    if gguf_cmds.wants_gguf(args):
        if args.scope == "linear":
            raise CliError(
                "--scope linear: a gguf file always quantizes the token embedding and the head "
                "(drop --scope, or give --scope all)"
            )
        return _quantize_whole_file(args, gguf_cmds)
    cfg = _engine_config(args)  # validate before importing torch
    cal_text = calibration_text(args)
    from higgs_engine.job import QuantizeJob, run

    quiet_libraries()
    bars = StageBars(args.quiet)
    dyn = _dynamic_hooks()
    try:
        calibration = calibration_request(args, cal_text)
        # A dynamic target (per-layer allocation) or --profile: the dynamic hooks build the
        # job; None when the command asks for plain uniform HIGGS.
        job = (
            dyn.dynamic_job(args, cfg, calibration=calibration, calibration_text=cal_text)
            if dyn is not None
            else None
        )
        if job is None:
            job = QuantizeJob(
                args.source,
                cfg,
                calibration=calibration,
                device=args.device,
                revision=args.revision,
                token=args.token,
                overwrite=args.overwrite,
                threads=args.threads,
            )
        rep = run(job, Path(args.out), bars)
    finally:
        bars.close()
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, sort_keys=True))
        return 0
    print("\n".join(_summary_lines(rep, cfg, Path(args.out))))
    return 0


def _summary_lines(rep: Any, cfg: Any, out: Path) -> list[str]:
    """What `higgs quantize` prints after a HIGGS run: layers and grids, bits, calibration,
    sizes, what was written."""
    grids: dict[str, int] = {}
    for r in rep.layers:
        if r.p:
            grids[f"p={r.p} n={r.n}"] = grids.get(f"p={r.p} n={r.n}", 0) + 1
    quantized = sum(grids.values())
    kept = len(rep.layers) - quantized
    if len(grids) == 1:
        how = f"HIGGS {next(iter(grids))} ({cfg.code_bits:g} code bits)" if quantized else "HIGGS"
    else:
        how = "HIGGS grids " + ", ".join(f"{g} x{c}" for g, c in sorted(grids.items()))
    lines = [
        f"quantized {quantized} layers of {rep.source.get('architecture')} with {how}"
        + (f"; {kept} kept in 16 bits" if kept else "")
        + (
            " (token embedding / head: " + ", ".join(rep.metrics["embedding_layers"]) + ")"
            if rep.metrics.get("embedding_layers")
            else ""
        ),
        f"bits per weight {rep.bits_per_weight:.4f} (linear layers, scales and grids included), "
        f"{rep.bits_per_param_total:.3f} over all parameters",
        *(
            [
                "calibrated on {tokens} tokens of {source} (sha256 {sha})".format(
                    tokens=rep.metrics["calibration"]["tokens"],
                    source=rep.metrics["calibration"]["source"],
                    sha=str(rep.metrics["calibration"]["sha256"])[:12],
                )
            ]
            if rep.metrics.get("calibration")
            else []
        ),
        f"size {rep.bytes_before / 1e6:.2f} MB -> {rep.bytes_after / 1e6:.2f} MB, "
        f"in {rep.timings.get('total', 0.0):.1f} s",
        f"wrote {', '.join(str(out / f) for f in rep.formats)} and {out / 'report.json'}",
    ]
    return lines


def _device(name: str) -> str:
    from higgs_engine.device import resolve_device
    from higgs_engine.errors import InvalidConfigError

    try:
        return str(resolve_device(name))
    except InvalidConfigError as e:
        raise CliError(f"--device: {e}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    from higgs_engine.evaluate import read_text

    if args.context < 2:
        raise CliError(f"--context {args.context} must be at least 2")
    if args.windows < 1:
        raise CliError(f"--windows {args.windows} must be at least 1")
    text = read_text(Path(args.text))
    if args.model.endswith(".gguf"):
        from higgs_cli import gguf_cmds

        bars = StageBars(args.quiet)
        try:
            found = gguf_cmds.eval_gguf(args, text, bars)
        finally:
            bars.close()
        gguf_cmds.print_eval(found, args.json)
        return 0

    import torch

    from higgs_engine.artifacts import load_model
    from higgs_engine.evaluate import evaluate_windows, text_windows, tokenize

    quiet_libraries()
    device = _device(args.device)
    # float32 on CPU: half precision matmuls there are slow and less accurate.
    dtype = torch.float32 if device == "cpu" else None
    model, tok = load_model(args.model, device=device, dtype=dtype)
    base = None
    if args.base is not None:
        base, base_tok = load_model(args.base, device=device, dtype=dtype)
        tok = tok if tok is not None else base_tok
    if tok is None:
        raise CliError(f"{args.model!r} has no tokenizer files; give --base with a tokenizer")
    windows = text_windows(tokenize(tok, text), args.context, args.windows)
    bars = StageBars(args.quiet)
    try:
        res = evaluate_windows(model, windows, base, bars)
    finally:
        bars.close()
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        kl = f", KL from base {res.kl:.5f}" if res.kl is not None else ""
        print(
            f"perplexity {res.ppl:.4f}{kl} over {res.tokens} tokens ({windows.shape[0]} windows of {args.context})"
        )
    return 0
