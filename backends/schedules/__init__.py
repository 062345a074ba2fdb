"""Schedules: how each target's kernels are tiled, parallelized and vectorized."""
