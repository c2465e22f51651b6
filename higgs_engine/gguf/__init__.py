"""GGUF files for llama.cpp: llama.cpp's converter and quantizer driven by the engine's
allocator (one llama.cpp type per tensor), and evaluation in llama.cpp itself.

convert   llama.cpp's converter (HF checkpoint -> 16-bit GGUF), its architecture list
llama     llama.cpp through llama-cpp-python: row kernels, llama_model_quantize, running a model
plan      t^2 per tensor and type, profile alphas per tensor, the DP allocation
rotate    norm folding and a residual-stream rotation fused into a llama-family checkpoint
evaluate  perplexity / KL (1 - cos for encoders) in llama.cpp against the 16-bit file
runplan   the run planned as data: plan_gguf -> GgufPlan (validated, JSON), the rotation's
          candidates and their pick
run       the plan run: run_gguf_plan(plan, out, progress, context) -> Report
"""
