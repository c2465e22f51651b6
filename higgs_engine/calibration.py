"""Calibration inputs for calibrated HIGGS: a block-by-block pass over calibration text.

The model is built with its parameters on the meta device; only the tensors in front of the
transformer blocks (embeddings) and ONE block at a time are read from the checkpoint, in
float32. For block k:

1. run it (float weights) on the cached hidden states of every calibration window, with a
   forward hook on each linear layer accumulating the Hessian 2 X^T X / tokens of its input:
   one accumulator per distinct input (q/k/v share one, gate/up share one);
2. quantize its linear layers with those Hessians (the caller's `quantize` function: GPTQ with
   HIGGS grids in the pipeline, GPTQ int4 in the benchmarks) and load W_hat into the block;
3. re-run the block with the quantized weights: its outputs are block k+1's inputs, so later
   layers see the error of earlier ones, as GPTQ does;
4. put the block's parameters back on the meta device.

Peak memory: the embeddings, one block in float32, its Hessians (in^2 float64 per distinct
input) and the hidden states of the calibration tokens; never the whole model in float32.

The keyword arguments every block receives (rotary cos/sin, masks, which differ per block on
Gemma2) are recorded once per window by a forward over the embeddings with every block
replaced by a pass-through, before any block is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError, UnsupportedModelError
from higgs_engine.progress import ProgressCallback, report

if TYPE_CHECKING:
    import torch
    from torch import nn

    from higgs_engine.model_structure import LayerSpec
    from higgs_engine.safetensors_stream import CheckpointReader
    from higgs_engine.sources import ResolvedModel

__all__ = [
    "DEFAULT_CALIBRATION_TOKENS",
    "DEFAULT_CONTEXT",
    "MAX_CALIBRATION_BYTES",
    "Calibration",
    "CalibrationRequest",
    "calibration_from_text",
    "check_calibration_text",
    "gptq_entry",
    "prepare_calibration",
    "read_calibration_file",
    "run_calibrated",
    "self_calibration",
]

DEFAULT_CALIBRATION_TOKENS = 8192
DEFAULT_CONTEXT = 512
# Largest calibration text accepted (bytes of UTF-8): far more than any token budget needs.
MAX_CALIBRATION_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Calibration:
    """Token windows (w, context) int64 cut from a calibration text, and where they came from."""

    windows: torch.Tensor
    sha256: str  # of the text's UTF-8 bytes
    source: str  # "file", "self", "upload:<id>", ... (recorded in the report)

    @property
    def tokens(self) -> int:
        return int(self.windows.numel())

    @property
    def context(self) -> int:
        return int(self.windows.shape[1])

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "sha256": self.sha256,
            "tokens": self.tokens,
            "windows": int(self.windows.shape[0]),
            "context": self.context,
        }


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_calibration_text(data: bytes, field: str = "calibration") -> str:
    """Decode uploaded / read calibration bytes; InvalidConfigError naming `field` when they are
    empty, too large, not UTF-8 or binary (NUL bytes)."""
    if len(data) > MAX_CALIBRATION_BYTES:
        raise InvalidConfigError(
            f"{field}: {len(data)} bytes is larger than the {MAX_CALIBRATION_BYTES} byte limit"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(
            f"{field}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
    if "\x00" in text:
        raise InvalidConfigError(f"{field}: not a text file (it contains NUL bytes)")
    if not text.strip():
        raise InvalidConfigError(f"{field}: the calibration text is empty")
    return text


def read_calibration_file(path: Path, field: str = "--calibration") -> str:
    """A calibration text file's content, checked like an upload (size before reading)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidConfigError(f"{field}: file {str(path)!r} does not exist")
    size = path.stat().st_size
    if size > MAX_CALIBRATION_BYTES:
        raise InvalidConfigError(
            f"{field}: {str(path)!r} has {size} bytes, more than the {MAX_CALIBRATION_BYTES} byte limit"
        )
    return check_calibration_text(path.read_bytes(), f"{field} {str(path)!r}")


def calibration_from_text(
    text: str,
    tokenizer: Any,
    tokens: int = DEFAULT_CALIBRATION_TOKENS,
    context: int = DEFAULT_CONTEXT,
    source: str = "text",
) -> Calibration:
    """The first `tokens` tokens of `text`, as windows of `context` tokens (the last partial
    window dropped). InvalidConfigError when the text has fewer tokens than asked for."""
    import torch

    from higgs_engine.evaluate import tokenize

    if not isinstance(tokens, int) or tokens < 2:
        raise InvalidConfigError(f"calibration tokens={tokens!r} must be an integer >= 2")
    if not isinstance(context, int) or context < 2:
        raise InvalidConfigError(f"calibration context={context!r} must be an integer >= 2")
    ids = tokenize(tokenizer, text)
    if ids.numel() < tokens:
        raise InvalidConfigError(
            f"the calibration text has {ids.numel()} tokens, fewer than the {tokens} requested"
        )
    ctx = min(context, tokens)
    w = tokens // ctx
    return Calibration(
        windows=ids[: w * ctx].reshape(w, ctx).to(torch.long),
        sha256=text_sha256(text),
        source=source,
    )


@dataclass(frozen=True)
class CalibrationRequest:
    """The calibration a job asks for, made into a Calibration once the model is resolved:
    `text` tokenized with the model's tokenizer (recorded as `label`), or (text None) text the
    model generates itself (cached in `cache_dir`); `tokens` in windows of `context`. Errors
    in making it name `field` (the option or request field it came from)."""

    text: str | None
    tokens: int = DEFAULT_CALIBRATION_TOKENS
    context: int = DEFAULT_CONTEXT
    label: str = "file"
    cache_dir: Path | None = None
    field: str = "calibration"

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 2:
            raise InvalidConfigError(
                f"{self.field}: calibration tokens={self.tokens!r} must be an integer >= 2"
            )


def self_calibration(
    model: ResolvedModel,
    tokens: int = DEFAULT_CALIBRATION_TOKENS,
    context: int = DEFAULT_CONTEXT,
    *,
    cache_dir: Path | None = None,
    progress: ProgressCallback | None = None,
    device: str | None = None,
) -> Calibration:
    """Calibration on text the model writes itself (higgs_engine.selfgen, seeded, cached per
    model revision in `cache_dir`; generated anew when it is None): ceil(tokens / context)
    sampled sequences of `context` tokens. Generation loads the model once in float32 (the
    calibration pass itself never does), on `device` (None: the CPU)."""
    import torch

    from higgs_engine.model_loading import load_float_model
    from higgs_engine.selfgen import SelfGenConfig, cached_self_tokens, selfgen_id

    if not isinstance(tokens, int) or tokens < 2:
        raise InvalidConfigError(f"calibration tokens={tokens!r} must be an integer >= 2")
    ctx = min(context, tokens)
    cfg = SelfGenConfig(count=max(1, tokens // ctx), length=ctx)
    rev = model.profile_revision
    net, tok = load_float_model(model)
    if device is not None:
        from higgs_engine.device import resolve_device

        net.to(resolve_device(device))
    try:
        toks = cached_self_tokens(net, tok, rev, cache_dir, cfg, progress=progress)
    finally:
        del net
    windows = toks.to("cpu", torch.long).contiguous()
    digest = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
    return Calibration(windows=windows, sha256=digest, source=selfgen_id(rev, cfg))


def prepare_calibration(
    model: ResolvedModel,
    request: CalibrationRequest,
    progress: ProgressCallback | None = None,
    device: str | None = None,
) -> Calibration:
    """The Calibration for quantizing `model`: the request's text tokenized with the model's
    own tokenizer, or (text None) self-generated text (generated on `device`). Errors name
    what is wrong before any quantization starts, prefixed by request.field."""
    try:
        if request.text is None:
            return self_calibration(
                model,
                request.tokens,
                request.context,
                cache_dir=request.cache_dir,
                progress=progress,
                device=device,
            )
        tok = load_tokenizer(model.path)
        return calibration_from_text(
            request.text, tok, request.tokens, request.context, source=request.label
        )
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"{request.field}: {exc}") from exc


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer; InvalidConfigError when it has none (text cannot be used)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise InvalidConfigError(
            f"the checkpoint in {str(path)!r} has no usable tokenizer to read calibration text: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------------------
# The block-by-block pass
# ---------------------------------------------------------------------------------------------

# quantize(specs, [W (out, in) float32], Hessian (in, in) float64 of their common unrotated
# input) -> [W_hat (out, in) float32], loaded into the block for the re-run. Layers that read
# the same input tensor (q/k/v, gate/up) come in one call.
LayerQuantizer = Callable[
    [list["LayerSpec"], list["torch.Tensor"], "torch.Tensor"], list["torch.Tensor"]
]


class _Stop(Exception):
    """Raised by the last pass-through block: the rest of the forward is not needed."""


def _find_blocks(model: nn.Module, names: Sequence[str]) -> tuple[str, nn.ModuleList]:
    """The ModuleList of transformer blocks: the one holding the most of `names`."""
    from torch import nn

    best: tuple[int, str, nn.ModuleList] | None = None
    for mname, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        pre = mname + "."
        count = sum(1 for n in names if n.startswith(pre))
        if count and (best is None or count > best[0]):
            best = (count, mname, mod)
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no list of transformer blocks holds the layers to calibrate"
        )
    return best[1], best[2]


def _set_param(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    from torch import nn

    owner_name, _, pname = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[pname] = nn.Parameter(tensor, requires_grad=False)


class _Hessians:
    """Forward pre-hooks on a block's target linears: one accumulator per distinct input tensor.

    The first window runs the whole block and records the order the targets are called in.
    When every target is called exactly once, later windows stop the block (raise `_Stop`)
    as soon as the last target's input is recorded: what the block computes after that (the
    last linear itself, the residual add) never reaches a Hessian."""

    def __init__(self, specs: dict[str, LayerSpec]) -> None:
        from higgs_engine.gptq import HessianAccumulator

        self.specs = specs
        self.leader: dict[str, str] = {}
        self.acc: dict[str, HessianAccumulator] = {}
        self._call: dict[int, tuple[Any, str]] = {}
        self._make = HessianAccumulator
        self._order: list[str] = []  # target calls of the first window
        self._windows = 0
        self.stop_after: str | None = None

    def new_window(self) -> None:
        if self._windows == 1 and self.stop_after is None:
            once = len(self._order) == len(set(self._order)) == len(self.specs)
            self.stop_after = self._order[-1] if once else None
        self._windows += 1
        self._call.clear()

    def hook(self, name: str) -> Callable[..., None]:
        def fn(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if self._windows == 1:
                self._order.append(name)
            if name not in self.leader:
                hit = self._call.get(id(x))
                if hit is not None and hit[0] is x:
                    self.leader[name] = hit[1]
                else:
                    self.leader[name] = name
                    self.acc[name] = self._make(self.specs[name].in_features)
            lead = self.leader[name]
            self._call.setdefault(id(x), (x, lead))
            if lead == name:
                self.acc[name].add(x)
            if name == self.stop_after:
                raise _Stop

        return fn

    def groups(self) -> list[tuple[list[str], torch.Tensor]]:
        """[(layer names sharing one input, their Hessian)] in the order the block runs them."""
        missed = [n for n in self.specs if n not in self.leader]
        if missed:
            raise InvalidConfigError(
                f"layers {missed[:5]} were not reached by the calibration pass"
            )
        out = []
        for lead, acc in self.acc.items():
            members = [n for n in self.specs if self.leader[n] == lead]
            out.append((members, acc.hessian()))
        return out


def gptq_entry(
    calibration: Calibration, calibrated: int, outside: Sequence[str], **extra: object
) -> dict[str, Any]:
    """The report's calibration entry of a GPTQ pass: the text, GPTQ's settings, how many
    layers it calibrated and which the pass could not reach (`extra`: the caller's own)."""
    from higgs_engine.gptq import DEFAULT_BLOCK, DEFAULT_DAMP

    return {
        **calibration.describe(),
        "method": "gptq",
        "damp": DEFAULT_DAMP,
        "block": DEFAULT_BLOCK,
        **extra,
        "layers_calibrated": calibrated,
        "layers_without_data": list(outside),
    }


def run_calibrated(
    resolved: ResolvedModel,
    reader: CheckpointReader,
    specs: Sequence[LayerSpec],
    calibration: Calibration,
    quantize: LayerQuantizer,
    progress: ProgressCallback | None = None,
    stage: str = "calibrating",
) -> list[str]:
    """Run the block-by-block pass over `calibration`, calling `quantize` once for every layer
    of `specs` (in block order). Returns the names of `specs` outside the transformer blocks,
    which the pass cannot calibrate (the caller quantizes them without data).

    progress(stage, layers done, total) after every layer; a False return cancels."""
    import torch

    from higgs_engine.model_loading import params_on_meta
    from higgs_engine.model_structure import model_class

    hf_config = resolved.hf_config  # built on the meta device once, when it was resolved
    with params_on_meta():
        model = model_class(hf_config)._from_config(hf_config, dtype=torch.float32)  # type: ignore[attr-defined]
    model.eval()
    by_name = {s.name: s for s in specs}
    blocks_name, blocks = _find_blocks(model, list(by_name))
    block_prefix = [f"{blocks_name}.{i}." for i in range(len(blocks))]
    outside = [n for n in by_name if not any(n.startswith(p) for p in block_prefix)]
    params = _BlockLoader(model, reader, blocks_name)
    total = len(by_name) - len(outside)
    report(progress, stage, 0, total)
    hidden, block_args = _capture(model, blocks, calibration.windows)
    done = 0
    for k, block in enumerate(blocks):
        pre = block_prefix[k]
        bparams = params.load_block(pre)
        targets = {n: s for n, s in by_name.items() if n.startswith(pre)}
        for group, hessian in _block_hessians(
            block, pre, targets, hidden, [a[k] for a in block_args]
        ):
            _quantize_group(block, pre, group, hessian, quantize)
            done += len(group)
            report(progress, stage, done, total)
        if k == len(blocks) - 1:
            hidden.clear()  # the last block's outputs feed no Hessian
        with torch.no_grad():
            for i, h in enumerate(hidden):
                a, kw = block_args[i][k]
                out = block(h, *a, **kw)
                hidden[i] = out[0] if isinstance(out, tuple) else out
        params.unload(bparams)
    return outside


class _BlockLoader:
    """The model's parameters filled from the checkpoint: everything outside the blocks but
    the output head at once, then one block at a time (and back to the meta device)."""

    def __init__(self, model: nn.Module, reader: CheckpointReader, blocks_name: str) -> None:
        from higgs_engine.model_loading import model_key

        self.model = model
        self.reader = reader
        self.params = dict(model.named_parameters(remove_duplicate=False))
        prefix = str(getattr(model, "base_model_prefix", "") or "")
        self.to_ckpt = {model_key(k, set(self.params), prefix): k for k in reader}
        net: Any = model
        head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
        head_names = tuple(
            n + "." for n, m in model.named_modules() if head is not None and m is head
        )
        # Everything outside the blocks except the output head (the pass never reaches it).
        for pname in self.params:
            if pname.startswith(blocks_name + ".") or pname.startswith(head_names or ("\0",)):
                continue
            if pname in self.to_ckpt:
                self.load(pname)

    def load(self, pname: str) -> None:
        import torch

        key = self.to_ckpt.get(pname)
        if key is None:
            raise InvalidConfigError(f"the checkpoint has no tensor for {pname!r}")
        _set_param(self.model, pname, self.reader.get(key).to(torch.float32))

    def load_block(self, pre: str) -> list[str]:
        names = [n for n in self.params if n.startswith(pre)]
        for pname in names:
            self.load(pname)
        return names

    def unload(self, names: list[str]) -> None:
        import torch

        for pname in names:
            _set_param(self.model, pname, torch.empty(self.params[pname].shape, device="meta"))


def _block_hessians(
    block: nn.Module,
    pre: str,
    targets: dict[str, LayerSpec],
    hidden: list[torch.Tensor],
    args: list[tuple[tuple[Any, ...], dict[str, Any]]],
) -> list[tuple[list[LayerSpec], torch.Tensor]]:
    """The block run (float weights) over every window with hooks on its target linears:
    [(the layers sharing one input, their Hessian)] in the order the block runs them."""
    import torch

    hes = _Hessians(targets)
    handles = [
        block.get_submodule(n[len(pre) :]).register_forward_pre_hook(hes.hook(n)) for n in targets
    ]
    try:
        with torch.no_grad():
            for h, (a, kw) in zip(hidden, args, strict=True):
                hes.new_window()
                with contextlib.suppress(_Stop):  # raised once every input is recorded
                    block(h, *a, **kw)
    finally:
        for hd in handles:
            hd.remove()
    hes.new_window()
    return [([targets[n] for n in names], hessian) for names, hessian in hes.groups()]


def _quantize_group(
    block: nn.Module,
    pre: str,
    group: list[LayerSpec],
    hessian: torch.Tensor,
    quantize: LayerQuantizer,
) -> None:
    """The layers of one input quantized with its Hessian; W_hat loaded into the block."""
    import torch

    ws = []
    for spec in group:
        w = block.get_submodule(spec.name[len(pre) :]).get_parameter("weight").detach()
        ws.append((w.t() if spec.transposed else w).to(torch.float32).contiguous())
    w_hats = quantize(group, ws, hessian)
    del ws
    for spec, w_hat in zip(group, w_hats, strict=True):
        stored = w_hat.t() if spec.transposed else w_hat
        _set_param(block, spec.name[len(pre) :] + ".weight", stored.to(torch.float32).contiguous())


def _capture(
    model: nn.Module, blocks: nn.ModuleList, windows: torch.Tensor
) -> tuple[list[torch.Tensor], list[list[tuple[tuple[Any, ...], dict[str, Any]]]]]:
    """Per window: the first block's input hidden states (1, T, hidden) float32 and every
    block's other positional / keyword arguments (tensors shared between blocks are stored
    once: the same objects)."""
    import torch

    hidden: list[torch.Tensor] = []
    per_window: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = []
    last = len(blocks) - 1
    for i in range(windows.shape[0]):
        seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        first: list[torch.Tensor] = []

        def make(
            k: int,
            seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = seen,
            first: list[torch.Tensor] = first,
        ) -> Callable[..., Any]:
            def passthrough(h: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if k == 0:
                    first.append(h.detach())
                kwargs.pop("use_cache", None)
                seen.append((args, kwargs))
                if k == last:
                    raise _Stop
                return h

            return passthrough

        for k, b in enumerate(blocks):
            b.forward = make(k)
        try:
            with torch.no_grad():
                model(input_ids=windows[i : i + 1], use_cache=False)
        except _Stop:
            pass
        finally:
            for b in blocks:
                del b.forward
        if len(seen) != len(blocks) or not first:
            raise UnsupportedModelError(
                f"{type(model).__name__}: the calibration pass saw {len(seen)} of {len(blocks)} blocks"
            )
        hidden.append(first[0].to(torch.float32))
        per_window.append(seen)
    return hidden, per_window
