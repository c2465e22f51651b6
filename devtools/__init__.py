"""Development-only helpers shared by the tests and the benchmarks: throwaway PostgreSQL
databases (scratch), real service processes (stack) and the quality evaluation of quantized
models (quality). Neither the installed package nor any image contains this package."""
