"""llama.cpp itself, through llama-cpp-python's bindings: quantize and dequantize rows with
ggml's own kernels, quantize a GGUF file with per-tensor types (llama_model_quantize), and run a
GGUF model to get logits or pooled embeddings.

Nothing here re-implements a llama.cpp format: every byte of a quantized tensor comes from
ggml_quantize_chunk (through llama_model_quantize for whole files), every dequantized value from
the type's own to_float.

Models are loaded with `use_extra_bufts` off: llama.cpp's CPU weight repacking (an extra buffer
type) is a speed feature only, and it crashed on some AVX-512 machines with Q4_0 / Q4_K files.
scripts/install_llama_cpp builds llama.cpp without it (GGML_CPU_REPACK=OFF) so that a user's
`Llama(path)` runs these files too; the flag here still guards a build made elsewhere.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from higgs_engine.errors import HiggsError, InvalidConfigError
from higgs_engine.planning.gguf_types import GgufType

__all__ = [
    "LlamaError",
    "LlamaModel",
    "LlamaUnavailableError",
    "dequantize_rows",
    "llama_version",
    "quantize_file",
    "quantize_rows",
    "roundtrip_rows",
    "type_traits",
]


class LlamaUnavailableError(HiggsError):
    """llama-cpp-python (llama.cpp's bindings) is not installed."""

    code = "llama_cpp_unavailable"


class LlamaError(HiggsError):
    """llama.cpp refused a file or failed to run it."""

    code = "llama_cpp_failed"


_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def _llama() -> Any:
    """The llama_cpp module, imported once, with llama.cpp's logging silenced."""
    with _LOCK:
        if "llama" in _STATE:
            return _STATE["llama"]
        try:
            import llama_cpp
        except ImportError as e:  # pragma: no cover - depends on the install
            raise LlamaUnavailableError(
                "the GGUF format needs llama.cpp's Python bindings: pip install llama-cpp-python "
                "(scripts/setup builds and caches it)"
            ) from e

        @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
        def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            return None

        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _STATE["llama"] = llama_cpp
        _STATE["log_cb"] = _quiet  # keep the callback alive
        return llama_cpp


class _Traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def _ggml() -> Any:
    """ggml's base library (quantize_chunk, type traits) as llama-cpp-python ships it."""
    llama_cpp = _llama()
    with _LOCK:
        if "ggml" in _STATE:
            return _STATE["ggml"]
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        lib = None
        for name in ("libggml-base.so", "libggml.so", "libggml-base.dylib", "libggml.dylib"):
            if (lib_dir / name).is_file():
                lib = ctypes.CDLL(str(lib_dir / name))
                break
        if lib is None:  # pragma: no cover - depends on the install
            raise LlamaUnavailableError(f"no ggml library found in {lib_dir}")
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_row_size.restype = ctypes.c_size_t
        _STATE["ggml"] = lib
        return lib


def llama_version() -> str:
    """The installed llama-cpp-python version (llama.cpp is vendored at a fixed commit in it)."""
    return str(getattr(_llama(), "__version__", "unknown"))


def type_traits(ggml_id: int) -> tuple[str, int, int]:
    """(name, values per block, bytes per block) of a ggml type, from the library."""
    t = _ggml().ggml_get_type_traits(ggml_id).contents
    return (t.type_name or b"").decode(), int(t.blck_size), int(t.type_size)


def quantize_rows(rows: np.ndarray, t: GgufType, imatrix: np.ndarray | None = None) -> bytes:
    """ggml's encoding of float32 rows (n, cols) as type `t` (with an importance matrix of `cols`
    column weights, as llama.cpp's imatrix path passes it)."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if x.ndim != 2:
        raise InvalidConfigError(f"rows must be 2-D, got shape {x.shape}")
    n, cols = x.shape
    if not t.fits(cols):
        raise InvalidConfigError(f"rows of {cols} values cannot be stored as {t.name}")
    lib = _ggml()
    out = np.empty(n * t.row_bytes(cols), dtype=np.uint8)
    im = None
    if imatrix is not None:
        im = np.ascontiguousarray(imatrix, dtype=np.float32)
        if im.shape != (cols,):
            raise InvalidConfigError(f"imatrix has shape {im.shape}, expected ({cols},)")
    size = lib.ggml_quantize_chunk(
        t.ggml_id,
        x.ctypes.data,
        out.ctypes.data,
        0,
        n,
        cols,
        None if im is None else im.ctypes.data,
    )
    if size != out.nbytes:  # pragma: no cover - a mismatch with ggml's own layout
        raise LlamaError(f"ggml wrote {size} bytes for {n}x{cols} {t.name}, expected {out.nbytes}")
    return out.tobytes()


def dequantize_rows(data: bytes, t: GgufType, n: int, cols: int) -> np.ndarray:
    """float32 (n, cols) decoded from `data` with the type's own to_float."""
    if len(data) != n * t.row_bytes(cols):
        raise InvalidConfigError(f"{len(data)} bytes are not {n} rows of {cols} {t.name} values")
    out = np.empty((n, cols), dtype=np.float32)
    src = np.frombuffer(data, dtype=np.uint8)
    if t.name == "F16":
        return src.view(np.float16).astype(np.float32).reshape(n, cols)
    if t.name == "F32":
        return src.view(np.float32).reshape(n, cols).copy()
    fn = _ggml().ggml_get_type_traits(t.ggml_id).contents.to_float
    if not fn:
        raise LlamaError(f"ggml has no dequantization for {t.name}")
    _TO_FLOAT(fn)(src.ctypes.data, out.ctypes.data, n * cols)
    return out


def roundtrip_rows(rows: np.ndarray, t: GgufType, imatrix: np.ndarray | None = None) -> np.ndarray:
    """rows encoded as `t` and decoded again (float32): what llama.cpp computes with."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if t.name == "F32":
        return x.copy()
    if t.name == "F16":
        return x.astype(np.float16).astype(np.float32)
    return dequantize_rows(quantize_rows(x, t, imatrix), t, x.shape[0], x.shape[1])


# ---------------------------------------------------------------------------------------------
# Whole files
# ---------------------------------------------------------------------------------------------


# llama_ftype values written as general.file_type (what llama.cpp and model hubs display).
FTYPES: dict[str, int] = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "IQ4_NL": 25,
    "IQ3_S": 26,
    "IQ4_XS": 30,
}


def quantize_file(
    src: Path,
    dst: Path,
    *,
    ftype: str,
    tensor_types: dict[str, GgufType] | None = None,
    imatrix: dict[str, np.ndarray] | None = None,
    threads: int = 0,
    keep_split: bool = False,
) -> None:
    """llama_model_quantize: `src` (an F16/F32 GGUF) -> `dst` with llama.cpp's mixture `ftype`
    (e.g. "Q4_K_M"), or, with `tensor_types`, exactly those types for the named tensors (each
    name matched whole; the rest follow `ftype`). `imatrix`: per-tensor column weights, as
    llama-imatrix computes them."""
    llama_cpp = _llama()
    if ftype not in FTYPES:
        raise InvalidConfigError(f"unknown llama.cpp file type {ftype!r}", field="ftype")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = FTYPES[ftype]
    params.allow_requantize = False
    params.quantize_output_tensor = True
    params.keep_split = keep_split
    keep: list[Any] = []  # ctypes buffers that must outlive the call
    if tensor_types:
        arr = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for i, (name, t) in enumerate(sorted(tensor_types.items())):
            pat = ("^" + _regex_escape(name) + "$").encode()
            keep.append(pat)
            arr[i].pattern = pat
            arr[i].type = t.ggml_id
        arr[len(tensor_types)].pattern = None
        params.tt_overrides = arr
        keep.append(arr)
    if imatrix:
        im = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, v) in enumerate(sorted(imatrix.items())):
            buf = np.ascontiguousarray(v, dtype=np.float32)
            keep.append(buf)
            nm = name.encode()
            keep.append(nm)
            im[i].name = nm
            im[i].data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            im[i].size = buf.size
        im[len(imatrix)].name = None
        params.imatrix = im
        keep.append(im)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LlamaError(f"llama.cpp could not quantize {src.name} to {ftype} (code {rc})")


def _regex_escape(name: str) -> str:
    # std::regex (ECMAScript) special characters; tensor names use letters, digits, '.', '_'
    return "".join("\\" + c if c in r".^$|?*+()[]{}\/" else c for c in name)


# ---------------------------------------------------------------------------------------------
# Running a model
# ---------------------------------------------------------------------------------------------


class LlamaModel:
    """A GGUF model loaded in llama.cpp on the CPU, with one context of `n_ctx` tokens.

    `logits(tokens)` gives the next-token logits at every position of one window; with
    `embeddings=True` (an encoder), `pooled(tokens)` the model's pooled sentence embedding
    (mean pooling unless the file says otherwise)."""

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int = 512,
        embeddings: bool = False,
        threads: int = 0,
    ) -> None:
        import os

        self._llama = llama_cpp = _llama()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise LlamaError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        n_threads = threads or max(1, len(os.sched_getaffinity(0)))
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.embeddings = embeddings
        if embeddings:
            cp.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise LlamaError(f"llama.cpp could not make a context for {path}")
        self.n_ctx = n_ctx
        self.embeddings = embeddings
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        # positions the model was trained for: learned position tables (BERT) end there, and
        # llama.cpp aborts the process on an index past them, so windows are checked against it
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self._model))
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._llama.llama_batch_free(self._batch)
            self._llama.llama_free(self._ctx)
            self._llama.llama_model_free(self._model)
            self._ctx = None

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (self._llama.llama_token * cap)()
        n = self._llama.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, False)
        if n < 0:
            cap = -n
            buf = (self._llama.llama_token * cap)()
            n = self._llama.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, False)
        return list(buf[:n])

    def tokenize_framed(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` framed the way the model's tokenizer frames a text with its special tokens
        (an encoder's [CLS] ... [SEP])."""
        ll, v = self._llama, self._vocab
        out = list(tokens)
        if ll.llama_vocab_get_add_bos(v) and ll.llama_vocab_bos(v) >= 0:
            out.insert(0, int(ll.llama_vocab_bos(v)))
        if ll.llama_vocab_get_add_sep(v) and ll.llama_vocab_sep(v) >= 0:
            out.append(int(ll.llama_vocab_sep(v)))
        elif ll.llama_vocab_get_add_eos(v) and ll.llama_vocab_eos(v) >= 0:
            out.append(int(ll.llama_vocab_eos(v)))
        return out

    def _run(self, tokens: Sequence[int], all_logits: bool) -> None:
        n = len(tokens)
        if not 0 < n <= min(self.n_ctx, self.n_ctx_train or n):
            raise InvalidConfigError(
                f"a window of {n} tokens does not fit the context of {self.n_ctx} "
                f"(the model was built for {self.n_ctx_train} positions)",
                field="context",
            )
        ll = self._llama
        ll.llama_memory_clear(ll.llama_get_memory(self._ctx), True)
        b = self._batch
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = int(tok)
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (all_logits or i == n - 1) else 0
        rc = ll.llama_encode(self._ctx, b) if self.embeddings else ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise LlamaError(f"llama.cpp failed to evaluate {n} tokens (code {rc})")

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 (len(tokens), n_vocab): the logits after each token of one window."""
        self._run(tokens, all_logits=True)
        ptr = self._llama.llama_get_logits(self._ctx)
        arr = np.ctypeslib.as_array(ptr, shape=(len(tokens) * self.n_vocab,))
        return arr.reshape(len(tokens), self.n_vocab).copy()

    def pooled(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 (n_embd,): the pooled embedding of one window (an encoder)."""
        if not self.embeddings:
            raise InvalidConfigError("pooled() needs a model loaded with embeddings=True")
        self._run(tokens, all_logits=True)
        ptr = self._llama.llama_get_embeddings_seq(self._ctx, 0)
        if not ptr:
            raise LlamaError("llama.cpp returned no pooled embedding")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
