"""scope=linear vs scope=all (token embedding and untied head quantized too), side by side in
ONE run, through the engine's own pipeline (quantize_checkpoint / job.run, real artifacts):

1. uniform HIGGS --bits 4 (p=2 n=256) with each scope;
2. dynamic HIGGS at the same WHOLE-MODEL bits per parameter for both scopes: for each size
   (the whole-model bits/param of uniform 4-bit scope=linear, and a smaller one), the
   allocator's avg_bits is chosen per scope so that the whole checkpoint (16-bit norms,
   position tables and, with scope=linear, the embedding included) lands at that size.

Per run: whole-model bits/param (report.bits_per_param_total), bits per linear weight, the
native model.safetensors size, and the quality of the dequantized artifact: SmolLM2-135M KL
from the base model and perplexity on the first news windows; all-MiniLM-L6-v2 mean 1 - cos
of mean-pooled sentence embeddings on the first news sentences. The native artifact of the
uniform scope=all run is evaluated too (HiggsEmbedding + HiggsLinear computing from codes).

Profiles are the data-free ones with the embedding (and head) included, the engine's default
profile config (self-generated text for SmolLM2, random tokens for MiniLM), found in the
profile cache when present (the cache key includes the checkpoint path: the resolved path is
used) and measured otherwise.

Writes benchmarks/results/scope_<model>.json and .md.

    python -m benchmarks.scope [--model smollm2|minilm|all] [--windows 4] [--sentences 256]
        [--threads 2] [--render-only]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment, markdown_table, write_results
from devtools.quality import (
    MINILM_DIR,
    NEWS_FILE,
    SMOLLM_DIR,
    CausalLMEval,
    EmbeddingEval,
    load_causal_lm,
    load_encoder,
    news_sentences,
)
from higgs_engine.planning.config import HiggsConfig
from higgs_engine.planning.profile import Profile
from higgs_engine.report import Report

FP16_BITS = 16.0
# The smaller whole-model size of each model's dynamic pair: low enough to matter, high enough
# that scope=linear (16-bit embedding: 21% of SmolLM2's parameters, 52% of MiniLM's) can reach
# it with its linear layers above the cheapest grid.
SMALL_BPP = {"smollm2": 4.5, "minilm": 9.5}


def whole_model_params(path: Path) -> int:
    from higgs_engine.safetensors_stream import CheckpointReader

    with CheckpointReader(path) as reader:
        return sum(reader.numel(k) for k in reader)


def avg_bits_for_whole(
    target_bpp: float, params_total: int, allocated: list[str], profile: Profile
) -> float:
    """The allocator's avg_bits that puts the whole checkpoint at `target_bpp` bits per
    parameter: the allocated layers carry avg_bits (grids, scales and 16-bit choices counted by
    the allocator), every other tensor stays in 16 bits."""
    shapes = {la.name: la.shape for la in profile.layers}
    n_alloc = sum(shapes[n][0] * shapes[n][1] for n in allocated)
    return (target_bpp * params_total - FP16_BITS * (params_total - n_alloc)) / n_alloc


class Evaluator:
    """The base model's outputs once; then the quality of any checkpoint directory."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        text = NEWS_FILE.read_text(encoding="utf-8")
        self.encoder = name == "minilm"
        ckpt = MINILM_DIR if self.encoder else SMOLLM_DIR
        if self.encoder:
            model, tok = load_encoder(ckpt)
            self.ev: CausalLMEval | EmbeddingEval = EmbeddingEval(
                tok, news_sentences(text, args.sentences)
            )
        else:
            model, tok = load_causal_lm(ckpt)
            self.ev = CausalLMEval(tok, text, args.context, args.windows)
        self.base = self.ev.prepare_base(model)
        del model

    def __call__(self, path: Path, native: bool = False) -> dict[str, float]:
        if native:
            from higgs_engine.artifacts import load_model

            model, _ = load_model(path, dtype=torch.float32)
        else:
            model = (load_encoder(path) if self.encoder else load_causal_lm(path))[0]
        with torch.inference_mode():
            return self.ev.evaluate(model)


def run_one(
    label: str,
    ckpt: Path,
    out: Path,
    cfg: HiggsConfig,
    evaluator: Evaluator,
    *,
    avg_bits: float | None = None,
    profile: Profile | None = None,
    native_too: bool = False,
) -> dict[str, Any]:
    from higgs_engine.job import ProfileSource, QuantizeJob, run
    from higgs_engine.pipeline import quantize_checkpoint
    from higgs_engine.planning.plans import Target

    t0 = time.perf_counter()
    if avg_bits is None:
        rep: Report = quantize_checkpoint(ckpt, out, cfg)
    else:
        job = QuantizeJob(
            ckpt, cfg, target=Target(avg_bits=avg_bits), profile=ProfileSource(profile=profile)
        )
        rep = run(job, out)
    seconds = time.perf_counter() - t0
    quality = evaluator(out / "dequantized")
    rows = {r.name: r for r in rep.layers}
    emb = {
        name: {"p": rows[name].p, "n": rows[name].n, "bits": round(rows[name].bits, 4)}
        for name in rep.metrics.get("embedding_layers", {})
    }
    row: dict[str, Any] = {
        "run": label,
        "scope": cfg.scope,
        "target": f"avg_bits {avg_bits:.4f}" if avg_bits is not None else "bits 4",
        "bits_per_param_total": rep.bits_per_param_total,
        "bits_per_linear_weight": rep.bits_per_weight,
        "native_file_bytes": rep.metrics["files"]["native"]["model.safetensors"],
        "native_file_mib": rep.metrics["files"]["native"]["model.safetensors"] / 2**20,
        "embedding_layers": emb,
        "quantize_seconds": round(seconds, 1),
        **quality,
    }
    if avg_bits is not None:
        row["allocation_avg_bits"] = rep.metrics["allocation"]["avg_bits"]
        metric = rep.metrics.get("metric")
        row["predicted"] = rep.metrics.get(f"predicted_{metric}")
    if native_too:
        nat = evaluator(out / "native", native=True)
        row["native_eval"] = nat
    print(f"  {label}: {json.dumps({k: v for k, v in row.items() if k != 'embedding_layers'})}")
    return row


def run_model(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from devtools.profiles import obtain
    from higgs_engine.dynamic import allocated_layers, profile_stores
    from higgs_engine.sources import resolve_model

    # The resolved path: the profile cache's key includes the checkpoint's path.
    ckpt = (MINILM_DIR if name == "minilm" else SMOLLM_DIR).resolve()
    cache = args.profile_cache
    t0 = time.perf_counter()
    got = obtain(ckpt, stores=profile_stores(cache), selfgen_cache=cache, embeddings=True)
    profile = got.profile
    print(f"[{name}] profile {'cached' if got.reused else 'measured'}", flush=True)
    profile_s = time.perf_counter() - t0
    evaluator = Evaluator(name, args)
    params = whole_model_params(ckpt)
    rows: list[dict[str, Any]] = []
    for scope in ("linear", "all"):
        rows.append(
            run_one(
                f"uniform 4-bit, scope={scope}",
                ckpt,
                work / f"u4-{scope}",
                HiggsConfig.from_bits(4.0, scope=scope),
                evaluator,
                native_too=scope == "all",
            )
        )
    sizes = [rows[0]["bits_per_param_total"], args.small_bpp or SMALL_BPP[name]]
    for target in sizes:
        for scope in ("linear", "all"):
            cfg = HiggsConfig(scope=scope)
            avg = avg_bits_for_whole(
                target, params, allocated_layers(resolve_model(ckpt), cfg), profile
            )
            rows.append(
                run_one(
                    f"dynamic @ {target:.3f} bits/param, scope={scope}",
                    ckpt,
                    work / f"dyn-{target:.3f}-{scope}",
                    cfg,
                    evaluator,
                    avg_bits=avg,
                    profile=profile,
                )
            )
            rows[-1]["whole_model_target"] = target
    return {
        "model": name,
        "checkpoint": ckpt.name,
        "params_total": params,
        "metric": "one_minus_cos" if name == "minilm" else "kl",
        "base": evaluator.base,
        "profile": {
            "key": profile.key(),
            "calibration": profile.calibration,
            "metric": profile.metric,
            "layers": len(profile.layers),
            "reused_from_cache": got.reused is not None,
            "seconds": round(profile_s, 1),
        },
        "rows": rows,
    }


def render(res: dict[str, Any]) -> str:
    metric = res["metric"]
    cols = [
        ("run", "run"),
        ("bits_per_param_total", "whole-model bits/param"),
        ("bits_per_linear_weight", "bits/linear weight"),
        ("native_file_mib", "native file (MiB)"),
        (metric, "KL" if metric == "kl" else "1 - cos"),
    ]
    if metric == "kl":
        cols.append(("ppl", "ppl"))
    cols.append(("emb", "embedding (head) grid"))
    cols.append(("quantize_seconds", "quantize s"))
    rows = []
    for r in res["rows"]:
        emb = ", ".join(
            f"{k.rsplit('.', 1)[-1]} p{v['p']}n{v['n']} {v['bits']:.3g}b"
            for k, v in r["embedding_layers"].items()
        )
        rows.append({**r, "emb": emb or "16-bit"})
    base = res["base"]
    basefig = (
        f"base ppl {base['ppl']:.4g} on {base['tokens']} tokens"
        if metric == "kl"
        else f"{base['sentences']} sentences"
    )
    nat = next((r for r in res["rows"] if "native_eval" in r), None)
    natline = ""
    if nat is not None:
        natline = (
            f"\n\nThe native artifact of `{nat['run']}` (HiggsEmbedding + HiggsLinear) evaluates "
            f"to {metric} {nat['native_eval'][metric]:.5g} (dequantized: {nat[metric]:.5g})."
        )
    env = res.get("environment", {})
    return (
        f"## scope=linear vs scope=all: {res['checkpoint']} "
        f"({res['params_total'] / 1e6:.1f} M parameters)\n\n"
        f"Quality of the dequantized artifact, {basefig}. Profile: {res['profile']['calibration']}"
        f" ({'cached' if res['profile']['reused_from_cache'] else 'measured'}), embedding "
        "included. Dynamic rows: avg_bits chosen per scope so that the whole checkpoint lands at "
        "the named bits per parameter. "
        f"{env.get('torch_threads')} torch thread(s), load average "
        f"{env.get('load_average_1_5_15')}.\n\n" + markdown_table(rows, cols) + natline + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="all")
    ap.add_argument("--windows", type=int, default=4, help="SmolLM2 evaluation windows")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=256, help="MiniLM evaluation sentences")
    ap.add_argument(
        "--small-bpp",
        type=float,
        default=None,
        help="the smaller whole-model bits/param of the dynamic pair (default: "
        + ", ".join(f"{k} {v:g}" for k, v in SMALL_BPP.items())
        + "; scope=linear cannot go much below 16 bits times the embedding's share)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--profile-cache",
        type=Path,
        default=None,
        help="the engine's profile cache (default: the CLI's, ~/.cache/higgs/profiles)",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the markdown from the JSON results already in --out-dir (measures nothing)",
    )
    args = ap.parse_args(argv)
    models = ["smollm2", "minilm"] if args.model == "all" else [args.model]
    if args.render_only:
        for name in models:
            res = json.loads((args.out_dir / f"scope_{name}.json").read_text())
            write_results(f"scope_{name}", res, render(res), args.out_dir)
        return 0
    if args.profile_cache is None:
        from higgs_cli.common import default_profile_cache

        args.profile_cache = default_profile_cache()
    torch.set_num_threads(args.threads)
    for name in models:
        with tempfile.TemporaryDirectory(prefix=f"scope-bench-{name}-") as tmp:
            res = run_model(name, args, Path(tmp))
        res.update(
            environment=environment(),
            windows=args.windows,
            context=args.context,
            sentences=args.sentences,
        )
        md = render(res)
        write_results(f"scope_{name}", res, md, args.out_dir)
        print(md, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
