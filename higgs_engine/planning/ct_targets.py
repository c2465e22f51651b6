"""What a compressed-tensors job may ask for, torch-free (the API checks a request with it; the
engine's higgs_engine.ct holds the schemes themselves).

    CT_BITS           target.bits / --bits: 4 (int4 symmetric W4A16) or 8 (int8 per channel)
    CT_DTYPES         the checkpoint's 16-bit dtype
    CT_MIN_AVG_BITS   the cheapest scheme's bits per weight: int4 with one float16 scale per
                      group of 128 (4 + 16/128); no avg_bits below it can be met
    CT_MAX_AVG_BITS   16-bit layers (above it every layer is kept)
    CONV1D_ARCHITECTURES
                      models whose linear layers are GPT-2 Conv1D modules, which neither
                      compressed-tensors nor vLLM quantize: such a job would write nothing
                      quantized, so it is refused
"""

from __future__ import annotations

__all__ = [
    "CONV1D_ARCHITECTURES",
    "CT_BITS",
    "CT_DTYPES",
    "CT_FORMAT",
    "CT_MAX_AVG_BITS",
    "CT_MIN_AVG_BITS",
    "ct_architecture_problem",
]

CT_FORMAT = "compressed-tensors"
CT_BITS = (4, 8)
CT_DTYPES = ("float16", "bfloat16")
CT_MIN_AVG_BITS = 4 + 16 / 128
CT_MAX_AVG_BITS = 16.0
CONV1D_ARCHITECTURES = frozenset(
    {
        "GPT2LMHeadModel",
        "GPT2Model",
        "GPT2DoubleHeadsModel",
        "OpenAIGPTLMHeadModel",
        "OpenAIGPTModel",
        "ImageGPTForCausalImageModeling",
    }
)
# What transformers' model classes end with when from_pretrained builds them from config.json.
_LOADABLE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "Model", "ForConditionalGeneration")


def ct_architecture_problem(architecture: str) -> str | None:
    """Why a model of `architecture` (config.json's first `architectures` entry) cannot be a
    compressed-tensors checkpoint transformers loads, or None when it can be tried."""
    if architecture in CONV1D_ARCHITECTURES:
        return (
            f"{architecture} keeps its linear layers in GPT-2 Conv1D modules, which "
            "compressed-tensors and vLLM do not quantize"
        )
    if not architecture.endswith(_LOADABLE_SUFFIXES):
        return f"transformers has no model class {architecture} to load the checkpoint with"
    return None
