"""A checkpoint's model structure: its config, the model built on the meta device (no weights
are loaded), and the quantizable linear layers found from the model's own modules
(`LayerSpec`: module name, tensor keys, layout).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import (
    CorruptCheckpointError,
    HiggsError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from higgs_engine.safetensors_stream import SHARD_INDEX

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from higgs_engine.safetensors_stream import CheckpointReader


def load_config(path: Path) -> PretrainedConfig:
    """The checkpoint's transformers config, without any quantization_config it may carry.

    The config of a plain checkpoint (not a HIGGS artifact) is checked against the tensors'
    shapes in its safetensors headers (higgs_engine.checkpoint_check): a sizing field that
    they contradict raises CorruptCheckpointError naming it, before anything is built."""
    from transformers import CONFIG_MAPPING

    cfg_file = Path(path) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"no config.json in {str(path)!r}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{str(cfg_file)!r} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UnsupportedModelError(f"{str(cfg_file)!r} has no model_type")
    quantized = raw.pop("quantization_config", None) is not None
    model_type = raw.pop("model_type")
    try:
        config_class = CONFIG_MAPPING[model_type]
    except (KeyError, TypeError) as exc:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by transformers"
        ) from exc
    try:
        config = config_class(**raw)
    except Exception as exc:  # the config class's own validation raises many types
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise UnsupportedModelError(
            f"{str(cfg_file)!r} is not a valid {model_type} config: {why}"
        ) from exc
    if not quantized and _has_weights(Path(path)):
        # Before anything is sized from the config: its sizing fields against the tensors.
        from higgs_engine.checkpoint_check import check_checkpoint

        check_checkpoint(Path(path), config)
    return config


def _has_weights(path: Path) -> bool:
    return (path / SHARD_INDEX).is_file() or any(path.glob("*.safetensors"))


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The transformers class named by config.architectures, else the causal-LM auto class."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(arch), None)
        if isinstance(cls, type):
            return cls
    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        mapping = auto._model_mapping
        if type(config) in mapping:
            found: type[nn.Module] = mapping[type(config)]  # type: ignore[assignment]
            return found
    raise UnsupportedModelError(
        f"transformers has no model class for model_type {config.model_type!r}"
    )


# What a causal LM class is called (an encoder's is not): how config.json's architectures say it.
CAUSAL_ARCH_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def model_kind(config: PretrainedConfig) -> str:
    """The checkpoint's kind: "causal" when it is a causal LM (its architecture has a next-token
    head, or it names none and transformers builds a causal LM for its model type), else
    "encoder" (a model whose output is its final hidden state, e.g. BertModel)."""
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    if archs:
        return "causal" if any(a.endswith(CAUSAL_ARCH_SUFFIXES) for a in archs) else "encoder"
    from transformers import AutoModelForCausalLM

    return "causal" if type(config) in AutoModelForCausalLM._model_mapping else "encoder"


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest input an encoder's learned position table takes (None when unknown)."""
    v = getattr(config, "max_position_embeddings", None)
    return int(v) if isinstance(v, int) and v > 0 else None


def build_meta_model(config: PretrainedConfig) -> nn.Module:
    """The model's module tree on the meta device: structure and shapes, no memory."""
    import torch

    cls = model_class(config)
    try:
        with torch.device("meta"):
            model: nn.Module = cls._from_config(config)  # type: ignore[attr-defined]
    except HiggsError:
        raise
    except Exception as exc:  # transformers raises many types for configs it cannot build
        raise UnsupportedModelError(
            f"cannot build {cls.__name__} from the checkpoint config: {exc}"
        ) from exc
    return model


@dataclass(frozen=True)
class LayerSpec:
    """One linear layer of the checkpoint, as the quantizer sees it (W is out x in)."""

    name: str  # module name, e.g. "model.layers.0.mlp.down_proj"
    key: str  # checkpoint tensor key of its weight
    out_features: int
    in_features: int
    transposed: bool  # True for GPT-2's Conv1D, whose stored weight is (in, out)
    bias_key: str | None
    # "linear" (a linear layer), "embedding" (the token embedding: (vocab, hidden), one row per
    # token) or "head" (an output head with its own weight); the last two only with scope "all"
    role: str = "linear"

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    def weight(self, reader: CheckpointReader) -> torch.Tensor:
        """The layer's weight as a float32 (out, in) tensor."""
        import torch

        w = reader.get(self.key)
        if self.transposed:
            w = w.t()
        return w.to(torch.float32).contiguous()


def _linear_modules(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    out_emb = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        out_emb = get_out()
    emb_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    found = []
    for name, mod in model.named_modules():
        if mod is out_emb or not name:
            continue
        if isinstance(mod, nn.Linear):
            transposed = False
        elif isinstance(mod, Conv1D):
            transposed = True
        else:
            continue
        # A weight shared with an embedding (tied head under another name) stays 16-bit.
        if id(mod.weight) in emb_weights:
            continue
        found.append((name, mod, transposed))
    return found


def match_key(key: str, keys: set[str], prefix: str) -> str | None:
    """The name in `keys` that a stored tensor name stands for (checkpoints may omit, or add,
    the base-model prefix such as "model"), or None."""
    if key in keys:
        return key
    if prefix and key.startswith(prefix + "."):
        stripped = key[len(prefix) + 1 :]
        if stripped in keys:
            return stripped
    if prefix and f"{prefix}.{key}" in keys:
        return f"{prefix}.{key}"
    return None


def layer_specs(
    config: PretrainedConfig,
    checkpoint_keys: Sequence[str] | None = None,
    *,
    model: nn.Module | None = None,
) -> list[LayerSpec]:
    """Every candidate linear layer (nn.Linear / Conv1D, not the output head nor embeddings).

    With `checkpoint_keys`, each spec's `key` is matched to the stored tensor name (checkpoints
    saved without the base-model prefix are handled) and a missing weight is an error.
    """
    model = model if model is not None else build_meta_model(config)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    keys = set(checkpoint_keys) if checkpoint_keys is not None else None
    specs = [
        _spec(name, mod, transposed, "linear", keys, prefix)
        for name, mod, transposed in _linear_modules(model)
    ]
    if not specs:
        raise UnsupportedModelError(f"{type(model).__name__} has no linear layers to quantize")
    return specs


def embedding_specs(
    config: PretrainedConfig,
    checkpoint_keys: Sequence[str] | None = None,
    *,
    model: nn.Module | None = None,
) -> list[LayerSpec]:
    """The token embedding (role "embedding", an nn.Embedding of (vocab, hidden) seen as a
    matrix whose rows are tokens) and an output head with its own weight (role "head", an
    nn.Linear); a head tied to the embedding shares its weight and is not listed. With
    `checkpoint_keys`, keys are matched to the stored names as in `layer_specs`."""
    from torch import nn

    m: Any = model if model is not None else build_meta_model(config)
    prefix = str(getattr(m, "base_model_prefix", "") or "")
    keys = set(checkpoint_keys) if checkpoint_keys is not None else None
    names = {id(mod): n for n, mod in m.named_modules()}
    emb = m.get_input_embeddings()
    get_out = getattr(m, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    found: list[tuple[str, nn.Module, str]] = []
    if isinstance(emb, nn.Embedding) and id(emb) in names:
        found.append((names[id(emb)], emb, "embedding"))
    if (
        isinstance(head, nn.Linear)
        and id(head) in names
        and (emb is None or head.weight is not getattr(emb, "weight", None))
    ):
        found.append((names[id(head)], head, "head"))
    return [_spec(name, mod, False, role, keys, prefix) for name, mod, role in found]


def _spec(
    name: str, mod: Any, transposed: bool, role: str, keys: set[str] | None, prefix: str
) -> LayerSpec:
    """The LayerSpec of module `name`: its weight's (out, in) and, with the checkpoint's `keys`,
    the stored names of its weight and bias (a missing weight is an error naming it)."""
    w: torch.Tensor = mod.weight
    out_f, in_f = (int(w.shape[0]), int(w.shape[1]))
    if transposed:  # GPT-2's Conv1D stores (in, out)
        out_f, in_f = in_f, out_f
    key = f"{name}.weight"
    bias_key: str | None = f"{name}.bias" if getattr(mod, "bias", None) is not None else None
    if keys is not None:
        matched = match_key(key, keys, prefix)
        if matched is None:
            what = "layer" if role == "linear" else role
            raise CorruptCheckpointError(f"checkpoint has no tensor for {what} weight {key!r}")
        key = matched
        if bias_key is not None:
            bias_key = match_key(bias_key, keys, prefix)
    return LayerSpec(name, key, out_f, in_f, transposed, bias_key, role=role)


def match_spec_keys(spec: LayerSpec, keys: set[str], prefix: str) -> LayerSpec:
    """`spec` (found without the checkpoint's keys) with its weight and bias keys matched to the
    stored names, as `layer_specs` matches them (a missing weight is an error naming it)."""
    import dataclasses

    key = match_key(f"{spec.name}.weight", keys, prefix)
    if key is None:
        what = "layer" if spec.role == "linear" else spec.role
        raise CorruptCheckpointError(
            f"checkpoint has no tensor for {what} weight {spec.name + '.weight'!r}"
        )
    bias = None if spec.bias_key is None else match_key(spec.bias_key, keys, prefix)
    return dataclasses.replace(spec, key=key, bias_key=bias)


def scope_specs(
    config: PretrainedConfig, checkpoint_keys: Sequence[str] | None, scope: str
) -> list[LayerSpec]:
    """The layers a run of `scope` quantizes: the linear layers, and with scope "all" the token
    embedding first and an untied output head last (`embedding_specs`)."""
    model = build_meta_model(config)
    specs = layer_specs(config, checkpoint_keys, model=model)
    if scope != "all":
        return specs
    extra = embedding_specs(config, checkpoint_keys, model=model)
    return (
        [s for s in extra if s.role == "embedding"]
        + specs
        + [s for s in extra if s.role != "embedding"]
    )


def is_skipped(name: str, skip: Sequence[str]) -> bool:
    """True when a module name matches one of the fnmatch patterns in `skip`."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in skip)


def quantizable_layers(
    config: PretrainedConfig | Path | str,
    skip: Sequence[str] = (),
    *,
    model: nn.Module | None = None,
) -> list[str]:
    """Module names of the layers to quantize: every nn.Linear (and GPT-2 Conv1D) except the
    output head and embeddings, minus those matching a `skip` pattern (fnmatch). `model`: the
    config's meta model when the caller has built it already."""
    if isinstance(config, str | Path):
        config = load_config(Path(config))
    return [s.name for s in layer_specs(config, model=model) if not is_skipped(s.name, skip)]


def embedding_layers(
    config: PretrainedConfig | Path | str, *, model: nn.Module | None = None
) -> list[str]:
    """Module names of the token embedding and of the output head when it has its own weight (a
    head tied to the embedding shares the embedding's weight and is not listed twice): the
    layers of `embedding_specs`."""
    if isinstance(config, str | Path):
        config = load_config(Path(config))
    return [s.name for s in embedding_specs(config, model=model)]
