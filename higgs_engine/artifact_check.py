"""Every artifact loaded by the engine that will run it, before a job calls it a success.

    native       the project's loader (artifacts.load_native) builds the model with its
                 HiggsLinear layers from the codes; above NATIVE_LOAD_BYTES only the config,
                 the layers' tensors and the grids are checked (nothing is read into memory)
    dequantized  transformers' model class built on the meta device from the artifact's
                 config, every parameter matched by name and shape against the safetensors
                 headers (and the config's sizing fields checked against them)
    compressed-tensors
                 transformers loads the directory through the compressed-tensors library
                 (AutoModelForCausalLM, AutoModel for an encoder), as a vLLM or transformers
                 user's from_pretrained does, and runs a few tokens: the outputs are finite
    gguf         llama.cpp (llama-cpp-python) loads the file with its own defaults (memory
                 mapped) and evaluates a few tokens, in a subprocess: a file llama.cpp
                 rejects, or one that crashes it, fails here and not in the user's hands

A failure raises CorruptCheckpointError naming the artifact and what is wrong.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from higgs_engine.errors import CorruptCheckpointError, HiggsError, OutOfMemoryError

__all__ = [
    "NATIVE_LOAD_BYTES",
    "verify_artifacts",
    "verify_compressed_tensors",
    "verify_dequantized",
    "verify_gguf",
]

# A native artifact up to this size is loaded whole (a few seconds for ~1B parameters).
NATIVE_LOAD_BYTES = 1 << 30
GGUF_TIMEOUT_S = 300.0


def verify_artifacts(out: Path, formats: Sequence[str]) -> None:
    """Load each artifact of `formats` under `out` (out/<format>/) with its engine."""
    for fmt in formats:
        d = Path(out) / fmt
        if not d.is_dir():
            continue
        if fmt == "native":
            verify_native(d)
        elif fmt == "dequantized":
            verify_dequantized(d)
        elif fmt == "gguf":
            verify_gguf(d)
        elif fmt == "compressed-tensors":
            verify_compressed_tensors(d)


def verify_native(path: Path) -> None:
    from higgs_engine.artifacts import load_native

    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    try:
        if size <= NATIVE_LOAD_BYTES:
            load_native(path)
        else:
            from higgs_engine.model_structure import build_meta_model, load_config

            build_meta_model(load_config(path))
    except HiggsError as exc:
        raise CorruptCheckpointError(f"the native artifact does not load: {exc}") from exc


def verify_dequantized(path: Path) -> None:
    from higgs_engine.checkpoint_check import checkpoint_shapes
    from higgs_engine.model_structure import build_meta_model, load_config

    try:
        model = build_meta_model(load_config(path))
    except HiggsError as exc:
        raise CorruptCheckpointError(f"the dequantized artifact does not load: {exc}") from exc
    shapes, _ = checkpoint_shapes(path)
    params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    unknown = sorted(k for k in shapes if k not in params)
    wrong = sorted(k for k in shapes if k in params and params[k] != shapes[k])
    tied = {k for k in params if k.endswith(("lm_head.weight", "embed_out.weight"))}
    missing = sorted(k for k in params if k not in shapes and k not in tied and _stored(model, k))
    for what, names in (("unknown tensors", unknown), ("tensors of the wrong shape", wrong)):
        if names:
            raise CorruptCheckpointError(
                f"the dequantized artifact has {what} for {type(model).__name__}: {names[:3]}"
            )
    if missing:
        raise CorruptCheckpointError(f"the dequantized artifact lacks tensors {missing[:3]}")


def verify_compressed_tensors(path: Path) -> dict[str, object]:
    """transformers loads `path` through compressed-tensors and runs 8 tokens with finite
    outputs; returns what was checked (the class, the library versions, seconds)."""
    import time

    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from higgs_engine.model_structure import model_kind

    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(str(path))
        qc = getattr(config, "quantization_config", None)
        method = (
            qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        )
        if str(method) != "compressed-tensors":
            raise CorruptCheckpointError(
                f"{path.name}: config.json's quantization_config is not compressed-tensors "
                f"(quant_method {method!r})"
            )
        kind = model_kind(config)
        causal = kind == "causal"
        auto = AutoModelForCausalLM if causal else AutoModel
        vocab = int(getattr(config, "vocab_size", 0) or 2)
        ids = (torch.arange(8) * 7919 % max(vocab - 1, 1)).unsqueeze(0)
        # the library's own progress bars (applying, compressing, decompressing) are not the
        # run's: the caller's progress says "packaging"
        with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            model = auto.from_pretrained(str(path)).eval()
            out = model(input_ids=ids)
        values = out.logits if causal else out.last_hidden_state
    except CorruptCheckpointError:
        raise
    except MemoryError as exc:
        raise OutOfMemoryError(f"transformers ran out of memory loading {path.name}") from exc
    except Exception as exc:  # whatever transformers raises: the user would see it too
        raise CorruptCheckpointError(
            f"transformers cannot load the compressed-tensors checkpoint {path.name}: "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if not bool(torch.isfinite(values.float()).all()):
        raise CorruptCheckpointError(
            f"the compressed-tensors checkpoint {path.name} loads but gives non-finite outputs"
        )
    import compressed_tensors

    return {
        "loader": f"transformers {auto.__name__}",
        "kind": kind,
        "class": type(model).__name__,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _stored(model: object, key: str) -> bool:
    """Whether `key` of the state dict is a parameter (buffers may be recomputed at load)."""
    return key in dict(model.named_parameters())  # type: ignore[attr-defined]


# Run in a fresh interpreter: load with llama.cpp's defaults (as a user's Llama(path) does),
# then evaluate a few tokens (a decoder) or embed them (an encoder).
_GGUF_SCRIPT = """
import sys
from llama_cpp import Llama
path = sys.argv[1]
llm = Llama(path, n_ctx=64, n_batch=64, n_threads=1, verbose=False)
arch = str(llm.metadata.get("general.architecture", ""))
if llm.metadata.get(arch + ".pooling_type") is not None or arch in ("bert", "nomic-bert"):
    del llm
    llm = Llama(path, n_ctx=64, n_batch=64, n_threads=1, verbose=False, embedding=True)
    llm.embed("Hello")
else:
    llm.eval(llm.tokenize(b"Hello")[:8])
print("ok")
"""


def verify_gguf(path: Path, timeout_s: float = GGUF_TIMEOUT_S) -> None:
    """llama.cpp loads the first (or only) GGUF file under `path` and runs it."""
    files = sorted(path.glob("*.gguf"))
    if not files:
        raise CorruptCheckpointError(f"no GGUF file in {path.name}")
    first = next((f for f in files if "-00001-of-" in f.name), files[0])
    try:
        res = subprocess.run(
            [sys.executable, "-c", _GGUF_SCRIPT, str(first)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise CorruptCheckpointError(
            f"llama.cpp did not load {first.name} within {timeout_s:g} s"
        ) from exc
    if res.returncode == 0 and res.stdout.strip().endswith("ok"):
        return
    lines = [ln.strip() for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
    why = lines[-1][:300] if lines else "no output"
    if any(t in res.stderr for t in ("MemoryError", "std::bad_alloc", "Cannot allocate memory")):
        raise OutOfMemoryError(f"llama.cpp ran out of memory loading {first.name}")
    if res.returncode < 0:
        why = f"llama.cpp crashed (signal {-res.returncode}); {why}"
    raise CorruptCheckpointError(f"llama.cpp cannot load {first.name}: {why}")
