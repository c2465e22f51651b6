"""Model loading: a checkpoint as a float torch model, and the helpers that build a model to
fill from stored tensors (parameters on the meta device, stored names mapped to the model's).

Model I/O below the orchestrators: the profile (higgs_engine.dynamic), the calibration pass
(higgs_engine.calibration) and the artifact loader (higgs_engine.artifacts) all use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.model_structure import load_config, match_key, model_class, model_kind

if TYPE_CHECKING:
    from torch import nn

    from higgs_engine.sources import ResolvedModel

__all__ = ["load_float_model", "model_key", "params_on_meta"]


def load_float_model(source: Path | ResolvedModel) -> tuple[nn.Module, Any]:
    """The checkpoint (a directory, or a model resolved already, whose config is not read
    again) in float32 on CPU (the profile perturbs it in place), and its tokenizer.

    A causal LM is loaded with its LM head; any other checkpoint (an encoder) as the class its
    config names (e.g. BertModel), whose base model's final hidden state the "cos" metric reads.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(source, Path | str):
        path = Path(source)
        hf_config = load_config(path)
    else:
        path, hf_config = source.path, source.hf_config
    if model_kind(hf_config) == "causal":
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        cls: Any = model_class(hf_config)
        model = cls.from_pretrained(str(path), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        tok = None
    return model, tok


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real, in this thread only.

    Parameters of nn.Linear, nn.Embedding and Conv1D are allocated with torch.empty and filled
    from the artifact; a torch function mode (thread-local, like torch.device) sends those
    calls to the meta device and nothing else, so nothing global is patched and other threads
    build their models as usual. Non-persistent buffers (rotary inv_freq, causal masks) are
    computed in __init__ with other factories and never stored in a checkpoint, so they stay
    real.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class _EmptyOnMeta(TorchFunctionMode):
        def __torch_function__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.empty:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    with _EmptyOnMeta():
        yield


def model_key(key: str, model_keys: set[str], prefix: str) -> str:
    """Map a stored tensor name to the model's (checkpoint.match_key; unchanged if none)."""
    return match_key(key, model_keys, prefix) or key
