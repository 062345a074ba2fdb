"""The blocks of an implicit-GEMM conv (cuda/conv.py) and the schedule pieces its SIMT and tensor-core tiles share."""
from __future__ import annotations

# Block names of the anchor (backends/lower.py folds every other block of a fused kernel into them).
GEMM_BLOCK, PARTIAL_BLOCK, COLUMN_BLOCK, WEIGHT_BLOCK = "conv_gemm", "conv_gemm_partial", "conv_columns", "conv_weights"


def fold_consumers(sch, block) -> None:
    """Inline every op after `block` into it, as far as each can be (an op whose result is also a kernel output,
    or that reads several values of `block`, stays a block of its own)."""
    progress = True
    while progress:
        progress = False
        for consumer in sch.get_consumers(block):
            try:
                sch.reverse_compute_inline(consumer)
                progress = True
            except Exception:  # noqa: BLE001 - TVM refuses an inline it cannot prove right; that block stays
                continue


def read_index(sch, block, name: str) -> int:
    """Which of `block`'s reads is the buffer that block `name` writes."""
    buffer = sch.get(sch.get_sblock(name)).writes[0].source
    return next(k for k, region in enumerate(sch.get(block).reads) if region.source.same_as(buffer))


def schedule_sum(sch, block) -> None:
    """The split-K sum (and the epilogue folded into it): one thread per output element."""
    local = sch.cache_write(block, 0, "local")
    fold_consumers(sch, local)
    i, j, _ = sch.get_loops(block)
    blocks, threads = sch.split(sch.fuse(i, j), [None, 256])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")
    sch.reverse_compute_at(local, threads)
