"""Frozen, self-validating quantization configs that serialise to versioned JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.layout import is_power_of_two

CONFIG_VERSION = 1

# Grids the engine ships (see higgs_engine/grids.py): p=1 with n = 2..256, p=2 with n = 4..4096,
# all powers of two. Code bits = log2(n) / p.
SUPPORTED_GRIDS: dict[int, tuple[int, ...]] = {
    1: tuple(2**k for k in range(1, 9)),
    2: tuple(2**k for k in range(2, 13)),
}
# Artifact formats, named here once; every other list (the FORMATS registry of writers, the
# API's options.formats, the CLI's --format, the console's download links) derives from these.
# A writer format is streamed tensor by tensor through its FormatWriter (higgs_engine/formats/);
# a whole-file format is made from the 16-bit checkpoint by another tool (gguf: llama.cpp,
# higgs_engine/gguf/; compressed-tensors: that library's compressors, higgs_engine/ct/). Adding a format: its name in one of the two Literals, then its module.
WriterFormat = Literal["native", "dequantized"]
WholeFileFormat = Literal["gguf", "compressed-tensors"]
FormatName = Literal[WriterFormat, WholeFileFormat]
WRITER_FORMATS: tuple[str, ...] = get_args(WriterFormat)
WHOLE_FILE_FORMATS: tuple[str, ...] = get_args(WholeFileFormat)
FORMAT_NAMES: tuple[str, ...] = get_args(FormatName)
# What a HiggsConfig writes when it names no formats (a choice, not a list of names).
DEFAULT_FORMATS: tuple[WriterFormat, ...] = ("native", "dequantized")

# Quantization methods a job may choose (HiggsConfig.method), named once; each is a Method of
# higgs_engine.methods.METHODS. HIGGS methods write HIGGS codes, which the native format, the
# allocator of a dynamic target and the worker's evaluation of the native artifact need; a
# calibrated method needs calibration text. The other registered method, gptq-int4, is the
# benchmarks' only: a calibrated run stores HIGGS codes (higgs_engine.pipeline).
MethodName = Literal["higgs", "higgs-gptq", "rtn", "nf4", "nf4-dq"]
METHOD_NAMES: tuple[str, ...] = get_args(MethodName)
DEFAULT_METHOD: MethodName = "higgs"
HIGGS_METHODS: tuple[MethodName, ...] = ("higgs", "higgs-gptq")
CALIBRATED_METHODS: tuple[MethodName, ...] = ("higgs-gptq",)
# Methods of one bit width (NF4), and the others' rule: a whole number of code bits (RTN).
FOUR_BIT_METHODS: tuple[MethodName, ...] = ("nf4", "nf4-dq")
# Scale rules of higgs_engine.quantize (kept here too: this module imports no torch).
ScaleRule = Literal["rms", "mse", "unbiased", "mse-unbiased"]
SCALE_RULES: tuple[str, ...] = get_args(ScaleRule)
# What a HIGGS run quantizes: "linear" = the linear layers (the token embedding and an output
# head stay 16-bit); "all" = those and the token embedding and an untied output head too.
Scope = Literal["linear", "all"]
SCOPES: tuple[str, ...] = get_args(Scope)
DEFAULT_SCOPE: Scope = "linear"


def check_method_job(method: str, *, calibrated: bool, dynamic: bool, gguf: bool) -> None:
    """What a job's method needs beyond its config (HiggsConfig checks the rest): calibration
    text for a calibrated method and none for a baseline; HIGGS grids for a dynamic target;
    the default method for a GGUF file. InvalidConfigError naming the field "method"."""
    if method in CALIBRATED_METHODS and not calibrated:
        raise InvalidConfigError(
            f"method={method!r} is calibrated: it needs calibration text", field="method"
        )
    if calibrated and method not in HIGGS_METHODS:
        raise InvalidConfigError(
            f"method={method!r} is data-free: calibration runs {list(CALIBRATED_METHODS)}",
            field="method",
        )
    if dynamic and method not in HIGGS_METHODS:
        raise InvalidConfigError(
            f"method={method!r} has no HIGGS grids to allocate: a dynamic target needs one of "
            f"{list(HIGGS_METHODS)} (give a bit width)",
            field="method",
        )
    if gguf and method != DEFAULT_METHOD:
        raise InvalidConfigError(
            f"method={method!r}: a gguf file takes llama.cpp's types, not a quantization method",
            field="method",
        )


def code_bits(p: int, n: int) -> float:
    """Bits of code per weight for a p-dimensional grid of n points."""
    return math.log2(n) / p


def check_grid(p: int, n: int) -> None:
    if p not in SUPPORTED_GRIDS:
        raise InvalidConfigError(
            f"p={p} is not supported; choose one of {sorted(SUPPORTED_GRIDS)}", field="p"
        )
    if n not in SUPPORTED_GRIDS[p]:
        raise InvalidConfigError(
            f"n={n} is not a supported grid size for p={p}; choose one of {list(SUPPORTED_GRIDS[p])}",
            field="n",
        )


# The defaults of HiggsConfig and of the quantization primitives (higgs_engine.quantize,
# higgs_engine.gptq): one place, so that a primitive called with its defaults quantizes as the
# pipeline does with HiggsConfig().
DEFAULT_GROUP_SIZE = 256
DEFAULT_ROTATION_BLOCK = 1024
DEFAULT_SIGN_SEED = 0
DEFAULT_SCALE_RULE: ScaleRule = "mse-unbiased"


@dataclass(frozen=True)
class MatrixSpec:
    """How one weight matrix is HIGGS-quantized: its grid (p, n) and the settings of a
    HiggsConfig that shape its codes and scales. What the primitives take
    (higgs_engine.quantize.quantize_matrix, higgs_engine.gptq.gptq_higgs); they check it
    against the matrix (check_inputs), so any values may be held here."""

    p: int = 2
    n: int = 256
    group_size: int = DEFAULT_GROUP_SIZE
    rotation_block: int = DEFAULT_ROTATION_BLOCK
    # None = no random signs before the rotation
    sign_seed: int | None = DEFAULT_SIGN_SEED
    scale_rule: str = DEFAULT_SCALE_RULE


@dataclass(frozen=True)
class LayerOverride:
    """Per-layer choice that replaces the config's grid: p=0 means keep the layer in 16 bits."""

    name: str
    p: int
    n: int

    def __post_init__(self) -> None:
        if self.p != 0:
            check_grid(self.p, self.n)


@dataclass(frozen=True)
class HiggsConfig:
    """How to quantize a checkpoint with HIGGS. Validates itself on construction."""

    p: int = 2
    n: int = 256
    group_size: int = DEFAULT_GROUP_SIZE
    rotation_block: int = DEFAULT_ROTATION_BLOCK
    # Seed of the random +-1 signs applied before the rotation (the randomized Hadamard
    # transform); None = no signs (the reference implementations use none). Signs with the
    # MSE-searched unbiased scale won on both real models of benchmarks/ablation.py
    # (docs/algorithm.md, "Data-free defaults").
    sign_seed: int | None = DEFAULT_SIGN_SEED
    # How each scale group's scale is chosen (higgs_engine.quantize.SCALE_RULES).
    scale_rule: str = DEFAULT_SCALE_RULE
    # fnmatch patterns of module names to keep in 16 bits (on top of lm_head / embeddings).
    skip: tuple[str, ...] = ()
    formats: tuple[str, ...] = DEFAULT_FORMATS
    # Per-layer choices (dynamic HIGGS); a layer not named uses (p, n).
    overrides: tuple[LayerOverride, ...] = ()
    # dtype of the dequantized checkpoint and of non-quantized tensors in the native artifact.
    dtype: str = "float16"
    seed: int = 0
    version: int = field(default=CONFIG_VERSION)
    # SCOPES: "all" also quantizes the token embedding (rows = tokens) and an untied head.
    scope: str = DEFAULT_SCOPE
    # METHOD_NAMES: how each layer is quantized (higgs_engine.methods.METHODS).
    method: str = DEFAULT_METHOD

    def __post_init__(self) -> None:
        check_grid(self.p, self.n)
        if not is_power_of_two(self.rotation_block) or not 64 <= self.rotation_block <= 4096:
            raise InvalidConfigError(
                f"rotation_block={self.rotation_block} must be a power of two in 64..4096",
                field="rotation_block",
            )
        if self.group_size < self.p or self.group_size % self.p or self.group_size > 4096:
            raise InvalidConfigError(
                f"group_size={self.group_size} must be a multiple of p={self.p} and at most 4096",
                field="group_size",
            )
        if not is_power_of_two(self.group_size):
            raise InvalidConfigError(
                f"group_size={self.group_size} must be a power of two", field="group_size"
            )
        bad = [f for f in self.formats if f not in WRITER_FORMATS]
        if bad or not self.formats:
            raise InvalidConfigError(
                f"formats={list(self.formats)} must be a non-empty subset of "
                f"{list(WRITER_FORMATS)}",
                field="formats",
            )
        if self.scale_rule not in SCALE_RULES:
            raise InvalidConfigError(
                f"scale_rule={self.scale_rule!r} must be one of {list(SCALE_RULES)}",
                field="scale_rule",
            )
        if self.sign_seed is not None and not 0 <= self.sign_seed < 2**63:
            raise InvalidConfigError(
                f"sign_seed={self.sign_seed} must be in 0..2^63-1 or None", field="sign_seed"
            )
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise InvalidConfigError(
                f"dtype={self.dtype!r} must be float16, bfloat16 or float32", field="dtype"
            )
        if self.version != CONFIG_VERSION:
            raise InvalidConfigError(
                f"config version {self.version} is not {CONFIG_VERSION}", field="version"
            )
        if self.scope not in SCOPES:
            raise InvalidConfigError(
                f"scope={self.scope!r} must be one of {list(SCOPES)}", field="scope"
            )
        self._check_method()

    def _check_method(self) -> None:
        m = self.method
        if m not in METHOD_NAMES:
            raise InvalidConfigError(
                f"method={m!r} must be one of {list(METHOD_NAMES)}", field="method"
            )
        if m in HIGGS_METHODS:
            return
        if "native" in self.formats:
            raise InvalidConfigError(
                f"method={m!r} has no native encoding: its formats can only be "
                f"{[f for f in WRITER_FORMATS if f != 'native']} (got {list(self.formats)})",
                field="method",
            )
        bits = self.code_bits
        if m in FOUR_BIT_METHODS and bits != 4:
            raise InvalidConfigError(
                f"method={m!r} is 4-bit; the grid p={self.p} n={self.n} has {bits:g} code bits",
                field="method",
            )
        if not bits.is_integer():
            raise InvalidConfigError(
                f"method={m!r} needs a whole number of bits; the grid p={self.p} n={self.n} "
                f"has {bits:g}",
                field="method",
            )

    @property
    def data_free_method(self) -> str:
        """The method of a layer quantized without data: a calibrated method's data-free twin
        for the layers the calibration pass does not reach, else the method itself."""
        return DEFAULT_METHOD if self.method in CALIBRATED_METHODS else self.method

    @property
    def code_bits(self) -> float:
        return code_bits(self.p, self.n)

    @classmethod
    def from_bits(
        cls, bits: float, p: int | None = None, n: int | None = None, **kw: Any
    ) -> HiggsConfig:
        """The config for "b-bit HIGGS": the grid with the most code bits not above `bits`.

        p=2 is preferred at equal code bits (lower MSE); `p` or `n` fix that choice.
        """
        if p is not None and n is not None:
            cfg = cls(p=p, n=n, **kw)
            if cfg.code_bits > bits + 1e-9:
                raise InvalidConfigError(
                    f"p={p}, n={n} has {cfg.code_bits:g} code bits, above bits={bits:g}", field="p"
                )
            return cfg
        if not math.isfinite(bits) or bits <= 0:
            raise InvalidConfigError(f"bits={bits} must be a positive number", field="bits")
        if p is not None and p not in SUPPORTED_GRIDS:
            raise InvalidConfigError(
                f"p={p} is not supported; choose one of {sorted(SUPPORTED_GRIDS)}", field="p"
            )
        if n is not None and not any(
            n in ns for pp, ns in SUPPORTED_GRIDS.items() if p in (None, pp)
        ):
            raise InvalidConfigError(
                f"n={n} is not a supported grid size" + (f" for p={p}" if p else ""), field="n"
            )
        cands = []
        for pp, ns in SUPPORTED_GRIDS.items():
            if p is not None and pp != p:
                continue
            for nn in ns:
                if n is not None and nn != n:
                    continue
                cb = code_bits(pp, nn)
                if cb <= bits + 1e-9:
                    cands.append((cb, pp == 2, pp, nn))
        if not cands:
            lo = min(
                code_bits(pp, min(ns)) for pp, ns in SUPPORTED_GRIDS.items() if p is None or pp == p
            )
            raise InvalidConfigError(
                f"bits={bits:g} is below the smallest supported grid ({lo:g} code bits"
                + (f" with p={p}" if p is not None else "")
                + (f" and n={n}" if n is not None else "")
                + ")",
                field="bits",
            )
        _, _, pp, nn = max(cands)
        return cls(p=pp, n=nn, **kw)

    def matrix_spec(self, grid: tuple[int, int] | None = None) -> MatrixSpec:
        """The MatrixSpec of a layer quantized on `grid` (None: the config's p, n)."""
        p, n = grid if grid is not None else (self.p, self.n)
        return MatrixSpec(
            p, n, self.group_size, self.rotation_block, self.sign_seed, self.scale_rule
        )

    def grid_for(self, name: str) -> tuple[int, int] | None:
        """(p, n) used for layer `name`, or None when an override keeps it in 16 bits."""
        for o in self.overrides:
            if o.name == name:
                return None if o.p == 0 else (o.p, o.n)
        return (self.p, self.n)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip"] = list(self.skip)
        d["formats"] = list(self.formats)
        d["overrides"] = [asdict(o) for o in self.overrides]
        if self.scope == DEFAULT_SCOPE:
            # a linear-only config keeps the exact shape (and artifacts, hashes) it always had
            del d["scope"]
        if self.method == DEFAULT_METHOD:
            del d["method"]  # likewise
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HiggsConfig:
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise InvalidConfigError(f"unknown config fields: {sorted(unknown)}")
        # configs written before these fields existed used no signs and the RMS scale
        d.setdefault("sign_seed", None)
        d.setdefault("scale_rule", "rms")
        d["skip"] = tuple(d.get("skip", ()))
        d["formats"] = tuple(d.get("formats", DEFAULT_FORMATS))
        d["overrides"] = tuple(LayerOverride(**o) for o in d.get("overrides", ()))
        return cls(**d)
