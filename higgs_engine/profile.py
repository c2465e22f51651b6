"""A model's sensitivity profile: alpha_l such that metric change ~= sum_l alpha_l * t_l^2.

Two ways to measure it (docs/algorithm.md section 4):

- Noise injection (the paper's way, `method="noise"`): perturb ONE layer at a time,
  W <- W + sqrt(t^2) * ||W||_F / sqrt(numel) * N(0, 1), at two or more levels t^2, measure the
  metric change on calibration tokens, and fit alpha through the origin by least squares:
  alpha = sum(t2 * d) / sum(t2^2). Cost: layers x levels evaluations.
- Fisher (`method="fisher"`, fast): for Gaussian noise of per-entry variance
  s^2 = t^2 ||W||^2 / numel, the second-order expansion of the per-token KL from the base gives
      E[KL] ~= 0.5 * s^2 * tr(F_l)   =>   alpha_l ~= 0.5 * ||W_l||^2 / numel_l * tr(F_l),
  with F_l the per-token Fisher information of layer l's weights. tr(F_l) is estimated from a
  few backward passes: sample labels y_t from the model's own next-token distribution, take
  G = grad of sum_t log p(y_t | x_<t); the per-token gradients have mean zero and are
  independent given the inputs, so E||G||^2 = sum_t E||g_t||^2 = T * tr(F_l). The expected
  NLL increase under zero-mean noise has the same form with the Hessian, which the Fisher
  approximates (Gauss-Newton), so the same alphas serve the perplexity metric.

Metrics: "kl" = mean KL(base || perturbed) per token (works on random tokens: data-free);
"ppl" = relative perplexity increase ppl/ppl_base - 1 on calibration text; "cos" (models without
a causal LM head, e.g. BERT sentence encoders) = mean over windows of 1 - cos(f, f') of the
mean-pooled final hidden state f (what a sentence-embedding model outputs).

For "cos" the Fisher method is its Gauss-Newton analogue. With u = f / |f| and the perturbed
output f + d, 1 - cos = 0.5 |(I - u u^T) d|^2 / |f|^2 + O(|d|^3): the first-order term vanishes
at zero error, and d = J_l e + O(e^2), so for noise e of per-entry variance s^2
    E[1 - cos] ~= 0.5 s^2 |P J_l|_F^2 / |f|^2,   P = I - u u^T.
|P J_l|_F^2 / |f|^2 = E|J_l^T v|^2 for v = P z / |f|, z ~ N(0, I): one backward pass of v . f
per draw gives one sample (draws of different windows are independent, so they share a pass).

The model is loaded once, in float32, and weights are perturbed and restored in place. The
noise of (layer i, level k) comes from its own generator seeded by (seed, i, k), so a resumed
run gives the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.planning.profile import (
    LayerAlpha,
    Profile,
    ProfileConfig,
    ProfileRequest,
    profile_key,
    resolve_profile_config,
)
from higgs_engine.progress import ProgressCallback, report

if TYPE_CHECKING:
    import torch
    from torch import nn

# ---------------------------------------------------------------------------------------------
# Calibration tokens and metric evaluation
# ---------------------------------------------------------------------------------------------


def random_windows(vocab_size: int, config: ProfileConfig) -> torch.Tensor:
    """Uniform random token ids, (windows, context) int64, from the profile's seed (data-free)."""
    import torch

    g = torch.Generator().manual_seed(config.seed)
    return torch.randint(0, vocab_size, (config.windows, config.context), generator=g)


def frame_windows(windows: torch.Tensor, first: int | None, last: int | None) -> torch.Tensor:
    """`windows` with its first / last column set to `first` / `last` (an encoder's CLS and SEP;
    None leaves the column as it is)."""
    out = windows.clone()
    if first is not None:
        out[:, 0] = first
    if last is not None:
        out[:, -1] = last
    return out


class BlockReplay:
    """Forward passes of one model over fixed windows, restarting at a block when it can.

    Perturbing a layer in block k leaves blocks 0..k-1 unchanged, so their output is cached once
    per window and only blocks k.. (plus, for a causal LM, the final norm and head) are rerun:
    about half the work of a full forward on average. The replay path is checked against the
    full forward when the runner is built and is not used if the two disagree.

    `kind` "causal": the output of a window is its next-token logits (context - 1, vocab).
    `kind` "encoder": the mean-pooled final hidden state of the model's base model (d,).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor, kind: str = "causal") -> None:
        import torch

        self.model = model
        self.kind = kind
        self.windows = windows
        self.forwards = 0
        self.blocks: list[nn.Module] | None = None
        self.block_prefix: list[str] = []
        self.norm: nn.Module | None = None
        self.head: nn.Module | None = None
        self._inputs: list[list[tuple[Any, Any, dict[str, Any]]]] = []
        found = self._find_blocks(model) if kind == "causal" else self._find_encoder_blocks(model)
        if found is not None:
            self.block_prefix, self.blocks, self.norm, self.head = found
            self._capture()
            full = self._full_output(0)
            replay = self._replay_output(0, 0)
            if not torch.allclose(full, replay, rtol=1e-4, atol=1e-4):
                self.blocks = None
                self._inputs = []

    @staticmethod
    def _find_blocks(
        model: nn.Module,
    ) -> tuple[list[str], list[nn.Module], nn.Module | None, nn.Module | None] | None:
        from torch import nn

        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        norm = getattr(base, "norm", None)
        head = getattr(model, "lm_head", None)
        if not isinstance(layers, nn.ModuleList) or norm is None or head is None:
            return None
        names = {id(m): n for n, m in model.named_modules()}
        prefix = [names[id(b)] + "." for b in layers]
        return prefix, list(layers), norm, head

    @staticmethod
    def _find_encoder_blocks(
        model: nn.Module,
    ) -> tuple[list[str], list[nn.Module], nn.Module | None, nn.Module | None] | None:
        """BERT-style encoders: base_model.encoder.layer (BERT, RoBERTa, ...) or
        base_model.transformer.layer (DistilBERT); the last block's output is the hidden state
        (checked against the full forward)."""
        from torch import nn

        base = getattr(model, "base_model", model)
        for path in ("encoder.layer", "transformer.layer", "layers"):
            obj: Any = base
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, nn.ModuleList) and len(obj) > 0:
                names = {id(m): n for n, m in model.named_modules()}
                return [names[id(b)] + "." for b in obj], list(obj), None, None
        return None

    def _forward(self, i: int) -> Any:
        import torch

        window = self.windows[i : i + 1]
        if self.kind == "causal":
            return self.model(input_ids=window, use_cache=False)
        base = getattr(self.model, "base_model", self.model)
        return base(input_ids=window, attention_mask=torch.ones_like(window))

    def _capture(self) -> None:
        import torch

        assert self.blocks is not None
        for i in range(self.windows.shape[0]):
            seen: list[tuple[Any, Any, dict[str, Any]]] = []

            def hook(
                mod: nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                seen: list[Any] = seen,
            ) -> None:
                if args:
                    seen.append((args[0].detach(), args[1:], dict(kwargs)))
                else:  # the hidden state passed by keyword
                    kw = dict(kwargs)
                    seen.append((kw.pop("hidden_states").detach(), (), kw))

            handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in self.blocks]
            try:
                with torch.no_grad():
                    self._forward(i)
            finally:
                for h in handles:
                    h.remove()
            self.forwards += 1
            self._inputs.append(seen)

    def block_of(self, layer_name: str) -> int:
        for k, pre in enumerate(self.block_prefix):
            if layer_name.startswith(pre):
                return k
        return -1

    def _full_output(self, i: int) -> torch.Tensor:
        import torch

        with torch.no_grad():
            out = self._forward(i)
        self.forwards += 1
        if self.kind == "causal":
            logits: torch.Tensor = out.logits[0, :-1].float()  # (context - 1, vocab)
            return logits
        hidden: torch.Tensor = out.last_hidden_state[0].float().mean(0)  # (d,)
        return hidden

    def _replay_output(self, i: int, start: int) -> torch.Tensor:
        import torch

        assert self.blocks is not None
        h, _args, _kwargs = self._inputs[i][start]
        with torch.no_grad():
            for block, (_, a, kw) in zip(self.blocks[start:], self._inputs[i][start:], strict=True):
                out = block(h, *a, **kw)
                h = out[0] if isinstance(out, tuple) else out
            self.forwards += 1
            if self.kind == "causal":
                assert self.head is not None and self.norm is not None
                logits: torch.Tensor = self.head(self.norm(h))[0, :-1].float()
                return logits
            hidden: torch.Tensor = h[0].float().mean(0)
            return hidden

    def output(self, i: int, layer_name: str | None = None) -> torch.Tensor:
        """Window i's output (logits or pooled hidden state), rerunning only what `layer_name`
        changes."""
        k = (
            self.block_of(layer_name)
            if (layer_name is not None and self.blocks is not None)
            else -1
        )
        return self._replay_output(i, k) if k >= 0 else self._full_output(i)

    def log_probs(self, i: int, layer_name: str | None = None) -> torch.Tensor:
        """(context - 1, vocab) float32 log-probs of window i (causal LMs)."""
        import torch

        return torch.log_softmax(self.output(i, layer_name), dim=-1)


def _scores(lp: torch.Tensor, targets: torch.Tensor, base_lp: torch.Tensor) -> tuple[float, float]:
    """(sum NLL, sum KL(base || lp)) over one window, float64."""
    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().sum().item()
    kl = (base_lp.exp() * (base_lp - lp)).sum(-1).double().sum().item()
    return nll, kl


def one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cos(a, b) of two vectors, float64."""
    import torch

    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0)
    return float(1.0 - cos.clamp(-1.0, 1.0))


class _Metric:
    """The profile's metric of the model's current weights, relative to the base weights."""

    def __init__(self, runner: BlockReplay, metric: str) -> None:
        self.runner = runner
        self.metric = metric
        w = runner.windows
        n = int(w.shape[0])
        if metric == "cos":
            self.base_out = [runner.output(i) for i in range(n)]
            norm = math.fsum(float(f.double().norm()) for f in self.base_out) / n
            self.base = {"embedding_norm": norm}
            return
        self.tokens = n * (int(w.shape[1]) - 1)
        self.base_lp = [runner.log_probs(i) for i in range(n)]
        nll = sum(_scores(lp, w[i, 1:], lp)[0] for i, lp in enumerate(self.base_lp))
        self.base_ppl = math.exp(nll / self.tokens)
        self.base = {"ppl": self.base_ppl}

    def change(self, layer_name: str) -> float:
        w = self.runner.windows
        if self.metric == "cos":
            d = [
                one_minus_cos(self.runner.output(i, layer_name), self.base_out[i])
                for i in range(w.shape[0])
            ]
            return math.fsum(d) / len(d)
        nll = kl = 0.0
        for i in range(w.shape[0]):
            a, b = _scores(self.runner.log_probs(i, layer_name), w[i, 1:], self.base_lp[i])
            nll += a
            kl += b
        if self.metric == "kl":
            return kl / self.tokens
        return math.exp(nll / self.tokens) / self.base_ppl - 1.0


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------


def fit_through_origin(t2: Sequence[float], delta: Sequence[float]) -> float:
    """Least-squares slope of delta = alpha * t2 with no intercept."""
    den = math.fsum(x * x for x in t2)
    if den <= 0:
        raise InvalidConfigError("noise levels must be positive")
    return math.fsum(x * y for x, y in zip(t2, delta, strict=True)) / den


def _weights(model: nn.Module, names: Sequence[str]) -> list[torch.Tensor]:
    """The (out, in) weight parameter of each named linear layer."""
    import torch

    mods = dict(model.named_modules())
    ws = [getattr(mods.get(n), "weight", None) for n in names]
    missing = [
        n for n, w in zip(names, ws, strict=True) if not isinstance(w, torch.Tensor) or w.dim() != 2
    ]
    if missing:
        raise InvalidConfigError(f"the model has no linear layer(s) {missing[:5]} to profile")
    return [w for w in ws if isinstance(w, torch.Tensor)]


def _noise_seed(seed: int, layer: int, level: int) -> int:
    return (seed * 1_000_003 + layer * 7919 + level) % (2**63 - 1)


def noise_profile_layers(
    model: nn.Module,
    names: Sequence[str],
    windows: torch.Tensor,
    config: ProfileConfig,
    *,
    done: Sequence[LayerAlpha] = (),
    on_layer: Callable[[list[LayerAlpha], int], None] | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[list[LayerAlpha], dict[str, float], int]:
    """Noise-injection alphas for `names` (resuming after the layers in `done`).

    Returns (layers, base figures, forward passes). `on_layer(layers_so_far, forwards)` is
    called after every layer so the caller can save a partial profile.
    """
    import torch

    model.eval()
    runner = BlockReplay(model, windows, "encoder" if config.metric == "cos" else "causal")
    metric = _Metric(runner, config.metric)
    weights = _weights(model, names)
    out = list(done)
    if [la.name for la in out] != list(names[: len(out)]):
        raise InvalidConfigError("the partial profile's layers do not match the model's layers")
    report(progress, "probing", len(out), len(names))
    for idx in range(len(out), len(names)):
        w = weights[idx].data  # (out, in), perturbed in place and restored
        orig = w.clone()
        numel = w.numel()
        norm2 = float(orig.double().pow(2).sum())
        points: list[list[float]] = []
        try:
            for k, t2 in enumerate(config.levels):
                g = torch.Generator().manual_seed(_noise_seed(config.seed, idx, k))
                noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
                w.add_(noise.to(w.device, w.dtype), alpha=math.sqrt(t2 * norm2 / numel))
                points.append([t2, metric.change(names[idx])])
                w.copy_(orig)
        finally:
            w.copy_(orig)
        alpha = fit_through_origin([p[0] for p in points], [p[1] for p in points])
        out.append(LayerAlpha(names[idx], [int(w.shape[0]), int(w.shape[1])], alpha, points))
        if on_layer is not None:
            on_layer(out, runner.forwards)
        report(progress, "probing", idx + 1, len(names))
    return out, metric.base, runner.forwards


def fisher_profile_layers(
    model: nn.Module,
    names: Sequence[str],
    windows: torch.Tensor,
    config: ProfileConfig,
    *,
    progress: ProgressCallback | None = None,
) -> tuple[list[LayerAlpha], dict[str, float], int, int]:
    """Fisher-trace alphas: returns (layers, base figures, forward passes, backward passes).
    For the "cos" metric, the Gauss-Newton estimate (module docstring)."""
    import torch

    if config.metric == "cos":
        return gauss_newton_cos_layers(model, names, windows, config, progress=progress)
    model.eval()
    params = _weights(model, names)
    flags = [p.requires_grad for p in params]
    sq = [0.0] * len(names)  # sum over windows and draws of ||G_l||^2
    tokens = int(windows.shape[0]) * (int(windows.shape[1]) - 1)
    g = torch.Generator().manual_seed(config.seed)
    nll = 0.0
    forwards = backwards = 0
    total = int(windows.shape[0])  # progress: windows done (each 1 forward + draws backward)
    report(progress, "profiling", 0, total)
    try:
        for p in params:
            p.requires_grad_(True)
        for i in range(windows.shape[0]):
            with torch.enable_grad():
                logits = model(input_ids=windows[i : i + 1], use_cache=False).logits[0, :-1].float()
                lp = torch.log_softmax(logits, dim=-1)  # (T, vocab)
                forwards += 1
                nll += -float(lp.detach().gather(-1, windows[i, 1:].unsqueeze(-1)).sum())
                # labels drawn on the CPU with the CPU generator, wherever the model runs
                probs = lp.detach().exp().cpu()
                for s in range(config.fisher_samples):
                    y = torch.multinomial(probs, 1, generator=g).to(lp.device)
                    # (T, 1) labels drawn from the model
                    grads = torch.autograd.grad(
                        lp.gather(-1, y).sum(), params, retain_graph=s < config.fisher_samples - 1
                    )
                    backwards += 1
                    for li, gr in enumerate(grads):
                        sq[li] += float(gr.double().pow(2).sum())
            report(progress, "profiling", i + 1, total)
    finally:
        for p, f in zip(params, flags, strict=True):
            p.requires_grad_(f)
    out = []
    for li, (name, p) in enumerate(zip(names, params, strict=True)):
        w = p.detach()
        tr_f = sq[li] / (config.fisher_samples * tokens)  # per-token Fisher trace
        alpha = 0.5 * float(w.double().pow(2).sum()) / w.numel() * tr_f
        # For metric "ppl" the same figure holds: ppl/ppl_base - 1 ~= NLL increase when small.
        out.append(LayerAlpha(name, [int(w.shape[0]), int(w.shape[1])], alpha, [], tr_f))
    return out, {"ppl": math.exp(nll / tokens)}, forwards, backwards


def gauss_newton_cos_layers(
    model: nn.Module,
    names: Sequence[str],
    windows: torch.Tensor,
    config: ProfileConfig,
    *,
    progress: ProgressCallback | None = None,
) -> tuple[list[LayerAlpha], dict[str, float], int, int]:
    """Alphas of the "cos" metric from E|J_l^T v|^2 with random output directions v = P z / |f|
    (module docstring): one forward with gradients over all windows, `fisher_samples` backward
    passes. Returns (layers, base figures, forward passes, backward passes)."""
    import torch

    model.eval()
    base = getattr(model, "base_model", model)
    params = _weights(model, names)
    flags = [p.requires_grad for p in params]
    n = int(windows.shape[0])
    sq = [0.0] * len(names)  # sum over draws of ||sum_i J_i^T v_i||^2
    g = torch.Generator().manual_seed(config.seed)
    # progress in windows, as the Fisher passes count: all of them go through at once
    report(progress, "profiling", 0, n)
    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            hidden = base(input_ids=windows, attention_mask=torch.ones_like(windows))
            f = hidden.last_hidden_state.float().mean(1)  # (windows, d)
            fd = f.detach().double()
            norms = fd.norm(dim=-1, keepdim=True).clamp(min=1e-12)
            u = fd / norms
            for s in range(config.fisher_samples):
                z = torch.randn(fd.shape, generator=g, dtype=torch.float64).to(fd.device)
                v = (z - (z * u).sum(-1, keepdim=True) * u) / norms  # P z / |f|, per window
                grads = torch.autograd.grad(
                    (f * v.to(f.dtype)).sum(),
                    params,
                    retain_graph=s < config.fisher_samples - 1,
                    allow_unused=True,
                )
                for li, gr in enumerate(grads):
                    if gr is not None:  # None: the layer does not reach the hidden state
                        sq[li] += float(gr.double().pow(2).sum())
                report(progress, "profiling", 0, n)  # between draws: a cancel stops here
    finally:
        for p, fl in zip(params, flags, strict=True):
            p.requires_grad_(fl)
    out = []
    for li, (name, p) in enumerate(zip(names, params, strict=True)):
        w = p.detach()
        tr_gn = sq[li] / (config.fisher_samples * n)  # mean over windows of |P J_l|^2 / |f|^2
        alpha = 0.5 * float(w.double().pow(2).sum()) / w.numel() * tr_gn
        out.append(LayerAlpha(name, [int(w.shape[0]), int(w.shape[1])], alpha, [], tr_gn))
    report(progress, "profiling", n, n)
    base_fig = {"embedding_norm": float(norms.mean())}
    return out, base_fig, 1, config.fisher_samples


def _resumable(old: Profile, names: Sequence[str], config: ProfileConfig) -> bool:
    """Whether measuring `names` can go on from `old` (same key): a partial profile (as
    before), or a complete one whose layers are the first of `names` (e.g. the linear layers'
    profile when the embedding and head are asked for too) under the noise method, which
    measures layer by layer; anything else is measured from the start."""
    if not old.complete:
        return True
    done = [la.name for la in old.layers]
    return config.method == "noise" and done == list(names[: len(done)])


@dataclass(frozen=True)
class ProfileRun:
    """What a measurement is of and where it goes: `request` (the model's id and revision,
    the calibration id, the config, the layers to measure), `partial_path` (a partial
    profile there is resumed and rewritten after every layer; None: no resuming) and
    `progress`."""

    request: ProfileRequest
    partial_path: Path | None = None
    progress: ProgressCallback | None = None


def compute_profile(model: nn.Module, run: ProfileRun, windows: torch.Tensor) -> Profile:
    """Measure a profile of `model` (loaded once, float32) over `windows` for run.request.

    With run.partial_path, a partial profile with the same key found there is resumed, and
    the profile is rewritten there after every layer (noise method), so an interrupted run
    continues where it stopped.
    """
    from higgs_engine.model_structure import max_positions, model_kind

    req, partial_path = run.request, run.partial_path
    names = list(req.layers)
    cfg: Any = model.config
    config = resolve_profile_config(req.config, model_kind(cfg), max_positions(cfg))
    key = profile_key(req.model, req.revision, req.calibration, config)
    prof = Profile(
        model=req.model,
        revision=req.revision,
        calibration=req.calibration,
        config=config.to_dict(),
        layers=[],
        base={},
        cost={"forward_passes": 0, "backward_passes": 0, "seconds": 0.0},
        complete=False,
    )
    if partial_path is not None and Path(partial_path).is_file():
        try:
            old = Profile.load(partial_path)
        except CorruptCheckpointError:
            old = None
        if old is not None and old.key() == key:
            if old.complete and set(names) <= {la.name for la in old.layers}:
                return old
            if _resumable(old, names, config):
                old.complete = False  # a complete profile of fewer layers is extended
                prof = old
    return _measure(model, prof, config, windows, run)


def _measure(
    model: nn.Module, prof: Profile, config: ProfileConfig, windows: torch.Tensor, run: ProfileRun
) -> Profile:
    """compute_profile's measurement into `prof` (empty, or a partial one resumed)."""
    partial_path, progress = run.partial_path, run.progress
    names = list(run.request.layers)
    start = time.perf_counter()
    spent = float(prof.cost.get("seconds", 0.0))
    fw0 = int(prof.cost.get("forward_passes", 0))
    if config.method == "noise":

        def save(layers: list[LayerAlpha], forwards: int) -> None:
            prof.layers = list(layers)
            prof.cost = {
                "forward_passes": fw0 + forwards,
                "backward_passes": 0,
                "seconds": spent + time.perf_counter() - start,
            }
            if partial_path is not None:
                prof.save(partial_path)

        layers, base_fig, forwards = noise_profile_layers(
            model, names, windows, config, done=prof.layers, on_layer=save, progress=progress
        )
        save(layers, forwards)
    else:
        layers, base_fig, forwards, backwards = fisher_profile_layers(
            model, names, windows, config, progress=progress
        )
        prof.layers = layers
        prof.cost = {
            "forward_passes": forwards,
            "backward_passes": backwards,
            "seconds": time.perf_counter() - start,
        }
    prof.base = base_fig
    prof.complete = True
    if partial_path is not None:
        prof.save(partial_path)
    return prof
