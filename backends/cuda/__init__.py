"""What Tessel generates for NVIDIA GPUs (cuda:sm_XX) beyond the target-neutral lowering rules.

Kernels are scheduled by dlight's GPU rules and compiled with nvcc
(`schedule`); the exported library carries the nvcc binary instead of the
CUDA source (`binary`), so it launches on a GPU machine without a compiler.
"""
