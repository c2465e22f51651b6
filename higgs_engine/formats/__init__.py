"""Artifact formats: one FormatWriter per format, and the registry `FORMATS` of them.

    base         the FormatWriter interface (name, whether it carries the grids shard, shards
                 per assembled artifact, add a plain tensor, add a quantized layer, finish,
                 abort) and what every format's small files share (config.json, tokenizers)
    native       HIGGS codes + scales + grids, quantization_config (loaded as HiggsLinear)
    dequantized  an ordinary 16-bit checkpoint of W_hat (stock transformers loads it)

A run (higgs_engine.pipeline) or one part of a sharded run (higgs_engine.parts) streams every
tensor through higgs_engine.artifacts.ArtifactWriter, which fans it out to the writers of the
formats its config names; the assembly of parts asks the same classes how many shards a format
has and writes their small files. Format names are defined once, torch-free, in
higgs_engine.planning.config (`WriterFormat`, whose names HiggsConfig and the API accept); the
registry is keyed by each writer's `name`, typed as one of them. Adding a format: its name in
`WriterFormat`, a module here with a FormatWriter subclass, and the class in `_WRITERS`
(tests/engine/test_registries.py checks that every name has its writer).

GGUF is not a FormatWriter. A GGUF file is produced whole by llama.cpp (higgs_engine/gguf/):
its converter turns the 16-bit checkpoint into a GGUF of llama.cpp's own tensor names, layouts
and metadata (architecture, tokenizer, chat template), then llama.cpp's quantizer chooses its
own block types per tensor from a whole-file allocation measured on that converted file. None
of it sees the HIGGS codes of a streamed layer, and neither step can take tensors one at a time
from the quantizing stream, so GGUF stays a separate whole-file path
(higgs_engine.gguf.run.run_gguf_plan, the CLI's and the service's `gguf` format).
"""

from __future__ import annotations

from higgs_engine.errors import InvalidConfigError
from higgs_engine.formats.base import FormatWriter
from higgs_engine.formats.dequantized import DequantizedWriter
from higgs_engine.formats.native import NativeWriter

__all__ = ["FORMATS", "FormatWriter", "format_writer"]

_WRITERS: tuple[type[FormatWriter], ...] = (NativeWriter, DequantizedWriter)
# name -> writer class (the class is the factory: cls(fmt_dir, dtype, source_dir)).
FORMATS: dict[str, type[FormatWriter]] = {w.name: w for w in _WRITERS}


def format_writer(name: str) -> type[FormatWriter]:
    """The writer class of format `name` (InvalidConfigError naming it when unknown)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise InvalidConfigError(
            f"format {name!r} is not one of {sorted(FORMATS)}", field="formats"
        ) from None
