"""`higgs quantize --format gguf` and `higgs eval FILE.gguf`: a GGUF file for llama.cpp with the
allocator choosing llama.cpp's types, and its quality measured in llama.cpp.

Only argparse-level work happens at import; llama.cpp and torch load inside the functions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from higgs_cli.common import (
    CliError,
    dynamic_target,
    profile_source,
)


def add_quantize_args(q: argparse.ArgumentParser) -> None:
    from higgs_engine.planning.gguf_types import DEFAULT_SPLIT_GIB  # torch- and numpy-free

    g = q.add_argument_group("GGUF for llama.cpp (--format gguf)")
    g.add_argument(
        "--ftype",
        default=None,
        metavar="NAME",
        help="llama.cpp's own mixture instead of the allocator (e.g. Q4_K_M), for comparison",
    )
    g.add_argument(
        "--eval-text",
        default=None,
        metavar="FILE",
        help="measure perplexity / KL (1 - cos for an encoder) of the file in llama.cpp on this "
        "text, against the 16-bit GGUF of the same checkpoint; with --format compressed-tensors "
        "perplexity / KL of a decoder in transformers, against the source",
    )
    g.add_argument(
        "--eval-windows", type=int, default=None, metavar="W", help="windows to evaluate"
    )
    g.add_argument(
        "--rotate",
        choices=["off", "on", "auto"],
        default=None,
        help="llama-family models: fold the norms and rotate the residual stream before "
        "converting (on), or measure both and keep the one with the lower predicted change "
        "at the target (auto); default off",
    )
    g.add_argument(
        "--split-max-size",
        type=float,
        default=None,
        metavar="GIB",
        help="write llama.cpp split files (-0000k-of-0000N.gguf) when the 16-bit checkpoint is "
        f"above this size in GiB (default {DEFAULT_SPLIT_GIB})",
    )


def wants_gguf(args: argparse.Namespace) -> bool:
    formats = [f.strip() for f in str(args.format).split(",") if f.strip()]
    if "gguf" not in formats:
        if (
            getattr(args, "ftype", None)
            or getattr(args, "eval_text", None)
            or getattr(args, "rotate", None)
            or getattr(args, "threads", None)
        ):
            raise CliError(
                "--ftype / --eval-text / --rotate / --threads are options of --format gguf"
            )
        return False
    if formats != ["gguf"]:
        raise CliError(
            f"--format {args.format}: gguf is a file of llama.cpp's types, not of HIGGS codes; "
            "write it in its own run (--format gguf)"
        )
    return True


def higgs_only_flags(args: argparse.Namespace) -> list[str]:
    """The HIGGS-only flags of `higgs quantize` given with a value other than their default
    (a gguf run would ignore them)."""
    from higgs_engine.planning.config import DEFAULT_SCALE_RULE, DEFAULT_SIGN_SEED

    defaults = {
        "skip": [],
        "dtype": "float16",
        "group_size": 256,
        "rotation_block": 1024,
        "sign_seed": DEFAULT_SIGN_SEED,
        "scale_rule": DEFAULT_SCALE_RULE,
    }
    return [
        "--" + name.replace("_", "-")
        for name, default in defaults.items()
        if getattr(args, name, default) != default
    ]


def _check_args(args: argparse.Namespace) -> None:
    if args.calibration is not None:
        raise CliError("--calibration is not available with --format gguf (data-free only)")
    if getattr(args, "method", "higgs") != "higgs":
        raise CliError(
            "--method chooses how HIGGS quantizes; --format gguf takes llama.cpp's types"
        )
    if args.p is not None or args.n is not None:
        raise CliError("--p / --n choose HIGGS grids; --format gguf chooses llama.cpp's types")
    higgs_only = higgs_only_flags(args)
    if higgs_only:
        raise CliError(
            f"{' / '.join(higgs_only)}: HIGGS options that --format gguf does not take "
            "(its tensors are in llama.cpp's own types); omit them"
        )
    given = [
        x is not None
        for x in (
            args.bits,
            getattr(args, "avg_bits", None),
            getattr(args, "max_ppl_increase", None),
            args.ftype,
        )
    ]
    if sum(given) > 1:
        raise CliError("give one of --bits, --avg-bits, --max-ppl-increase and --ftype")
    if args.eval_windows is not None and args.eval_windows < 1:
        raise CliError(f"--eval-windows {args.eval_windows} must be at least 1")
    if args.split_max_size is not None and not args.split_max_size > 0:
        raise CliError(f"--split-max-size {args.split_max_size:g} must be a positive size in GiB")


def quantize(args: argparse.Namespace, progress: Any) -> Any:
    """The GGUF run `higgs quantize --format gguf ...` asks for; returns its Report. An option
    the plan refuses is a one-line error naming its flag, before anything is converted."""
    from higgs_engine.errors import InvalidConfigError
    from higgs_engine.evaluate import read_text
    from higgs_engine.gguf.runplan import DEFAULT_ROTATE, GgufEvalRequest
    from higgs_engine.job import GgufOptions, ProfileSource, QuantizeJob, run
    from higgs_engine.planning.gguf_types import GIB

    _check_args(args)
    target = dynamic_target(
        getattr(args, "avg_bits", None), getattr(args, "max_ppl_increase", None)
    )
    bits = args.bits
    if target is None and args.ftype is None and bits is None:
        bits = 4.0
    evaluate = None
    if args.eval_text is not None:
        evaluate = GgufEvalRequest(
            read_text(Path(args.eval_text)), Path(args.eval_text).name, windows=args.eval_windows
        )
    # a profile only for a dynamic target (bits and ftype need none)
    source = ProfileSource() if target is None else profile_source(args)
    job = QuantizeJob(
        args.source,
        target=target,
        profile=source,
        device=args.device,
        revision=args.revision,
        token=args.token,
        overwrite=args.overwrite,
        gguf=GgufOptions(
            bits=bits,
            ftype=args.ftype.upper() if args.ftype else None,
            rotate=getattr(args, "rotate", None) or DEFAULT_ROTATE,
            evaluate=evaluate,
            split_max_bytes=int(args.split_max_size * GIB) if args.split_max_size else None,
            threads=args.threads or 0,
        ),
    )
    try:
        return run(job, Path(args.out), progress)
    except InvalidConfigError as e:
        if e.field not in _FLAG:
            raise
        raise CliError(f"{_FLAG[e.field]}: {e}") from None


_FLAG = {
    "bits": "--bits",
    "ftype": "--ftype",
    "split_max_bytes": "--split-max-size",
    "rotate": "--rotate",
    "threads": "--threads",
    "device": "--device",
}


def summary_lines(rep: Any, out: Path) -> list[str]:
    m = rep.metrics
    hist = ", ".join(f"{t} x{c}" for t, c in m.get("type_histogram", {}).items())
    lines = [
        f"wrote {len(m['gguf_files'])} GGUF file(s) for llama.cpp ({m['gguf_architecture']}): "
        f"{hist}",
        f"{rep.bits_per_weight:.4f} bits per weight over the whole file as llama.cpp counts "
        f"(transformer blocks {m['bits_per_linear_weight']:.3f}), "
        f"{rep.bytes_before / 1e6:.2f} MB -> {m['file_bytes'] / 1e6:.2f} MB "
        f"in {rep.timings.get('total', 0.0):.1f} s",
    ]
    if m.get("predicted_change") is not None:
        lines.append(
            f"predicted {m['profile_metric']} change {m['predicted_change']:.5f}"
            + (
                f" (perplexity +{100 * m['predicted_ppl_increase']:.1f}%)"
                if m.get("predicted_ppl_increase") is not None
                else ""
            )
        )
    if m.get("rotation") is not None:
        r = m["rotation"]
        both = (
            f"; predicted {r['predicted_change_plain']:.5f} unrotated, "
            f"{r['predicted_change_rotated']:.5f} rotated"
            if "predicted_change_rotated" in r
            else ""
        )
        lines.append(f"rotation ({r['rotation']}): {'kept' if m['rotated'] else 'not kept'}{both}")
    if m.get("kl") is not None:
        lines.append(
            f"measured in llama.cpp: perplexity {m['ppl_base']:.3f} -> {m['ppl_quantized']:.3f}, "
            f"KL {m['kl']:.5f} over {m['eval_tokens']} tokens"
        )
    elif m.get("one_minus_cos") is not None:
        lines.append(f"measured in llama.cpp: 1 - cos {m['one_minus_cos']:.5f}")
    lines.append(f"run it: llama-cli -m {out / 'gguf' / m['gguf_files'][0]}")
    return lines


# ---------------------------------------------------------------------------------------------
# higgs eval FILE.gguf
# ---------------------------------------------------------------------------------------------


def eval_gguf(args: argparse.Namespace, text: str, progress: Any) -> dict[str, Any]:
    """`higgs eval MODEL.gguf --base BASE`: MODEL against BASE (a GGUF file, or a checkpoint
    converted here with llama.cpp's converter), both run in llama.cpp."""
    from higgs_engine.gguf.convert import convert_checkpoint
    from higgs_engine.gguf.evaluate import evaluate_gguf
    from higgs_engine.model_structure import load_config, model_kind

    model = Path(args.model)
    if args.base is None:
        raise CliError("evaluating a .gguf file needs --base (the 16-bit GGUF or its checkpoint)")
    base = Path(args.base)
    with tempfile.TemporaryDirectory(prefix="higgs-eval-") as tmp:
        if base.is_dir():
            encoder = model_kind(load_config(base)) != "causal"
            base = convert_checkpoint(base, Path(tmp) / "base-f16.gguf")
        else:
            encoder = _is_encoder(base)
        res = evaluate_gguf(
            model,
            base,
            text,
            encoder=encoder,
            context=args.context,
            windows=args.windows,
            progress=progress,
        )
    return res.to_dict()


def _is_encoder(path: Path) -> bool:
    from higgs_engine.gguf.plan import read_gguf

    return read_gguf(path, quantized=True).arch in {"bert", "nomic-bert", "jina-bert-v2"}


def print_eval(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res))
    elif res.get("kl") is not None:
        print(
            f"llama.cpp: perplexity {res['ppl_quantized']:.4f} (base {res['ppl_base']:.4f}), "
            f"KL from base {res['kl']:.5f} over {res['eval_tokens']} tokens "
            f"({res['eval_windows']} windows of {res['eval_context']})"
        )
    else:
        print(
            f"llama.cpp: 1 - cos of the pooled embeddings {res['one_minus_cos']:.5f} over "
            f"{res['eval_windows']} windows of {res['eval_context']} tokens"
        )
