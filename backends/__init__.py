"""Kernel generation: lowering fused groups to Apache TVM for llvm and cuda targets."""
