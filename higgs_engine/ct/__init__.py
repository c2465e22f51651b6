"""The compressed-tensors format (what vLLM, SGLang and transformers load): the engine core.

schemes    the per-layer schemes vLLM's kernels run (int4 groups, int8, FP8, 16-bit), which
           fit a layer's shape, and the bits each stores (torch-free)
quantizer  one layer's codes, scales and zero points, scales by MSE search (fast path and
           its reference twin)
writer     the checkpoint: our codes stored by the compressed-tensors library's compressors,
           its QuantizationConfig in config.json, the tokenizer files copied
plan       each layer's t^2 per scheme, and the allocator's choice of schemes for a budget
"""
