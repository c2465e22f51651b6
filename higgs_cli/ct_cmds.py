"""`higgs quantize --format compressed-tensors`: a checkpoint vLLM, SGLang and transformers load,
each linear layer in one of vLLM's schemes (int4 W4A16 groups, int8, FP8, or 16-bit), uniform
for --bits 4 / 8 or chosen by the allocator for --avg-bits / --max-ppl-increase.

Only argparse-level work happens at import; torch and the library load inside the functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from higgs_cli.common import CliError, dynamic_target, profile_source

CT_FORMAT = "compressed-tensors"


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

    if args.calibration is not None:
        raise CliError("--calibration is not available with --format compressed-tensors yet")
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
    if args.dtype not in ("float16", "bfloat16"):
        raise CliError(
            f"--dtype {args.dtype}: a compressed-tensors checkpoint is float16 or bfloat16"
        )
    if args.scope == "all":
        raise CliError(
            "--scope all: compressed-tensors quantizes the linear layers; the token "
            "embedding and the head stay 16-bit (drop --scope)"
        )
    for flag, name in (
        ("--ftype", "ftype"),
        ("--eval-text", "eval_text"),
        ("--rotate", "rotate"),
        ("--split-max-size", "split_max_size"),
    ):
        if getattr(args, name, None) is not None:
            raise CliError(f"{flag} is an option of --format gguf")
    avg, ppl = getattr(args, "avg_bits", None), getattr(args, "max_ppl_increase", None)
    if sum(x is not None for x in (args.bits, avg, ppl)) > 1:
        raise CliError("give one of --bits, --avg-bits and --max-ppl-increase")
    if args.bits is not None and args.bits not in (4, 8):
        raise CliError(
            f"--bits {args.bits:g}: compressed-tensors takes 4 (int4 W4A16) or 8 (int8 per "
            "channel); give --avg-bits for a mix of vLLM's schemes"
        )


def ct_quantize(args: argparse.Namespace, progress: Any) -> Any:
    """The compressed-tensors run `higgs quantize --format compressed-tensors ...` asks for;
    returns its Report. A bad option is one error line naming its flag."""
    from higgs_engine.errors import InvalidConfigError
    from higgs_engine.job import CtOptions, ProfileSource, QuantizeJob, run

    _check_args(args)
    target = dynamic_target(
        getattr(args, "avg_bits", None), getattr(args, "max_ppl_increase", None)
    )
    bits = None if target is not None else int(args.bits if args.bits is not None else 4)
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
    )
    try:
        return run(job, Path(args.out), progress)
    except InvalidConfigError as e:
        if e.field not in _FLAG:
            raise
        raise CliError(f"{_FLAG[e.field]}: {e}") from None


_FLAG = {"bits": "--bits", "dtype": "--dtype", "device": "--device"}


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
    if m.get("predicted_ppl_increase") is not None:
        lines.append(f"predicted perplexity +{100 * m['predicted_ppl_increase']:.2f}%")
    check = m.get("load_check") or {}
    if check:
        lines.append(f"checked: {check['loader']} loads it ({check['class']})")
    if str(check.get("class", "")).endswith(("ForCausalLM", "LMHeadModel")):
        lines.append(f"serve it: vllm serve {d}")
    else:  # an encoder: its embeddings, through transformers (or vLLM's pooling runner)
        lines.append(f"load it: transformers.AutoModel.from_pretrained({str(d)!r})")
    return lines
