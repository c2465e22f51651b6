"""Where the data-free profile's time goes on SmolLM2-135M: generating text vs Fisher passes.

The default data-free profile samples `windows` documents of `context` tokens from the model
itself (higgs_engine.selfgen, cached per model revision) and then runs one Fisher forward and
`fisher_samples` backward passes per window (higgs_engine.profile). This times both stages the
way `higgs quantize --avg-bits` runs them, with an empty temporary cache, in one process:

- generation through the reference path (`self_generated_tokens_reference`, one incremental
  step per token, 8 documents at a time, full sort per step: the path before) and through the
  default path (`self_generated_tokens`, all documents in one batch, top-k nucleus),
  alternated `--repeats` times, with their ratio;
- the Fisher passes over the generated windows (`compute_profile`).

Fewer documents / tokens than the default (16 x 512) keep a run short: the flags say what was
used and the results record it. With a greedy nucleus (top_p 1e-9) both generation paths are
checked to give the same tokens (sampled text differs: a generator per document).

Writes benchmarks/results/profile_cost.json and .md.

    python -m benchmarks.profile_cost [--count 16] [--length 128] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import environment, fmt, markdown_table, write_results
from devtools.quality import SMOLLM_DIR
from higgs_engine.dynamic import calibration_windows, profile_config_for
from higgs_engine.model_loading import load_float_model
from higgs_engine.model_structure import quantizable_layers
from higgs_engine.planning.profile import DEFAULT_PROFILE, ProfileRequest
from higgs_engine.profile import ProfileRun, compute_profile
from higgs_engine.selfgen import (
    SelfGenConfig,
    self_generated_tokens,
    self_generated_tokens_reference,
)
from higgs_engine.sources import resolve_model


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=16, help="documents (default profile: 16)")
    ap.add_argument("--length", type=int, default=128, help="tokens each (default profile: 512)")
    ap.add_argument("--repeats", type=int, default=2, help="alternated generation runs per path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="profile_cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_float_model(SMOLLM_DIR)
    sg = SelfGenConfig(count=args.count, length=args.length, seed=0)
    old = replace(sg, batch=8)  # the reference path as the profile ran it before
    runs: dict[str, list[float]] = {"reference": [], "default": []}
    for _ in range(args.repeats):
        runs["reference"].append(timed(lambda: self_generated_tokens_reference(model, tok, old))[1])
        runs["default"].append(timed(lambda: self_generated_tokens(model, tok, sg))[1])
    # greedy (a nucleus of one token): both paths must give the same tokens
    greedy = replace(sg, length=min(args.length, 32), top_p=1e-9)
    same = bool(
        torch.equal(
            self_generated_tokens_reference(model, tok, replace(greedy, batch=8)),
            self_generated_tokens(model, tok, greedy),
        )
    )

    # The profile as the CLI runs it: windows from an empty cache, then the Fisher passes.
    config = replace(
        profile_config_for(resolve_model(SMOLLM_DIR), DEFAULT_PROFILE),
        windows=args.count,
        context=args.length,
    )
    names = quantizable_layers(SMOLLM_DIR, ())
    with tempfile.TemporaryDirectory() as cache:
        windows, gen_sec = timed(
            lambda: calibration_windows(
                model, tok, None, config, revision="bench", cache_dir=Path(cache)
            )
        )
    _, fisher_sec = timed(
        lambda: compute_profile(
            model,
            ProfileRun(ProfileRequest("smollm2", "bench", "self", config, tuple(names))),
            windows,
        )
    )
    ref = statistics.median(runs["reference"])
    new = statistics.median(runs["default"])
    best = min(runs["reference"]) / min(runs["default"])
    rows = [
        {
            "stage": "generating (reference path, batch 8)",
            "seconds": ref,
            "share": None,
            "unit": f"{args.count} documents x {args.length} tokens",
        },
        {
            "stage": "generating (default path, batch 16)",
            "seconds": new,
            "share": None,
            "unit": f"{args.count} documents x {args.length} tokens",
        },
        {
            "stage": "generating (in the profile, empty cache)",
            "seconds": gen_sec,
            "share": gen_sec / (gen_sec + fisher_sec),
            "unit": f"{args.count} documents",
        },
        {
            "stage": "profiling (Fisher passes)",
            "seconds": fisher_sec,
            "share": fisher_sec / (gen_sec + fisher_sec),
            "unit": f"{args.count} windows x (1 forward + {config.fisher_samples} backward)",
        },
    ]
    env = environment()
    payload: dict[str, Any] = {
        "environment": env,
        "settings": {
            "count": args.count,
            "length": args.length,
            "repeats": args.repeats,
            "threads": args.threads,
            "fisher_samples": config.fisher_samples,
            "selfgen": sg.to_dict(),
        },
        "generation_runs_seconds": runs,
        "reference_over_default": ref / new,
        "reference_over_default_fastest_runs": best,
        "same_tokens": same,
        "rows": rows,
    }
    md = "\n\n".join(
        [
            f"# Data-free profile cost on SmolLM2-135M ({args.count} documents x "
            f"{args.length} tokens; the default profile uses 16 x 512)",
            markdown_table(
                rows,
                [("stage", "stage"), ("seconds", "seconds"), ("share", "share"), ("unit", "of")],
            ),
            f"Generation, reference / default path (median of {args.repeats} alternated runs "
            f"each, one process): {fmt(ref / new, 3)}x (fastest runs: {fmt(best, 3)}x); same "
            f"tokens when greedy: {fmt(same)}.",
            f"Runs (s): reference {[round(x, 1) for x in runs['reference']]}, "
            f"default {[round(x, 1) for x in runs['default']]}. "
            f"Threads {args.threads}; load average "
            f"{env['load_average_1_5_15']} (shared machine).",
        ]
    )
    write_results(args.name, payload, md)
    print(md)


if __name__ == "__main__":
    main()
