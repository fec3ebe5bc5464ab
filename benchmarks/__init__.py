"""Benchmark suite: one entry point (`python -m benchmarks.run`) that runs each case in its own process.

The parent side (run, report, cases, models, bounds) imports no torch, so it never creates a CUDA
context that would sit in GPU memory beside the cases it measures; only `benchmarks.worker` does.
"""
