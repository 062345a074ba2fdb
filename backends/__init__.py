"""Kernel generation: lowering fused groups to Apache TVM for llvm and cuda targets.

Target-neutral here: kernel specs (`kernel`), their lowering and builds (`lower`), the build workers
(`builder`, `build_worker`), the kernel cache (`cache`), targets (`target`),
TVM's import (`tvm_env`), micro-batch re-sizing (`micro_batch`) and the
lowering rules of the ONNX ops (`lowering/`). What one target adds lives in
`cpu/` (conv/matmul algorithms, packing, Winograd, CPU schedules) and `cuda/`
(GPU schedules, nvcc binaries).
"""
