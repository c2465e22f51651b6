"""Rotating a llama-family checkpoint's residual stream before GGUF conversion.

The model is changed into a mathematically identical one whose weights are easier to quantize
(outliers of a few input columns spread over all of them):

1. Norm folding. Each RMSNorm's weight g goes into the linears that read its output
   (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up, the final norm -> the head):
   W -> W diag(g), and g -> 1.
2. Residual rotation by an orthogonal Q (hidden x hidden). With the residual stream as row
   vectors x -> x Q: the token embedding E -> E Q, every linear that reads the residual
   (q, k, v, gate, up, head) W -> W Q, every linear that writes it (o_proj, down_proj, and their
   biases) W -> Q^T W. An RMSNorm with unit weight commutes with Q (||x Q|| = ||x||), so every
   block sees the same values as before and the logits are unchanged.
3. (per-head V/O, `heads=True`) v_proj's rows of each KV head by R^T and o_proj's columns of
   each attention head by R, R = a randomized Hadamard of head_dim: the attention output of a
   head is a mix of its values, so it comes out multiplied by R and o_proj undoes it.

A tied head is untied: once the final norm is folded into it, it differs from the embedding,
so the rotated checkpoint holds one more vocab x hidden matrix (the file grows by it; the GGUF
run budgets the rotated file against the unrotated one's size).

The rotation. Q = diag(s) (B (x) H_h), with s seeded random +-1 signs, H_h the normalised
Sylvester Hadamard matrix of the largest power of two h dividing hidden, and B a seeded Haar
random orthogonal matrix of the odd rest m = hidden / h (B = [1] when hidden is a power of two:
a plain randomized Hadamard). Hadamard matrices of other orders (576 = 9 * 64 in SmolLM2) exist
only for some sizes and need a table of special constructions; a small dense random block
(Kronecker) keeps what matters: every entry of Q is nonzero and of size about 1/sqrt(hidden), so
each rotated column mixes all the original ones, and applying it costs O(hidden (m + h)) per
row (two small matmuls, the fast path `Rotation.right`; `Rotation.matrix` is the dense float64
reference).

Supported: the decoder-only families whose blocks are exactly pre-norm RMSNorm + attention
(q/k/v/o) + gated MLP (gate/up/down) with the Hugging Face llama tensor names (`ROTATABLE`:
llama, mistral, qwen2). Anything else raises UnsupportedModelError naming the architecture.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from higgs_engine.errors import InvalidConfigError, UnsupportedModelError
from higgs_engine.hadamard import hadamard_matrix

# model_type values whose checkpoints rotate exactly (same block structure, same tensor names)
ROTATABLE = frozenset({"llama", "mistral", "qwen2"})
DEFAULT_SEED = 0

_LAYER = re.compile(r"^(?P<pre>.*layers\.\d+\.)(?P<rest>.+)$")
_READ_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_READ_MLP = ("mlp.gate_proj", "mlp.up_proj")
_WRITE = ("self_attn.o_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def haar_orthogonal(m: int, seed: int) -> torch.Tensor:
    """A seeded Haar-random m x m orthogonal matrix (float64): QR of a Gaussian matrix with the
    signs of R's diagonal moved into Q (so the distribution is uniform)."""
    if m < 1:
        raise InvalidConfigError(f"orthogonal block size {m} must be positive")
    g = torch.Generator().manual_seed(int(seed))
    a = torch.randn(m, m, generator=g, dtype=torch.float64)
    qr: tuple[torch.Tensor, torch.Tensor] = torch.linalg.qr(a)
    q, r = qr
    d = torch.sign(torch.diagonal(r))
    d[d == 0] = 1.0
    return (q * d[None, :]).contiguous()


def seeded_signs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) * 2 - 1).to(torch.float64)


@dataclass(frozen=True)
class Rotation:
    """Q = diag(signs) (block (x) H_h), as in the module docstring; float64."""

    hidden: int
    hadamard: int  # h, a power of two
    block: torch.Tensor  # (m, m) orthogonal, m = hidden / h
    signs: torch.Tensor  # (hidden,) +-1
    seed: int

    @property
    def kind(self) -> str:
        m = self.hidden // self.hadamard
        if m == 1:
            return f"randomized Hadamard {self.hidden}"
        if self.hadamard == 1:
            return f"random orthogonal {m}"
        return f"random orthogonal {m} (x) randomized Hadamard {self.hadamard}"

    def matrix(self) -> torch.Tensor:
        """The dense Q (reference, float64)."""
        kron = torch.kron(self.block, hadamard_matrix(self.hadamard, torch.float64))
        return self.signs[:, None] * kron

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """x Q along the last dim (float64), without forming Q: for a row v = vec(X) of an
        (m, h) matrix X, v (B (x) H) = vec(B^T X H)."""
        if x.shape[-1] != self.hidden:
            raise InvalidConfigError(f"last dim {x.shape[-1]} is not the hidden size {self.hidden}")
        m, h = self.hidden // self.hadamard, self.hadamard
        lead = x.shape[:-1]
        y = (x.to(torch.float64) * self.signs).reshape(-1, m, h)
        if h > 1:
            y = y @ hadamard_matrix(h, torch.float64)
        if m > 1:
            y = torch.matmul(self.block.T, y)
        return y.reshape(*lead, self.hidden)

    def left_t(self, w: torch.Tensor) -> torch.Tensor:
        """Q^T W for W (hidden, k) (a writer's weight), float64."""
        return self.right(w.T).T.contiguous()


def residual_rotation(hidden: int, seed: int = DEFAULT_SEED) -> Rotation:
    """The seeded rotation of a residual stream of width `hidden`."""
    if hidden < 1:
        raise InvalidConfigError(f"hidden size {hidden} must be positive")
    h = _largest_pow2_divisor(hidden)
    m = hidden // h
    return Rotation(
        hidden=hidden,
        hadamard=h,
        block=haar_orthogonal(m, seed + 1) if m > 1 else torch.ones(1, 1, dtype=torch.float64),
        signs=seeded_signs(hidden, seed),
        seed=seed,
    )


def head_rotation(head_dim: int, seed: int = DEFAULT_SEED) -> torch.Tensor | None:
    """R (head_dim x head_dim) for the per-head V/O rotation: a randomized Hadamard
    diag(s) H_d when head_dim is a power of two, else None (no per-head rotation)."""
    if head_dim < 2 or head_dim & (head_dim - 1):
        return None
    return seeded_signs(head_dim, seed + 2)[:, None] * hadamard_matrix(head_dim, torch.float64)


# ---------------------------------------------------------------------------------------------
# The model's shapes and the plan of what happens to every tensor
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotationPlan:
    """Everything the per-tensor transform needs, from the checkpoint's config and norms."""

    rotation: Rotation
    head: torch.Tensor | None  # R of the per-head V/O rotation, or None
    head_dim: int
    tied: bool
    norms: Mapping[str, torch.Tensor]  # "<layer prefix>input_layernorm" / ... / "final" -> g
    embed_key: str
    head_key: str
    final_norm_key: str

    def describe(self) -> dict[str, Any]:
        return {
            "rotation": self.rotation.kind,
            "seed": self.rotation.seed,
            "per_head_vo": self.head is not None,
            "untied_head": self.tied,
        }


def check_rotatable(config: Any) -> None:
    """UnsupportedModelError unless `config` (an HF config or its dict) is a family the
    residual rotation handles exactly."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    mt = get("model_type")
    archs = get("architectures") or []
    if mt not in ROTATABLE:
        raise UnsupportedModelError(
            f"rotation applies to llama-family decoders ({', '.join(sorted(ROTATABLE))}); "
            f"this checkpoint is {archs[0] if archs else mt!r} (model_type {mt!r})"
        )


def _cfg_dims(cfg: Mapping[str, Any]) -> tuple[int, int]:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return hidden, head_dim


def make_plan(
    cfg: Mapping[str, Any],
    keys: set[str],
    norm_of: Any,
    *,
    seed: int = DEFAULT_SEED,
    heads: bool = True,
) -> RotationPlan:
    """The plan for a checkpoint with config dict `cfg`, tensor names `keys`; `norm_of(key)`
    returns a norm's weight."""
    check_rotatable(dict(cfg))
    hidden, head_dim = _cfg_dims(cfg)
    embed = next((k for k in sorted(keys) if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise UnsupportedModelError("the checkpoint has no embed_tokens.weight to rotate")
    head_key = "lm_head.weight"
    tied = head_key not in keys or bool(cfg.get("tie_word_embeddings", False))
    norms: dict[str, torch.Tensor] = {}
    for k in keys:
        m = _LAYER.match(k)
        if m is not None and m["rest"] in tuple(n + ".weight" for n in _NORMS):
            norms[m["pre"] + m["rest"].removesuffix(".weight")] = norm_of(k).to(torch.float64)
    final = embed.removesuffix("embed_tokens.weight") + "norm.weight"
    if final not in keys:
        raise UnsupportedModelError(f"the checkpoint has no final norm {final!r}")
    norms["final"] = norm_of(final).to(torch.float64)
    return RotationPlan(
        rotation=residual_rotation(hidden, seed),
        head=head_rotation(head_dim, seed) if heads else None,
        head_dim=head_dim,
        tied=tied,
        norms=norms,
        embed_key=embed,
        head_key=head_key,
        final_norm_key=final,
    )


def _per_head_rows(w: torch.Tensor, r: torch.Tensor, d: int) -> torch.Tensor:
    """Each head's d rows (or d entries of a bias) by R^T."""
    lead = w.shape[1:]
    blocks = w.reshape(-1, d, *lead)
    return torch.einsum("ji,hj...->hi...", r, blocks).reshape(w.shape)


def _per_head_cols(w: torch.Tensor, r: torch.Tensor, d: int) -> torch.Tensor:
    """Each head's d columns by R."""
    rows = w.shape[0]
    return (w.reshape(rows, -1, d) @ r).reshape(w.shape)


def transform(plan: RotationPlan, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rotated tensor(s) for one checkpoint tensor, float64 ({} drops it; the embedding of
    a tied model also yields the head)."""
    rot = plan.rotation
    x = t.to(torch.float64)
    if key == plan.embed_key:
        out = {key: rot.right(x)}
        if plan.tied:
            out[plan.head_key] = rot.right(x * plan.norms["final"][None, :])
        return out
    if key == plan.head_key:
        if plan.tied:
            return {}  # written from the embedding
        return {key: rot.right(x * plan.norms["final"][None, :])}
    if key == plan.final_norm_key:
        return {key: torch.ones_like(x)}
    m = _LAYER.match(key)
    if m is None:
        if key.endswith("rotary_emb.inv_freq"):
            return {key: x}
        raise UnsupportedModelError(f"rotation does not know what to do with tensor {key!r}")
    pre, rest = m["pre"], m["rest"]
    module, _, kind = rest.rpartition(".")
    if module in _NORMS and kind == "weight":
        return {key: torch.ones_like(x)}
    if module in _READ_ATTN + _READ_MLP:
        if kind == "bias":
            if module == "self_attn.v_proj" and plan.head is not None:
                return {key: _per_head_rows(x, plan.head, plan.head_dim)}
            return {key: x}
        g = plan.norms[
            pre + ("input_layernorm" if module in _READ_ATTN else "post_attention_layernorm")
        ]
        w = rot.right(x * g[None, :])
        if module == "self_attn.v_proj" and plan.head is not None:
            w = _per_head_rows(w, plan.head, plan.head_dim)
        return {key: w}
    if module in _WRITE:
        if kind == "bias":
            return {key: rot.right(x)}
        if module == "self_attn.o_proj" and plan.head is not None:
            x = _per_head_cols(x, plan.head, plan.head_dim)
        return {key: rot.left_t(x)}
    if rest.endswith("rotary_emb.inv_freq"):
        return {key: x}
    raise UnsupportedModelError(f"rotation does not know what to do with tensor {key!r}")


def rotate_state_dict(
    state: Mapping[str, torch.Tensor],
    cfg: Mapping[str, Any],
    *,
    seed: int = DEFAULT_SEED,
    heads: bool = True,
) -> dict[str, torch.Tensor]:
    """The rotated model's tensors (float64) from an in-memory state dict; load them into a
    model built from `untied_config(cfg)`."""
    keys = set(state)  # a tied model's state dict may list the shared head: it is skipped
    plan = make_plan(cfg, keys, lambda k: state[k], seed=seed, heads=heads)
    out: dict[str, torch.Tensor] = {}
    for k in sorted(keys):
        out.update(transform(plan, k, state[k]))
    return out


def untied_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(cfg)
    out["tie_word_embeddings"] = False
    return out


# ---------------------------------------------------------------------------------------------
# Writing a rotated checkpoint directory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotatedCheckpoint:
    path: Path
    outtype: str  # the converter's --outtype giving the same 16-bit type as the source's
    plan: dict[str, Any]
    added_params: int  # parameters the untied head adds


def _transform_rows(
    plan: RotationPlan, key: str, t: torch.Tensor, row_chunk: int
) -> dict[str, torch.Tensor]:
    """`transform` as float32; the embedding and the head (rows independent, the largest
    tensors) `row_chunk` rows at a time, so that no float64 copy of a whole vocab matrix is
    ever made."""
    if key not in (plan.embed_key, plan.head_key) or t.shape[0] <= row_chunk:
        return {n: y.to(torch.float32) for n, y in transform(plan, key, t).items()}
    parts: dict[str, list[torch.Tensor]] = {}
    for i in range(0, t.shape[0], row_chunk):
        for n, y in transform(plan, key, t[i : i + row_chunk]).items():
            parts.setdefault(n, []).append(y.to(torch.float32))
    return {n: torch.cat(v) for n, v in parts.items()}


def write_rotated_checkpoint(
    src: Path,
    dst: Path,
    *,
    seed: int = DEFAULT_SEED,
    heads: bool = True,
    row_chunk: int = 8192,
) -> RotatedCheckpoint:
    """Write the rotated model of the HF checkpoint `src` to the directory `dst`: one
    model.safetensors (float32; one tensor in memory at a time, the embedding and head in
    chunks of `row_chunk` rows), the config with the head untied, every other file (tokenizer,
    chat template, generation config) copied."""
    from higgs_engine.safetensors_stream import CheckpointReader, StreamingSafetensorsWriter

    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    check_rotatable(cfg)
    dst.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(src) as reader:
        keys = set(reader.keys())
        plan = make_plan(cfg, keys, reader.get, seed=seed, heads=heads)
        dtypes = {str(reader.get(plan.embed_key).dtype)}
        writer = StreamingSafetensorsWriter(dst / "model.safetensors", {"format": "pt"})
        try:
            for k in sorted(keys):
                for name, t in _transform_rows(plan, k, reader.get(k), row_chunk).items():
                    writer.add(name, t.contiguous())
            writer.close()
        except BaseException:
            writer.abort()
            raise
        added = reader.numel(plan.embed_key) if plan.tied else 0
    for f in sorted(src.iterdir()):
        if (
            f.is_file()
            and not f.name.startswith(".")
            and not f.name.endswith(".safetensors")
            and f.name not in ("config.json", "model.safetensors.index.json")
            and not f.name.endswith((".bin", ".pt", ".pth", ".gguf"))
        ):
            shutil.copy2(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(untied_config(cfg), indent=2), encoding="utf-8")
    outtype = "bf16" if "torch.bfloat16" in dtypes else "auto"
    return RotatedCheckpoint(dst, outtype, plan.describe(), added)


def rotation_error(q: torch.Tensor) -> float:
    """max |Q^T Q - I| (a check of orthogonality)."""
    eye = torch.eye(q.shape[0], dtype=q.dtype)
    return float((q.T @ q - eye).abs().max()) if q.numel() else math.nan


def rotated_alphas(alphas: Mapping[str, float], *, untied: bool) -> dict[str, float]:
    """The profile alphas ({HF module name: alpha}, measured on the unrotated model) for the
    rotated one. A rotation maps isotropic relative noise to the same relative noise, so each
    tensor keeps its alpha. A head that the rotation untied has no entry of its own: the tied
    tensor's alpha covers both uses (the Fisher of a shared weight sums them), and each of the
    two rotated tensors gets all of it (an upper bound for either, so the rotated file's
    prediction errs on the pessimistic side)."""
    out = dict(alphas)
    if untied and "lm_head" not in out:
        emb = next((k for k in sorted(out) if k.endswith("embed_tokens")), None)
        if emb is not None:
            out["lm_head"] = out[emb]
    return out
