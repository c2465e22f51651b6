"""A compressed-tensors checkpoint written from a source checkpoint and one scheme per layer.

Our code chooses every layer's codes, scales and zero points (higgs_engine.ct.quantizer); the
compressed-tensors library stores them: each layer goes through the compressor of its scheme's
format (pack-quantized for int weights, float-quantized for FP8), fed our dequantized weight
with our scales and zero points, from which it recomputes exactly our codes; config.json's
`quantization_config` is the library's QuantizationConfig (one config group per scheme, the
kept layers in `ignore`), written by its ModelCompressor. Everything else (norms, embeddings,
biases, a kept layer) is copied in the output dtype, and the source's tokenizer, generation
config and chat template are copied as for the other formats.

The output directory appears whole or not at all: it is built under a temporary name next to
it and renamed into place.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from higgs_engine.ct.quantizer import CtQuantized, dequantize, quantize_layer, relative_error
from higgs_engine.ct.schemes import KEEP, CtScheme, uniform_scheme
from higgs_engine.errors import InvalidConfigError
from higgs_engine.formats.base import ST_METADATA, WEIGHTS_NAME, torch_dtype, write_configs
from higgs_engine.model_structure import LayerSpec, build_meta_model, layer_specs, load_config
from higgs_engine.progress import ProgressCallback, report
from higgs_engine.safetensors_stream import CheckpointReader, StreamingSafetensorsWriter

__all__ = [
    "CtAssignment",
    "compress_layer",
    "ct_layers",
    "library_scheme",
    "quantization_config",
    "uniform_assignment",
    "unsaved_buffers",
    "write_compressed_tensors",
]

_CONV1D_REASON = (
    "a GPT-2 Conv1D, not a Linear: compressed-tensors and vLLM quantize only Linear layers"
)


@dataclass(frozen=True)
class CtAssignment:
    """A scheme per linear layer (module name -> scheme; a layer not listed stays 16-bit) and,
    for each layer kept 16-bit on purpose, why."""

    schemes: dict[str, CtScheme]
    reasons: dict[str, str] = field(default_factory=dict)

    def scheme_of(self, name: str) -> CtScheme:
        return self.schemes.get(name, KEEP)


def unsaved_buffers(source: Path) -> set[str]:
    """The buffers the checkpoint's model class registers as not persistent (transformers never
    saves them, e.g. a BERT's position_ids): a checkpoint that holds one anyway has it dropped
    from the compressed-tensors directory, as transformers' own save_pretrained would."""
    model = build_meta_model(load_config(source))
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        for buf in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{mod_name}.{buf}" if mod_name else str(buf))
    return names


def _is_unsaved(key: str, unsaved: set[str]) -> bool:
    return any(key == n or key.endswith("." + n) or n.endswith("." + key) for n in unsaved)


def ct_layers(source: Path) -> list[LayerSpec]:
    """The linear layers of a checkpoint (output head and embeddings aside), as stored."""
    with CheckpointReader(source) as reader:
        return layer_specs(load_config(source), reader.keys())


def uniform_assignment(source: Path, bits: int) -> CtAssignment:
    """`--bits 4` (int4, group 128 where the width allows it, else 64, else 32) or `--bits 8`
    (int8 per channel) for every linear layer; a layer no group size fits stays 16-bit."""
    schemes: dict[str, CtScheme] = {}
    reasons: dict[str, str] = {}
    for spec in ct_layers(source):
        if spec.transposed:
            reasons[spec.name] = _CONV1D_REASON
            continue
        scheme, why = uniform_scheme(bits, spec.out_features, spec.in_features)
        schemes[spec.name] = scheme
        if why is not None:
            reasons[spec.name] = why
    return CtAssignment(schemes, reasons)


def _args(scheme: CtScheme) -> Any:
    from compressed_tensors.quantization import QuantizationArgs

    strategy = "channel" if scheme.group_size is None else "group"
    return QuantizationArgs(
        num_bits=scheme.num_bits,
        type=scheme.weight_type,
        symmetric=scheme.symmetric,
        strategy=strategy,
        group_size=scheme.group_size,
    )


def library_scheme(scheme: CtScheme, targets: list[str]) -> Any:
    """compressed-tensors' QuantizationScheme of `scheme` for the modules `targets`."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    acts = None
    if scheme.fp8_activations:
        acts = QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True
        )
    return QuantizationScheme(
        targets=targets, weights=_args(scheme), input_activations=acts, format=scheme.format
    )


def compress_layer(q: CtQuantized, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's tensors as compressed-tensors stores them (local names: weight_packed,
    weight_scale, ...), made by the library's compressor for the scheme's format from our
    dequantized weight, scales and zero points."""
    from compressed_tensors.compressors import BaseCompressor

    scheme = library_scheme(q.scheme, ["Linear"])
    state: dict[str, torch.Tensor] = {
        # float32 (q - z) * s is exact, so the library's round(w / s + z) is our code
        "weight": dequantize(q).to(torch.float32),
        "weight_scale": q.scale.to(dtype),
    }
    if q.zero_point is not None:
        state["weight_zero_point"] = q.zero_point
    compressor = BaseCompressor.get_value_from_registry(q.scheme.format)
    out: dict[str, torch.Tensor] = compressor.compress(state, scheme)
    return out


def quantization_config(assignment: CtAssignment, kept: list[str]) -> Any:
    """The library's QuantizationConfig: one config group per scheme in use (its layers as
    exact targets), the kept linear layers in `ignore`, status compressed."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    by_scheme: dict[CtScheme, list[str]] = {}
    for name, scheme in assignment.schemes.items():
        if not scheme.keep and name not in kept:
            by_scheme.setdefault(scheme, []).append(name)
    groups = {
        f"group_{i}": library_scheme(s, sorted(names))
        for i, (s, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: kv[0].name))
    }
    formats = {s.format for s in by_scheme}
    fmt = formats.pop() if len(formats) == 1 else CompressionFormat.mixed_precision.value
    return QuantizationConfig(
        config_groups=groups,
        format=fmt,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=sorted(kept),
    )


def _layer_entry(spec: LayerSpec, scheme: CtScheme, bits: int, t2: float) -> dict[str, Any]:
    return {
        "name": spec.name,
        "shape": [spec.out_features, spec.in_features],
        "scheme": scheme.name,
        "bits": bits,
        "bits_per_weight": bits / spec.numel,
        "t2": t2,
    }


@dataclass(frozen=True)
class PrecomputedLayer:
    """A layer quantized before the write (calibrated): the tensors `compress_layer` gave for
    it, and its t^2 against the source weight."""

    stored: dict[str, torch.Tensor]
    t2: float


def _write(
    source: Path,
    assignment: CtAssignment,
    staging: Path,
    dtype_name: str,
    progress: ProgressCallback | None,
    precomputed: Mapping[str, PrecomputedLayer],
) -> dict[str, Any]:
    from compressed_tensors.compressors import ModelCompressor

    dtype = torch_dtype(dtype_name)
    specs = ct_layers(source)
    unknown = sorted(set(assignment.schemes) - {s.name for s in specs})
    if unknown:
        raise InvalidConfigError(
            f"the assignment names layers the checkpoint does not have: {unknown[:5]}"
        )
    by_key = {s.key: s for s in specs}
    reasons = dict(assignment.reasons)
    layers: list[dict[str, Any]] = []
    kept: list[str] = []
    weights = StreamingSafetensorsWriter(staging / WEIGHTS_NAME, ST_METADATA)
    try:
        with CheckpointReader(source) as reader:
            total = len(specs)
            report(progress, "quantizing", 0, total)
            done = 0
            unsaved = unsaved_buffers(source)
            for key in sorted(reader.keys()):
                spec = by_key.get(key)
                if spec is None and _is_unsaved(key, unsaved):
                    continue
                if spec is None:
                    t = reader.get(key)
                    weights.add(key, t.to(dtype) if t.is_floating_point() else t)
                    continue
                scheme = assignment.scheme_of(spec.name)
                if not scheme.keep and spec.transposed:
                    reasons[spec.name] = _CONV1D_REASON
                    scheme = KEEP
                if scheme.keep:
                    kept.append(spec.name)
                    reasons.setdefault(spec.name, "assigned 16 bits")
                done_before = precomputed.get(spec.name)
                if done_before is not None and not scheme.keep:
                    layers.append(_add_precomputed(weights, spec, scheme, done_before))
                else:
                    layers.append(_write_layer(reader, weights, spec, scheme, dtype))
                done += 1
                report(progress, "quantizing", done, total)
        weights.close()
    except BaseException:
        weights.abort()
        raise
    write_configs(staging, source, dtype_name, None)
    qconfig = quantization_config(assignment, kept)
    ModelCompressor(quantization_config=qconfig).update_config(str(staging))
    return _summary(
        staging, layers, {name: reasons[name] for name in sorted(kept)}, dtype_name, qconfig
    )


def _write_layer(
    reader: CheckpointReader,
    weights: StreamingSafetensorsWriter,
    spec: LayerSpec,
    scheme: CtScheme,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """One linear layer into `weights`: kept in 16 bits, or quantized with `scheme` and stored
    by the library's compressor; its report entry (bits stored, t^2)."""
    if scheme.keep:
        weights.add(spec.key, reader.get(spec.key).to(dtype))
        scale_bits = 8 * torch.tensor([], dtype=dtype).element_size()
        return _layer_entry(
            spec, KEEP, KEEP.layer_bits(spec.out_features, spec.in_features, scale_bits), 0.0
        )
    why = scheme.unfit_reason(spec.out_features, spec.in_features)
    if why is not None:
        raise InvalidConfigError(f"layer {spec.name}, scheme {scheme.name}: {why}")
    w = spec.weight(reader)
    q = quantize_layer(w, scheme, dtype)
    stored = compress_layer(q, dtype)
    for local, tensor in stored.items():
        weights.add(f"{spec.name}.{local}", tensor)
    bits = sum(8 * t.numel() * t.element_size() for t in stored.values())
    return _layer_entry(spec, scheme, bits, relative_error(w, dequantize(q)))


def _add_precomputed(
    weights: StreamingSafetensorsWriter,
    spec: LayerSpec,
    scheme: CtScheme,
    layer: PrecomputedLayer,
) -> dict[str, Any]:
    """A layer quantized before the write into `weights`; its report entry."""
    for local, tensor in layer.stored.items():
        weights.add(f"{spec.name}.{local}", tensor)
    bits = sum(8 * t.numel() * t.element_size() for t in layer.stored.values())
    return _layer_entry(spec, scheme, bits, layer.t2)


def _summary(
    staging: Path,
    layers: list[dict[str, Any]],
    kept: dict[str, str],
    dtype_name: str,
    qconfig: Any,
) -> dict[str, Any]:
    """The writer's report entry: every layer, the kept ones with why, bits per weight."""
    import compressed_tensors

    bits_total = sum(int(e["bits"]) for e in layers)
    numel = sum(int(e["shape"][0]) * int(e["shape"][1]) for e in layers)
    layers.sort(key=lambda e: str(e["name"]))
    histogram: dict[str, int] = {}
    for e in layers:
        histogram[str(e["scheme"])] = histogram.get(str(e["scheme"]), 0) + 1
    return {
        "format": "compressed-tensors",
        "compressed_tensors_version": compressed_tensors.__version__,
        "dtype": dtype_name,
        "quantization_format": str(qconfig.format),
        "layers": layers,
        "kept": kept,
        "schemes": dict(sorted(histogram.items())),
        "bits_per_weight": bits_total / numel if numel else 0.0,
        "linear_params": numel,
        "weights_bytes": (staging / WEIGHTS_NAME).stat().st_size,
    }


def write_compressed_tensors(
    source: Path,
    assignment: CtAssignment,
    out_dir: Path,
    *,
    dtype: str = "float16",
    progress: ProgressCallback | None = None,
    layers: Mapping[str, PrecomputedLayer] | None = None,
) -> dict[str, Any]:
    """Write `source` (a local checkpoint directory) as a compressed-tensors checkpoint in
    `out_dir` (which must not exist), each linear layer in its assigned scheme. Returns the
    report: per layer its scheme, bits (every stored tensor) and relative error t^2; the kept
    layers and why; bits per weight over the linear layers. Stage "quantizing". `layers`:
    layers quantized already (calibrated), stored as they are instead of quantized here."""
    source, out_dir = Path(source), Path(out_dir)
    if out_dir.exists():
        raise InvalidConfigError(f"output {str(out_dir)!r} already exists", field="out")
    torch_dtype(dtype)  # a known dtype name, before any work
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        result = _write(source, assignment, staging, dtype, progress, layers or {})
        staging.rename(out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
        raise
    return result
