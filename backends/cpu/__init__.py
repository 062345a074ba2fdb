"""What Tessel generates for the host CPU (llvm) beyond the target-neutral lowering rules.

The conv and matmul algorithms and their selection (`algorithms`): weights
packed at compile time (`packing`) for the register-tiled NCHWc conv and
packed matmul (`packed_kernels`), im2col + GEMM (`im2col`), Winograd
(`winograd`; on NCHW[16]c inputs `winograd_blocks`; its weight transform, numpy
alone, `winograd_weights`), the register tile they share (`gemm_tile`), the lowering of a
kernel spec's chosen algorithm (`variants`), and the CPU schedule of every
other kernel (`schedule`). On cuda, conv "im2col" reuses the im2col
computation and leaves its scheduling to dlight (backends/cuda/schedule.py).
"""
