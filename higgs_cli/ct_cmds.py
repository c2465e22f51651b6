"""`higgs quantize --format compressed-tensors`: a checkpoint vLLM, SGLang and transformers load,
each linear layer in one of vLLM's schemes (int4 W4A16 groups, int8, FP8, or 16-bit), uniform
for --bits 4 / 8 or chosen by the allocator for --avg-bits / --max-ppl-increase; with
--calibration, GPTQ in each layer's scheme.

Only argparse-level work happens at import; torch and the library load inside the functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from higgs_cli.common import (
    CliError,
    calibration_request,
    calibration_text,
    dynamic_target,
    profile_source,
)
from higgs_engine.planning.ct_targets import CT_BITS, CT_DTYPES, CT_FORMAT


def wants_ct(args: argparse.Namespace) -> bool:
    """Whether --format asks for compressed-tensors (alone: it is its own checkpoint)."""
    formats = [f.strip() for f in str(args.format).split(",") if f.strip()]
    if CT_FORMAT not in formats:
        return False
    if formats != [CT_FORMAT]:
        raise CliError(
            f"--format {args.format}: compressed-tensors is a checkpoint of vLLM's schemes, not "
            "of HIGGS codes or llama.cpp's types; write it in its own run "
            "(--format compressed-tensors)"
        )
    return True


def _check_args(args: argparse.Namespace) -> None:
    from higgs_cli.gguf_cmds import higgs_only_flags

    if getattr(args, "method", "higgs") != "higgs":
        raise CliError(
            "--method chooses how HIGGS quantizes; --format compressed-tensors takes vLLM's schemes"
        )
    if args.p is not None or args.n is not None:
        raise CliError(
            "--p / --n choose HIGGS grids; --format compressed-tensors takes vLLM's schemes"
        )
    higgs_only = [f for f in higgs_only_flags(args) if f != "--dtype"]
    if higgs_only:
        raise CliError(
            f"{' / '.join(higgs_only)}: HIGGS options that --format compressed-tensors does "
            "not take (its layers are in vLLM's schemes); omit them"
        )
    if args.dtype not in CT_DTYPES:
        raise CliError(
            f"--dtype {args.dtype}: a compressed-tensors checkpoint is {' or '.join(CT_DTYPES)}"
        )
    if args.scope == "all":
        raise CliError(
            "--scope all: compressed-tensors quantizes the linear layers; the token "
            "embedding and the head stay 16-bit (drop --scope)"
        )
    for flag, name in (
        ("--ftype", "ftype"),
        ("--rotate", "rotate"),
        ("--split-max-size", "split_max_size"),
    ):
        if getattr(args, name, None) is not None:
            raise CliError(f"{flag} is an option of --format gguf")
    avg, ppl = getattr(args, "avg_bits", None), getattr(args, "max_ppl_increase", None)
    if sum(x is not None for x in (args.bits, avg, ppl)) > 1:
        raise CliError("give one of --bits, --avg-bits and --max-ppl-increase")
    if args.bits is not None and args.bits not in CT_BITS:
        raise CliError(
            f"--bits {args.bits:g}: compressed-tensors takes 4 (int4 W4A16) or 8 (int8 per "
            "channel); give --avg-bits for a mix of vLLM's schemes"
        )


def quantize(args: argparse.Namespace, progress: Any) -> Any:
    """The compressed-tensors run `higgs quantize --format compressed-tensors ...` asks for;
    returns its Report. A bad option is one error line naming its flag."""
    from higgs_engine.errors import InvalidConfigError
    from higgs_engine.job import CtOptions, ProfileSource, QuantizeJob, run

    _check_args(args)
    calibration = calibration_request(args, calibration_text(args))  # a bad file: before any work
    target = dynamic_target(
        getattr(args, "avg_bits", None), getattr(args, "max_ppl_increase", None)
    )
    bits = None if target is not None else int(args.bits if args.bits is not None else 4)
    annotate = _evaluation(args, progress)
    job = QuantizeJob(
        args.source,
        target=target,
        profile=ProfileSource() if target is None else profile_source(args),
        device=args.device,
        revision=args.revision,
        token=args.token,
        overwrite=args.overwrite,
        threads=args.threads,
        ct=CtOptions(bits=bits, dtype=args.dtype),
        calibration=calibration,
        annotate=annotate,
    )
    try:
        return run(job, Path(args.out), progress)
    except InvalidConfigError as e:
        if e.field not in _FLAG:
            raise
        raise CliError(f"{_FLAG[e.field]}: {e}") from None


_FLAG = {"bits": "--bits", "dtype": "--dtype", "device": "--device"}


def _evaluation(args: argparse.Namespace, progress: Any) -> Any:
    """With --eval-text: the report's perplexity and KL measured on the checkpoint as
    transformers loads it, against the source, before report.json is written (None without)."""
    if args.eval_text is None:
        return None
    from higgs_engine.evaluate import compare_to_base, read_text
    from higgs_engine.model_structure import CAUSAL_ARCH_SUFFIXES

    config = Path(args.source) / "config.json"
    if config.is_file():
        import json

        archs = json.loads(config.read_text()).get("architectures") or []
        if archs and not any(str(a).endswith(CAUSAL_ARCH_SUFFIXES) for a in archs):
            raise CliError(
                f"--eval-text measures a decoder's perplexity and KL; {archs[0]} is an encoder "
                "(evaluate its embeddings with the benchmarks' 1 - cos instead)"
            )
    text = read_text(Path(args.eval_text))  # a bad file is one error line, before any work
    windows = args.eval_windows or 16
    if windows < 1:
        raise CliError(f"--eval-windows {windows} must be at least 1")

    def annotate(rep: Any, staged: Path) -> None:
        found = compare_to_base(
            Path(args.source), staged / CT_FORMAT, text, windows=windows, progress=progress
        )
        rep.metrics.update(
            {**found, "eval_text": Path(args.eval_text).name, "eval_engine": "transformers"}
        )

    return annotate


def summary_lines(rep: Any, out: Path) -> list[str]:
    """What `higgs quantize --format compressed-tensors` prints after the run."""
    m = rep.metrics
    hist = ", ".join(f"{s} x{c}" for s, c in m.get("schemes", {}).items())
    d = out / CT_FORMAT
    lines = [
        f"wrote a compressed-tensors checkpoint ({m['quantization_format']}) of "
        f"{rep.source.get('architecture')}: {hist}",
        f"{rep.bits_per_weight:.4f} bits per linear weight (every scale counted), "
        f"{rep.bytes_before / 1e6:.2f} MB -> {m['file_bytes'] / 1e6:.2f} MB "
        f"in {rep.timings.get('total', 0.0):.1f} s",
    ]
    if m.get("kept"):
        lines.append(f"{len(m['kept'])} layer(s) kept 16-bit (report.json says why)")
    cal = m.get("calibration")
    if cal:
        lines.append(
            f"calibrated: GPTQ in each scheme on {cal['tokens']} tokens of {cal['source']}, "
            f"{cal['layers_calibrated']} layers"
        )
    if m.get("predicted_ppl_increase") is not None:
        lines.append(f"predicted perplexity +{100 * m['predicted_ppl_increase']:.2f}%")
    if m.get("kl") is not None:
        lines.append(
            f"measured in transformers: perplexity {m['ppl_base']:.3f} -> "
            f"{m['ppl_quantized']:.3f}, KL {m['kl']:.5f} over {m['eval_tokens']} tokens"
        )
    check = m.get("load_check") or {}
    if check:
        lines.append(f"checked: {check['loader']} loads it ({check['class']})")
    if check.get("kind") == "causal":
        lines.append(f"serve it: vllm serve {d}")
    else:  # an encoder: its embeddings, through transformers (or vLLM's pooling runner)
        lines.append(f"load it: transformers.AutoModel.from_pretrained({str(d)!r})")
    return lines
