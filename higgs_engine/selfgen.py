"""Self-generated text: a data-free token source sampled from the model itself.

Sensitivity profiles and calibration want inputs that produce the activations the model sees in
use. Uniform random tokens never do (no real sequence looks like them); text the model writes
itself does, without asking the user for any data. `self_generated_tokens` samples `count`
sequences of `length` token ids:

- each sequence starts from the model's BOS token (its EOS token when it has no BOS, token 0
  when it has neither), followed by one of a handful of neutral English prompts (``PROMPTS``)
  when a tokenizer is given, so the sequences do not all open the same way;
- every next token is drawn from the model's distribution at temperature ``temperature``
  (default 1.0: the model's own distribution, which is what a KL / Fisher profile measures),
  restricted to the nucleus of cumulative probability ``top_p`` (default 0.95: the long tail of
  unlikely tokens, where sampling errors would derail a small model, is cut);
- every sequence samples from its own ``torch.Generator``, seeded by ``seed`` and the
  sequence's index: the same model, seed and settings give the same token ids whatever the
  batch, and the global torch RNG is left untouched;
- an EOS token in the middle of a sequence is kept and sampling goes on (the model then starts
  a new document), so every sequence has exactly `length` tokens;
- up to ``batch`` sequences are sampled together (default 16, the default profile's documents
  in one batch), one incremental forward step per token for the whole batch with the model's
  key/value cache (only the newest token is fed after the openings): openings of different
  lengths are left-padded and masked, and each sequence's positions count from its own first
  token, so padding changes nothing but rounding;
- a row's nucleus is cut from its top 1024 probabilities when they already hold ``top_p`` of
  the mass (only the other rows sort the whole vocabulary): the same nucleus as a full sort,
  at a fraction of its cost.

`self_generated_tokens_reference` is the earlier path, kept as a slow twin for tests and
benchmarks: one generator for all sequences, ``batch`` at a time, a full sort per step. With a
nucleus so small that sampling is greedy both give the same tokens.

`cached_self_tokens` stores the result as safetensors under a cache directory the caller passes,
keyed by the model's revision or content fingerprint and every sampling setting: generating
costs about `length` incremental forward steps per batch once; later calls read the file.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.progress import ProgressCallback, report

if TYPE_CHECKING:
    import torch
    from torch import nn

SELFGEN_VERSION = 3  # 3: a generator per sequence, nucleus from a top-k
NUCLEUS_TOP_K = 1024  # probabilities tried before a full sort of the vocabulary

# Neutral openings (no topic, no instruction) that vary how sequences begin.
PROMPTS: tuple[str, ...] = (
    "The",
    "In",
    "It was",
    "A",
    "This",
    "When",
    "There are",
    "One of the",
)


@dataclass(frozen=True)
class SelfGenConfig:
    """How self-generated text is sampled. Everything that changes the tokens is in here."""

    count: int = 8  # sequences
    length: int = 512  # tokens per sequence, BOS and prompt included
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    prompts: bool = True  # start after BOS with one of PROMPTS (needs a tokenizer)
    batch: int = 16  # sequences sampled together (memory: one batch's key/value cache)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidConfigError(f"count={self.count} must be at least 1 sequence")
        if self.length < 2:
            raise InvalidConfigError(f"length={self.length} must be at least 2 tokens")
        if not (self.temperature > 0 and self.temperature < 100):
            raise InvalidConfigError(f"temperature={self.temperature} must be in (0, 100)")
        if not (0 < self.top_p <= 1):
            raise InvalidConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.batch < 1:
            raise InvalidConfigError(f"batch={self.batch} must be at least 1 sequence")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def start_token(model: nn.Module, tokenizer: Any = None) -> int:
    """BOS id of the model (tokenizer first, then config); EOS when there is none; else 0."""
    cfg: Any = getattr(model, "config", None)
    for owner in (tokenizer, cfg):
        for attr in ("bos_token_id", "eos_token_id"):
            v = getattr(owner, attr, None) if owner is not None else None
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int) and v >= 0:
                return v
    return 0


def _starts(model: nn.Module, tokenizer: Any, config: SelfGenConfig) -> list[list[int]]:
    """The opening token ids of each sequence (BOS, then a prompt when there is a tokenizer)."""
    bos = start_token(model, tokenizer)
    out = []
    for i in range(config.count):
        ids = [bos]
        if config.prompts and tokenizer is not None:
            ids += list(tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False))
        out.append(ids[: config.length])
    return out


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """One token per row of logits (rows, vocab) by temperature + nucleus (top-p) sampling."""
    import torch

    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (rows, vocab)
    if top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sp.cumsum(-1) - sp) >= top_p
        sp = sp.masked_fill(drop, 0.0)
        pick = torch.multinomial(sp, 1, generator=generator)  # (rows, 1) index into sorted
        return idx.gather(-1, pick).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _nucleus_top(probs: torch.Tensor, top_p: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row of probs (rows, vocab): the nucleus's probabilities, descending, and their token
    ids. A row whose top 1024 already hold top_p of the mass keeps just
    those (everything past them would be dropped anyway); only the others sort the whole
    vocabulary (together)."""
    k = min(NUCLEUS_TOP_K, int(probs.shape[-1]))
    top, top_idx = probs.topk(k, dim=-1, sorted=True)
    short = [r for r, ok in enumerate((top.sum(-1) >= top_p).tolist()) if not ok]
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if short:
        fsp, fidx = probs[short].sort(dim=-1, descending=True)
        full = {r: (fsp[i], fidx[i]) for i, r in enumerate(short)}
    out = []
    for r in range(int(probs.shape[0])):
        sp, idx = full.get(r, (top[r], top_idx[r]))
        keep = int(((sp.cumsum(-1) - sp) < top_p).sum())  # the nucleus is a prefix
        out.append((sp[:keep], idx[:keep]))
    return out


def sample_rows(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """One token per row of logits (rows, vocab), row r drawn with generators[r]: the
    distribution of `sample_next` (temperature + nucleus), each row from its own stream."""
    import torch

    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (rows, vocab)
    if top_p >= 1.0:
        picks = [torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)]
        return torch.cat(picks)
    rows = _nucleus_top(probs, top_p)
    picks = [
        idx[torch.multinomial(sp, 1, generator=g)]
        for (sp, idx), g in zip(rows, generators, strict=True)
    ]
    return torch.cat(picks)


def sequence_generator(seed: int, index: int) -> torch.Generator:
    """The random stream of sequence `index` for `seed` (independent of the batch)."""
    import torch

    digest = hashlib.sha256(f"selfgen:{int(seed)}:{int(index)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def self_generated_tokens(
    model: nn.Module,
    tokenizer: Any = None,
    config: SelfGenConfig | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """(count, length) int64 token ids sampled from `model` (see the module docstring).

    Sequences are sampled `config.batch` at a time with the model's key/value cache, so memory
    is one batch's cache. Progress: stage "generating", tokens done of count * length."""
    import torch

    config = config or SelfGenConfig()
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    out = torch.empty(config.count, config.length, dtype=torch.int64)
    starts = _starts(model, tokenizer, config)
    total = config.count * config.length
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            report(progress, "generating", 0, total)
            for first in range(0, config.count, config.batch):
                rows = starts[first : first + config.batch]
                gens = [sequence_generator(config.seed, first + r) for r in range(len(rows))]
                lens = [len(s) for s in rows]
                before = first * config.length

                def draw(logits: torch.Tensor, gens: list[torch.Generator] = gens) -> torch.Tensor:
                    return sample_rows(logits, config.temperature, config.top_p, gens)

                def step(k: int, lens: list[int] = lens, before: int = before) -> None:
                    done = sum(min(config.length, n + k + 1) for n in lens)
                    report(progress, "generating", before + done, total)

                out[first : first + len(rows)] = _sample_batch(
                    model, rows, config, vocab, draw, step
                )
    finally:
        model.train(was_training)
    return out


def self_generated_tokens_reference(
    model: nn.Module,
    tokenizer: Any = None,
    config: SelfGenConfig | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """The earlier sampling path, kept as the slow twin of `self_generated_tokens`: one
    generator seeded by `config.seed` for every sequence (so the batch size decides the order
    of the random draws), a full sort of the vocabulary per step, progress per batch of
    sequences. Same distribution; with a greedy nucleus, the same tokens."""
    import torch

    config = config or SelfGenConfig()
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    gen = torch.Generator().manual_seed(int(config.seed))
    out = torch.empty(config.count, config.length, dtype=torch.int64)
    starts = _starts(model, tokenizer, config)

    def draw(logits: torch.Tensor) -> torch.Tensor:
        return sample_next(logits, config.temperature, config.top_p, gen)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for first in range(0, config.count, config.batch):
                rows = starts[first : first + config.batch]
                out[first : first + len(rows)] = _sample_batch(model, rows, config, vocab, draw)
                total = config.count * config.length  # tokens, as the fast path counts
                report(progress, "generating", (first + len(rows)) * config.length, total)
    finally:
        model.train(was_training)
    return out


def _sample_batch(
    model: nn.Module,
    starts: list[list[int]],
    config: SelfGenConfig,
    vocab: int,
    draw: Callable[[torch.Tensor], torch.Tensor],
    on_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """(len(starts), length) ids: the openings left-padded to one length, then one step per
    token for the whole batch (attention mask and per-row positions hide the padding); `draw`
    turns the last logits (rows, vocab) into the next tokens (rows,)."""
    import torch

    rows = len(starts)
    width = max(len(s) for s in starts)
    ids = torch.zeros(rows, width, dtype=torch.int64)
    mask = torch.zeros(rows, width, dtype=torch.int64)
    for r, s in enumerate(starts):
        ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.int64)
        mask[r, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # The model runs where its weights are (the CPU or an accelerator); sampling stays on the
    # CPU with the CPU generators, so a device changes the logits only by rounding.
    dev = next(model.parameters()).device
    ids, mask, positions = ids.to(dev), mask.to(dev), positions.to(dev)
    # transformers renamed the key/value cache argument past_key_values -> cache
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    # Left padding aligns the openings' ends: after the first step every row has consumed its
    # whole opening, and row r's k-th sampled token is its token len(start_r) + k.
    steps = config.length - min(len(s) for s in starts)
    sampled = torch.zeros(rows, steps, dtype=torch.int64)
    step_in, step_pos, past = ids, positions, None
    for k in range(steps):
        res = model(
            input_ids=step_in,
            attention_mask=mask,
            position_ids=step_pos,
            use_cache=True,
            **{cache_kw: past},
        )
        past = getattr(res, "cache", None)
        if past is None:
            past = res.past_key_values
        logits = res.logits[:, -1, :].float().cpu()  # (rows, vocab')
        if vocab and logits.shape[-1] > vocab:
            logits = logits[:, :vocab]  # padded embedding rows are not tokens
        nxt = draw(logits)  # (rows,)
        sampled[:, k] = nxt
        if on_step is not None:
            on_step(k)
        step_in = nxt.view(rows, 1).to(dev)
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=dev)], dim=1)
    out = torch.empty(rows, config.length, dtype=torch.int64)
    for r, s in enumerate(starts):
        out[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
        out[r, len(s) :] = sampled[r, : config.length - len(s)]
    return out


def selfgen_key(model_revision: str, config: SelfGenConfig) -> str:
    """Cache key: the model's revision (or content fingerprint) and every sampling setting."""
    blob = json.dumps(
        {"revision": model_revision, "config": config.to_dict(), "version": SELFGEN_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def selfgen_id(model_revision: str, config: SelfGenConfig) -> str:
    """How a profile or report names this token source: "self:<key>"."""
    return "self:" + selfgen_key(model_revision, config)


def selfgen_cache_path(cache_dir: Path, model_revision: str, config: SelfGenConfig) -> Path:
    return Path(cache_dir) / f"selfgen-{selfgen_key(model_revision, config)}.safetensors"


def _load(path: Path, config: SelfGenConfig) -> torch.Tensor | None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))["tokens"]
    except (OSError, KeyError, SafetensorError):
        return None  # a broken cache file is regenerated, never trusted
    if tuple(t.shape) != (config.count, config.length):
        return None
    return t.to(torch.int64)


def cached_self_tokens(
    model: nn.Module,
    tokenizer: Any,
    model_revision: str,
    cache_dir: Path | None,
    config: SelfGenConfig | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """`self_generated_tokens`, read from / written to `cache_dir` (None = no cache).

    `model_revision` names the weights (a hub commit or a local content fingerprint): a new
    revision gets new text. The file is written atomically."""
    import torch
    from safetensors.torch import save_file

    config = config or SelfGenConfig()
    if not model_revision:
        raise InvalidConfigError("model_revision must name the model's weights (empty string)")
    path = selfgen_cache_path(cache_dir, model_revision, config) if cache_dir else None
    if path is not None and path.is_file():
        hit = _load(path, config)
        if hit is not None:
            report(
                progress, "generating", config.count * config.length, config.count * config.length
            )
            return hit
    toks = self_generated_tokens(model, tokenizer, config, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(
            {"tokens": toks.to(torch.int64).contiguous()},
            str(tmp),
            metadata={"revision": model_revision, "config": json.dumps(config.to_dict())},
        )
        tmp.replace(path)
    return toks


def windows_from_sequences(tokens: torch.Tensor, windows: int, context: int) -> torch.Tensor:
    """(windows, context) from self-generated sequences of at least `context` tokens each."""
    if tokens.dim() != 2 or tokens.shape[0] < windows or tokens.shape[1] < context:
        raise InvalidConfigError(
            f"self-generated tokens of shape {tuple(tokens.shape)} cannot give {windows} "
            f"windows of {context} tokens"
        )
    return tokens[:windows, :context].contiguous()


__all__: Sequence[str] = (
    "PROMPTS",
    "SelfGenConfig",
    "cached_self_tokens",
    "sample_next",
    "sample_rows",
    "self_generated_tokens",
    "self_generated_tokens_reference",
    "selfgen_cache_path",
    "selfgen_id",
    "selfgen_key",
    "sequence_generator",
    "start_token",
    "windows_from_sequences",
)
