"""Benchmarks of the library's hot paths, runnable as modules (`python -m
replay_pipeline.benchmarks.buffer`). They build what they measure in a temporary directory,
print the figures, and delete it."""
