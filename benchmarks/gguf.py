"""GGUF files for llama.cpp: the allocator choosing llama.cpp's types per tensor (data-free)
against llama.cpp's own mixtures, side by side in one run, everything measured in llama.cpp.

For each model (SmolLM2-135M-Instruct, all-MiniLM-L6-v2) the checkpoint is converted once with
llama.cpp's converter (16-bit GGUF, the base of every comparison), then:

- llama.cpp's own Q3_K_M, Q4_K_M, IQ4_XS and Q5_K_M (llama_model_quantize, as llama-quantize
  makes them), and the same four with an importance matrix computed on held-out news text
  (the stretch comparison; the imatrix is collected as llama-imatrix does: the mean square of
  each input column of every matrix product, here from the torch model's linear inputs);
- the allocator (`higgs quantize --format gguf --avg-bits B`): t^2 of every tensor in every
  menu type with llama.cpp's kernels, alphas from the model's data-free profile (embedding and
  head included, the engine's default profile: self-generated text for SmolLM2, random tokens
  for MiniLM), the exact DP at B = each llama.cpp file's bits per weight (so its file is never
  larger), and at 3.5 and 4.5 bits per weight.

Quality in llama.cpp against the 16-bit file: SmolLM2 perplexity and mean KL per token on the
first news windows (every file is data-free or uses held-out text for its imatrix); MiniLM
1 - cos of the mean-pooled embeddings of news sentences. File size (bytes on disk), bits per
weight as llama.cpp counts them (tensor data over all parameters), quantization time (llama.cpp:
llama_model_quantize; allocator: measuring t^2 + DP + llama_model_quantize; the profile is
measured once per model and cached, its time listed apart), predicted and measured change.

With `--rotate` (SmolLM2), the allocator also runs on the rotated checkpoint (RMSNorm weights
folded into the linears, the residual stream rotated by a seeded orthogonal matrix, V/O rotated
per head, the tied head untied: higgs_engine/gguf/rotate.py) at each budget, with the rotated
file's bits per weight set so that it holds no more tensor bytes than the unrotated file at that
budget (the untied head is paid for). Both are evaluated against the unrotated 16-bit file;
a rotation table puts them side by side with what `--rotate auto` would choose (the lower
predicted change). `--rotation-only` skips the imatrix and the evaluation of llama.cpp's
mixtures (still quantized, for their sizes: the budgets) and writes gguf_rotation_<model>.*.

    python -m benchmarks.gguf [--model smollm2|minilm|all] [--windows 16] [--sentences 2000]
        [--threads 2] [--no-imatrix] [--rotate | --rotation-only]

Writes benchmarks/results/gguf_<model>.json and .md (gguf_rotation_<model>.* with
--rotation-only).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, environment, markdown_table, write_results
from devtools.quality import MINILM_DIR, NEWS_FILE, SMOLLM_DIR, news_sentences
from higgs_engine.gguf.convert import convert_checkpoint
from higgs_engine.gguf.evaluate import _log_softmax
from higgs_engine.gguf.llama import LlamaModel, llama_version, quantize_file
from higgs_engine.gguf.plan import (
    allocate_gguf,
    build_gguf_problem,
    gguf_names,
    measure_errors,
    read_gguf,
    tensor_alphas,
)
from higgs_engine.gguf.rotate import rotated_alphas, write_rotated_checkpoint
from higgs_engine.planning.gguf_types import GGUF_MENU

LLAMA_MIXTURES = ("Q3_K_M", "Q4_K_M", "IQ4_XS", "Q5_K_M")
EXTRA_BUDGETS = (3.5, 4.5)
IMATRIX_TOKENS = 16384  # llama-imatrix's usual budget: 32 chunks of 512


def file_figures(paths: list[Path]) -> dict[str, Any]:
    g = read_gguf(paths, quantized=True)
    tensor_bytes = g.fixed_bytes + sum(g.bytes_of.values())
    hist: dict[str, int] = {}
    for t in g.types.values():
        hist[t] = hist.get(t, 0) + 1
    return {
        "file_bytes": sum(p.stat().st_size for p in paths),
        "bits_per_weight": 8.0 * tensor_bytes / g.params_total,
        "params": g.params_total,
        "types": dict(sorted(hist.items())),
    }


# ---------------------------------------------------------------------------------------------
# Importance matrices (the stretch comparison)
# ---------------------------------------------------------------------------------------------


def collect_imatrix(
    checkpoint: Path, gguf_file: Path, text: str, encoder: bool, context: int
) -> dict[str, np.ndarray]:
    """{GGUF tensor name: mean square of each input column} over `IMATRIX_TOKENS` tokens of
    `text`, as llama-imatrix collects it (inputs of every matrix product; a tied head's under
    token_embd.weight)."""
    import torch

    from devtools.quality import load_causal_lm, load_encoder
    from higgs_engine.evaluate import text_windows, tokenize

    model, tok = (load_encoder if encoder else load_causal_lm)(checkpoint)
    model = model.float().eval()
    f = read_gguf(gguf_file)
    present = {t.name for t in f.tensors}
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    mapped = gguf_names(f.arch, f.n_blocks, names)
    for n in names:
        if n not in mapped and n.endswith("lm_head"):
            mapped[n] = "output.weight"
    for n, g in list(mapped.items()):
        if g == "output.weight" and g not in present:
            mapped[n] = "token_embd.weight"  # tied head: llama.cpp multiplies by token_embd
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def hook(name: str) -> Any:
        def fn(_mod: Any, inp: tuple[Any, ...]) -> None:
            x = inp[0].detach().float().reshape(-1, inp[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return fn

    mods = dict(model.named_modules())
    for n, g in mapped.items():
        if g in present:
            hooks.append(mods[n].register_forward_pre_hook(hook(g)))
    ctx = context if not encoder else 128
    wins = text_windows(tokenize(tok, text), ctx, max(1, IMATRIX_TOKENS // ctx))
    with torch.inference_mode():
        for i in range(wins.shape[0]):
            model(input_ids=wins[i : i + 1])
    for h in hooks:
        h.remove()
    return {g: (sums[g] / counts[g]).numpy().astype(np.float32) for g in sums}


# ---------------------------------------------------------------------------------------------
# Evaluation in llama.cpp, every file against the 16-bit one on the same tokens
# ---------------------------------------------------------------------------------------------


def eval_causal(
    base: Path, files: dict[str, Path], text: str, context: int, windows: int, threads: int
) -> dict[str, dict[str, float]]:
    with LlamaModel(base, n_ctx=context, threads=threads) as mb:
        toks = mb.tokenize(text)
        wins = [toks[i * context : (i + 1) * context] for i in range(windows)]
        models = {k: LlamaModel(p, n_ctx=context, threads=threads) for k, p in files.items()}
        try:
            acc = {k: [0.0, 0.0] for k in files}  # nll, kl
            nll_b = 0.0
            count = 0
            for w in wins:
                lb = _log_softmax(mb.logits(w))[:-1]
                nxt = np.asarray(w[1:])
                rows = np.arange(len(nxt))
                nll_b -= float(lb[rows, nxt].sum())
                pb = np.exp(lb)
                for k, m in models.items():
                    lq = _log_softmax(m.logits(w))[:-1]
                    acc[k][0] -= float(lq[rows, nxt].sum())
                    acc[k][1] += float((pb * (lb - lq)).sum())
                count += len(nxt)
        finally:
            for m in models.values():
                m.close()
    out = {"base": {"ppl": float(np.exp(nll_b / count)), "kl": 0.0, "tokens": count}}
    for k, (nll, kl) in acc.items():
        out[k] = {"ppl": float(np.exp(nll / count)), "kl": kl / count, "tokens": count}
    return out


def eval_encoder(
    base: Path, files: dict[str, Path], sentences: list[str], threads: int
) -> dict[str, dict[str, float]]:
    def embed(m: LlamaModel, toks: list[int]) -> np.ndarray:
        v = m.pooled(toks).astype(np.float64)
        return v / max(float(np.linalg.norm(v)), 1e-30)

    with LlamaModel(base, n_ctx=258, embeddings=True, threads=threads) as mb:
        token_lists = [mb.tokenize(s, add_special=True)[:256] for s in sentences]
        ref = [embed(mb, t) for t in token_lists]
    out: dict[str, dict[str, float]] = {"base": {"one_minus_cos": 0.0}}
    for k, p in files.items():
        with LlamaModel(p, n_ctx=258, embeddings=True, threads=threads) as m:
            d = [1.0 - float(embed(m, t) @ r) for t, r in zip(token_lists, ref, strict=True)]
        out[k] = {"one_minus_cos": float(np.mean(d)), "sentences": len(sentences)}
    return out


# ---------------------------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------------------------


def run_model(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from devtools.profiles import obtain
    from higgs_engine.dynamic import profile_stores

    checkpoint = SMOLLM_DIR if name == "smollm2" else MINILM_DIR
    encoder = name == "minilm"
    text = NEWS_FILE.read_text(encoding="utf-8")
    cache = args.profile_cache
    t0 = time.perf_counter()
    base = convert_checkpoint(checkpoint, work / f"{name}-f16.gguf")
    convert_s = time.perf_counter() - t0
    print(f"[{name}] converted in {convert_s:.1f} s", flush=True)

    # profiles are cached under the checkpoint's real path (data/ may be a link)
    prof = obtain(
        checkpoint.resolve(), stores=profile_stores(cache), selfgen_cache=cache, embeddings=True
    )
    profile = prof.profile
    print(f"[{name}] profile {'reused' if prof.reused else 'measured'}", flush=True)

    rows: list[dict[str, Any]] = []
    files: dict[str, Path] = {}

    # llama.cpp's own mixtures, without and with an importance matrix
    imatrix = None
    if not args.no_imatrix and not args.rotation_only:
        t0 = time.perf_counter()
        held_out = _held_out_text(text, name, args)
        imatrix = collect_imatrix(checkpoint, base, held_out, encoder, args.context)
        imatrix_s = time.perf_counter() - t0
        print(f"[{name}] imatrix of {len(imatrix)} tensors in {imatrix_s:.1f} s", flush=True)
    for mix in LLAMA_MIXTURES:
        for with_im in (False, True) if imatrix is not None else (False,):
            label = f"llama.cpp {mix}" + (" + imatrix" if with_im else "")
            dst = work / f"{name}-{mix}{'-im' if with_im else ''}.gguf"
            t0 = time.perf_counter()
            quantize_file(
                base, dst, ftype=mix, imatrix=imatrix if with_im else None, threads=args.threads
            )
            secs = time.perf_counter() - t0
            files[label] = dst
            rows.append(
                {
                    "method": label,
                    "data": "held-out news (imatrix)" if with_im else "none",
                    "quantize_s": secs,
                    **file_figures([dst]),
                }
            )
            print(f"[{name}] {label}: {rows[-1]['bits_per_weight']:.3f} bpw", flush=True)

    # the allocator
    f = read_gguf(base)
    t0 = time.perf_counter()
    t2 = measure_errors(f, GGUF_MENU, threads=args.threads)
    measure_s = time.perf_counter() - t0
    alphas, missing = tensor_alphas(f, profile.alphas())
    problem = build_gguf_problem(f, alphas, t2, GGUF_MENU)
    smallest = (
        problem.min_avg_bits() * f.params_quantizable + 8.0 * f.fixed_bytes
    ) / f.params_total
    budgets = sorted(
        {round(r["bits_per_weight"], 4) for r in rows if "imatrix" not in r["method"]}
        | set(EXTRA_BUDGETS)
    )
    skipped = [b for b in budgets if b < smallest]
    for b in (b for b in budgets if b >= smallest):
        dst = work / f"{name}-higgs-{b:g}.gguf"
        row = allocated_file(f, problem, b, base, dst, args.threads)
        row.update(method=f"allocator {b:g} bpw", target_bits=b, measure_s=measure_s)
        row["quantize_s"] += measure_s
        add_row(name, rows, files, row, dst)

    rotation = None
    if (args.rotate or args.rotation_only) and not encoder:
        rotation = run_rotated(name, checkpoint, f, profile, budgets, args, work, rows, files)

    t0 = time.perf_counter()
    if args.rotation_only:  # llama.cpp's mixtures give the budgets; their quality is elsewhere
        files = {k: v for k, v in files.items() if not k.startswith("llama.cpp")}
    if encoder:
        sents = news_sentences(text, args.sentences)
        measured = eval_encoder(base, files, sents, args.threads)
        metric = "one_minus_cos"
    else:
        measured = eval_causal(base, files, text, args.context, args.windows, args.threads)
        metric = "kl"
    eval_s = time.perf_counter() - t0
    for r in rows:
        r.update(measured.get(r["method"], {}))
        if r.get("predicted") is not None and r.get(metric, 0) > 0:
            r["predicted_over_measured"] = r["predicted"] / r[metric]
    return {
        "model": name,
        "checkpoint": str(checkpoint.relative_to(checkpoint.parents[1])),
        "metric": metric,
        "base": measured["base"],
        "convert_s": convert_s,
        "eval_s": eval_s,
        "profile": {
            "key": profile.key(),
            "config": profile.config,
            "calibration": profile.calibration,
            "seconds": profile.cost.get("seconds"),
            "reused_from_cache": prof.reused is not None,
            "unprofiled_tensors": missing,
        },
        "imatrix_tokens": IMATRIX_TOKENS if imatrix is not None else None,
        "smallest_file_bpw": smallest,
        "budgets_below_smallest": skipped,
        "rows": rows,
        "verdicts": verdicts(rows, metric) if not args.rotation_only else [],
        "rotation": rotation,
        "rotation_table": rotation_table(rows, metric) if rotation is not None else [],
    }


def allocated_file(
    f: Any, problem: Any, budget: float, base: Path, dst: Path, threads: int
) -> dict[str, Any]:
    """The allocator's file at `budget` bits per weight: its row (allocation + llama.cpp's
    quantization seconds, the predicted change, the file's figures)."""
    t0 = time.perf_counter()
    alloc = allocate_gguf(f, problem, GGUF_MENU, avg_bits=budget)
    quantize_file(base, dst, ftype="Q8_0", tensor_types=alloc.types, threads=threads)
    return {
        "data": "none (data-free profile)",
        "quantize_s": time.perf_counter() - t0,
        "predicted": alloc.predicted,
        **file_figures([dst]),
    }


def add_row(
    name: str, rows: list[dict[str, Any]], files: dict[str, Path], row: dict[str, Any], dst: Path
) -> None:
    files[row["method"]] = dst
    rows.append(row)
    print(f"[{name}] {row['method']}: {row['bits_per_weight']:.3f} bpw {row['types']}", flush=True)


def run_rotated(
    name: str,
    checkpoint: Path,
    f: Any,
    profile: Any,
    budgets: list[float],
    args: argparse.Namespace,
    work: Path,
    rows: list[dict[str, Any]],
    files: dict[str, Path],
) -> dict[str, Any]:
    """The allocator on the rotated checkpoint at each budget (same bytes as the unrotated
    file at that budget); appends its rows and files."""
    t0 = time.perf_counter()
    rc = write_rotated_checkpoint(checkpoint, work / f"{name}-rotated")
    rbase = convert_checkpoint(rc.path, work / f"{name}-rot-f16.gguf", outtype=rc.outtype)
    rotate_s = time.perf_counter() - t0
    fr = read_gguf(rbase)
    print(f"[{name}] rotated ({rc.plan}) and converted in {rotate_s:.1f} s", flush=True)
    t0 = time.perf_counter()
    t2 = measure_errors(fr, GGUF_MENU, threads=args.threads)
    measure_s = time.perf_counter() - t0
    alphas, missing = tensor_alphas(
        fr, rotated_alphas(profile.alphas(), untied=rc.added_params > 0)
    )
    problem = build_gguf_problem(fr, alphas, t2, GGUF_MENU)
    smallest = (
        problem.min_avg_bits() * fr.params_quantizable + 8.0 * fr.fixed_bytes
    ) / fr.params_total
    skipped = []
    for b in budgets:
        b_rot = b * f.params_total / fr.params_total  # the same tensor bytes
        if b_rot < smallest:
            skipped.append(b)
            continue
        dst = work / f"{name}-higgs-rot-{b:g}.gguf"
        row = allocated_file(fr, problem, b_rot, rbase, dst, args.threads)
        row.update(
            method=f"allocator {b:g} bpw + rotation",
            target_bits=b,
            rotated_target_bits=b_rot,
            measure_s=measure_s,
            rotate_s=rotate_s,
        )
        row["quantize_s"] += rotate_s + measure_s
        add_row(name, rows, files, row, dst)
    return {
        "plan": rc.plan,
        "added_params": rc.added_params,
        "params_plain": f.params_total,
        "params_rotated": fr.params_total,
        "smallest_file_bpw_rotated": smallest,
        "budgets_below_smallest_rotated": skipped,
        "unprofiled_tensors": missing,
        "rotate_convert_s": rotate_s,
        "measure_s": measure_s,
    }


def rotation_table(rows: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Per budget: the allocator's file without and with rotation, and what `auto` (lower
    predicted change) would have kept."""
    out = []
    by = {r["method"]: r for r in rows}
    for r in rows:
        m = r["method"]
        if not m.startswith("allocator") or m.endswith("+ rotation"):
            continue
        rot = by.get(m + " + rotation")
        if rot is None:
            continue
        auto_rot = rot["predicted"] < r["predicted"]
        better_rot = rot.get(metric, float("inf")) < r.get(metric, float("inf"))
        out.append(
            {
                "target_bits": r["target_bits"],
                "plain_bytes": r["file_bytes"],
                "plain_predicted": r["predicted"],
                "plain_metric": r.get(metric),
                "plain_ppl": r.get("ppl"),
                "rot_bytes": rot["file_bytes"],
                "rot_predicted": rot["predicted"],
                "rot_metric": rot.get(metric),
                "rot_ppl": rot.get("ppl"),
                "auto_choice": "rotated" if auto_rot else "plain",
                "auto_right": auto_rot == better_rot,
            }
        )
    return out


def _held_out_text(text: str, name: str, args: argparse.Namespace) -> str:
    """News text after what the evaluation reads (windows, or sentences)."""
    if name == "smollm2":
        # the evaluation reads the first windows x context tokens (about 4.5 characters each
        # in this text): start past 6 characters per token
        skip = args.windows * args.context * 6
    else:
        sents = news_sentences(text, args.sentences)
        skip = text.find(sents[-1]) + len(sents[-1])
    return text[skip:]


def verdicts(rows: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """For each llama.cpp mixture: the allocator's file at its size, smaller or equal, and
    whether its metric is lower (the targets), also against the imatrix version."""
    out = []
    ours = [r for r in rows if r["method"].startswith("allocator")]
    for r in rows:
        if not r["method"].startswith("llama.cpp") or "imatrix" in r["method"]:
            continue
        fit = [o for o in ours if o["file_bytes"] <= r["file_bytes"]]
        if not fit:
            continue
        best = min(fit, key=lambda o: o[metric])
        im = next((x for x in rows if x["method"] == r["method"] + " + imatrix"), None)
        out.append(
            {
                "llama": r["method"],
                "llama_bytes": r["file_bytes"],
                "llama_metric": r[metric],
                "ours": best["method"],
                "ours_bytes": best["file_bytes"],
                "ours_metric": best[metric],
                "lower": best[metric] < r[metric],
                "imatrix_metric": im[metric] if im else None,
                "lower_than_imatrix": (best[metric] < im[metric]) if im else None,
            }
        )
    return out


def render(res: dict[str, Any]) -> str:
    metric = res["metric"]
    mname = "KL" if metric == "kl" else "1 - cos"
    cols: list[tuple[str, str]] = [
        ("method", "method"),
        ("data", "data"),
        ("bits_per_weight", "bits/weight (llama.cpp)"),
        ("file_mb", "file MB"),
        (metric, mname),
    ]
    if metric == "kl":
        cols.append(("ppl", "perplexity"))
    cols += [
        ("predicted", f"predicted {mname}"),
        ("predicted_over_measured", "predicted / measured"),
        ("quantize_s", "quantize s"),
        ("types_text", "tensor types"),
    ]
    rows = []
    for r in res["rows"]:
        rows.append(
            {
                **r,
                "file_mb": r["file_bytes"] / 1e6,
                "types_text": ", ".join(f"{k} {v}" for k, v in r["types"].items()),
            }
        )
    base = res["base"]
    title = (
        " (rotation comparison; llama.cpp's mixtures give the budgets, not evaluated here)"
        if res.get("rotation_only")
        else ""
    )
    head = (
        f"### GGUF in llama.cpp{title}: {res['model']} ({res['checkpoint']})\n\n"
        f"Every file evaluated in llama.cpp (llama-cpp-python {res['llama_cpp']}) against the "
        f"16-bit GGUF of the same checkpoint; "
        + (
            f"{base['tokens']} tokens of news ({res['windows']} windows of {res['context']}), "
            f"base perplexity {base['ppl']:.3f}."
            if metric == "kl"
            else f"{res['sentences']} news sentences, 1 - cos of mean-pooled embeddings."
        )
        + f" Allocator profile: {res['profile']['calibration']} "
        f"({'cached' if res['profile']['reused_from_cache'] else 'measured'}; "
        f"{res['profile']['seconds']:.0f} s when measured). "
        + (
            f"imatrix: {res['imatrix_tokens']} held-out news tokens."
            if res["imatrix_tokens"]
            else "No imatrix."
        )
        + (
            f" Budgets below the smallest file the menu allows "
            f"({res['smallest_file_bpw']:.3f} bits per weight: every tensor in its cheapest "
            f"type) were not run: {res['budgets_below_smallest']}."
            if res["budgets_below_smallest"]
            else ""
        )
        + "\n"
    )
    v = [
        {
            "llama": x["llama"],
            "llama_mb": x["llama_bytes"] / 1e6,
            "llama_metric": x["llama_metric"],
            "ours": x["ours"],
            "ours_mb": x["ours_bytes"] / 1e6,
            "ours_metric": x["ours_metric"],
            "lower": x["lower"],
            "imatrix_metric": x["imatrix_metric"],
            "lower_than_imatrix": x["lower_than_imatrix"],
        }
        for x in res["verdicts"]
    ]
    vtab = markdown_table(
        v,
        [
            ("llama", "llama.cpp file"),
            ("llama_mb", "MB"),
            ("llama_metric", mname),
            ("ours", "allocator (same or smaller file)"),
            ("ours_mb", "MB"),
            ("ours_metric", mname),
            ("lower", f"lower {mname}"),
            ("imatrix_metric", f"{mname} with imatrix"),
            ("lower_than_imatrix", "lower than imatrix"),
        ],
    )
    out = head + "\n" + markdown_table(rows, cols) + "\n"
    if res["verdicts"]:
        out += "\nTargets:\n\n" + vtab + "\n"
    if res.get("rotation_table"):
        out += "\n" + render_rotation(res)
    return out


def render_rotation(res: dict[str, Any]) -> str:
    mname = "KL" if res["metric"] == "kl" else "1 - cos"
    rot = res["rotation"]
    rows = [
        {**x, "plain_mb": x["plain_bytes"] / 1e6, "rot_mb": x["rot_bytes"] / 1e6}
        for x in res["rotation_table"]
    ]
    head = (
        f"Rotation ({rot['plan']['rotation']}, per-head V/O: {rot['plan']['per_head_vo']}, "
        f"head untied: {rot['plan']['untied_head']}, +{rot['added_params']} parameters); "
        "at each budget B the rotated file gets the unrotated file's tensor-byte budget, "
        "B x (unrotated parameters) / 8, so its own bits per weight are lower; both files are "
        "evaluated against the unrotated 16-bit file. auto keeps the file with the lower "
        "predicted change."
        + (
            " Budgets below the smallest rotated file "
            f"({rot['smallest_file_bpw_rotated'] * rot['params_rotated'] / rot['params_plain']:.3f}"
            f" bits per unrotated weight) were not run rotated: "
            f"{rot['budgets_below_smallest_rotated']}."
            if rot["budgets_below_smallest_rotated"]
            else ""
        )
        + "\n\n"
    )
    return (
        "Rotation:\n\n"
        + head
        + markdown_table(
            rows,
            [
                ("target_bits", "budget (bits/weight, unrotated)"),
                ("plain_mb", "MB"),
                ("plain_predicted", f"predicted {mname}"),
                ("plain_metric", mname),
                ("plain_ppl", "perplexity"),
                ("rot_mb", "rotated MB"),
                ("rot_predicted", f"rotated predicted {mname}"),
                ("rot_metric", f"rotated {mname}"),
                ("rot_ppl", "rotated perplexity"),
                ("auto_choice", "auto keeps"),
                ("auto_right", "auto right"),
            ],
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=["smollm2", "minilm", "all"], default="all")
    ap.add_argument("--windows", type=int, default=16, help="SmolLM2 evaluation windows")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=2000, help="MiniLM evaluation sentences")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-imatrix", action="store_true", help="skip the imatrix comparison")
    ap.add_argument(
        "--rotate", action="store_true", help="add the allocator on the rotated checkpoint"
    )
    ap.add_argument(
        "--rotation-only",
        action="store_true",
        help="only the rotation comparison (no imatrix, llama.cpp mixtures not evaluated); "
        "writes gguf_rotation_<model>.*",
    )
    ap.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="measure nothing: rewrite the .md beside a results JSON this script wrote",
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument(
        "--profile-cache",
        type=Path,
        default=None,
        help="the engine's profile cache (default: the CLI's, ~/.cache/higgs/profiles)",
    )
    args = ap.parse_args(argv)
    if args.render is not None:
        res = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(render(res).rstrip() + "\n")
        return 0
    if args.profile_cache is None:
        from higgs_cli.common import default_profile_cache

        args.profile_cache = default_profile_cache()
    import torch

    torch.set_num_threads(args.threads)
    models = ["smollm2", "minilm"] if args.model == "all" else [args.model]
    for name in models:
        with tempfile.TemporaryDirectory(prefix=f"gguf-bench-{name}-") as tmp:
            res = run_model(name, args, Path(tmp))
        res.update(
            environment=environment(),
            llama_cpp=llama_version(),
            windows=args.windows,
            context=args.context,
            sentences=args.sentences,
            rotation_only=args.rotation_only,
        )
        md = render(res)
        stem = f"gguf_rotation_{name}" if args.rotation_only else f"gguf_{name}"
        write_results(stem, res, md, args.out_dir)
        print(md, flush=True)
        print(json.dumps(res["verdicts"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
