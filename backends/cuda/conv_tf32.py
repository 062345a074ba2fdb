"""The implicit-GEMM conv (cuda/conv.py) on tensor cores: TF32 inputs, float32 accumulation.

A thread block computes a BM x BN tile of the partial products in K-steps of
BK: its weights and columns are staged in shared memory (rows padded so that
the lanes of a fragment load hit 32 different banks), every warp owns a
(BM / warps_m) x (BN / warps_n) part of the tile as 16 x 16 accumulator
fragments, and each 8-wide slice of a K-step is two `mma.sync.m16n8k8` per
fragment pair (cuda/mma.py). The fragments are written to the partial-product
buffer, and the split-K sum kernel runs the epilogue (the bias and the ops
fused after the conv), as for a padded SIMT GEMM.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from . import mma
from .conv_blocks import COLUMN_BLOCK, GEMM_BLOCK, PARTIAL_BLOCK, WEIGHT_BLOCK, read_index, schedule_sum

# Row strides (floats) that spread a fragment load's 32 lanes over the 32 banks, as (factor, offset): stride =
# offset modulo factor. A's lanes read 8 rows x 4 columns (a stride of 4 modulo 8 puts the rows 4 banks apart),
# B's 4 rows x 8 columns (8 modulo 16: 8 banks apart).
WEIGHT_ROW_ALIGN, COLUMN_ROW_ALIGN = (8, 4), (16, 8)
# The multiprocessors of the GPUs the heuristic sizes the grid for (H100 SXM: 132).
DEFAULT_SM_COUNT = 132
# Static shared memory of one block (CUDA's limit without an opt-in to more, which TVM's launcher does not make).
SHARED_LIMIT_BYTES = 48 * 1024


@dataclass(frozen=True)
class MmaConfig:
    """One thread block computes a BM x BN tile in K-steps of BK with warps_m x warps_n warps (each a multiple of
    16 x 16 of the tile); `split_k` blocks share one tile's K range."""

    bm: int = 64
    bn: int = 64
    bk: int = 16
    warps_m: int = 2
    warps_n: int = 2
    split_k: int = 1
    stages: int = 1  # 2: the next K-step's tiles are fetched into a second shared buffer while this one computes

    def __post_init__(self) -> None:
        if self.bm % (16 * self.warps_m) or self.bn % (16 * self.warps_n) or self.bk % 8:
            raise ValueError(f"{self}: each warp's tile must be whole 16 x 16 fragments and BK a multiple of 8")

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        """Shared memory of one block: its weight and column tiles (rows padded), once per stage."""
        weight_row, column_row = _aligned(self.bk, *WEIGHT_ROW_ALIGN), _aligned(self.bn, *COLUMN_ROW_ALIGN)
        return 4 * self.stages * (self.bm * weight_row + self.bk * column_row)

    @property
    def fits(self) -> bool:
        """Whether a block of this configuration can launch (threads and shared memory within CUDA's limits)."""
        return self.threads <= 1024 and self.shared_bytes <= SHARED_LIMIT_BYTES

    def to_json(self) -> dict[str, int]:
        """The configuration as a JSON object."""
        return asdict(self)


def heuristic_mma_config(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT) -> MmaConfig:
    """A tile configuration for an M x N x K product when none was timed.

    What timing ResNet-18's shapes on an H200 found best at batch 16: the
    largest tile (up to 128 x 128) with eight warps, and K split until the grid
    holds about 1.4 waves of blocks, as long as each split keeps at
    least 16 K-steps (small tiles or unsplit long Ks were up to 8x slower).
    """
    bm = 128 if m >= 128 else 64 if m >= 64 else 32
    bn = 128 if n >= 128 else 64 if n >= 64 else 32
    warps_m, warps_n = (2, 4) if bm == bn == 128 else (bm // 32, bn // 32)
    config = MmaConfig(bm, bn, 16, warps_m, warps_n)
    split = 1
    while _blocks(m, n, config) * split < 1.4 * sm_count and k // (config.bk * split * 2) >= 16:
        split *= 2
    return replace(config, split_k=split)


def _aligned(length: int, factor: int, offset: int) -> int:
    """The smallest row stride >= length that is `offset` modulo `factor` (what storage_align makes)."""
    return length + (offset - length) % factor


def _blocks(m: int, n: int, config: MmaConfig) -> int:
    return -(-m // config.bm) * -(-n // config.bn)


def schedule_mma(sch, config: MmaConfig) -> None:
    """Schedule the partial products on tensor cores and the split-K sum (with the epilogue folded into it)."""
    mma.register()
    schedule_sum(sch, sch.get_sblock(GEMM_BLOCK))
    block = sch.get_sblock(PARTIAL_BLOCK)
    split_loop, i, j, r = sch.get_loops(block)
    i, i_tile = sch.split(i, [None, 16])
    j, j_tile = sch.split(j, [None, 16])
    r, r_tile = sch.split(r, [None, 8])
    sch.reorder(i, j, r, i_tile, j_tile, r_tile)
    tiles = sch.blockize(i_tile)
    block_i, warp_i, frag_i = sch.split(i, [None, config.warps_m, config.bm // 16 // config.warps_m])
    block_j, warp_j, frag_j = sch.split(j, [None, config.warps_n, config.bn // 16 // config.warps_n])
    step, slice_ = sch.split(r, [None, config.bk // 8])
    sch.reorder(split_loop, block_i, block_j, warp_i, warp_j, step, slice_, frag_i, frag_j)
    sch.bind(split_loop, "blockIdx.z")
    sch.bind(block_i, "blockIdx.y")
    sch.bind(block_j, "blockIdx.x")
    warp = sch.fuse(warp_i, warp_j)
    sch.bind(warp, "threadIdx.y")
    warps = config.warps_m * config.warps_n
    for name, (factor, offset) in ((WEIGHT_BLOCK, WEIGHT_ROW_ALIGN), (COLUMN_BLOCK, COLUMN_ROW_ALIGN)):
        staged = sch.get_sblock(name)
        sch.set_scope(staged, 0, "shared")
        sch.compute_at(staged, step)
        _, ty, tx = sch.split(sch.fuse(*sch.get_loops(staged)[-2:]), [None, warps, 32])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.storage_align(staged, 0, axis=-2, factor=factor, offset=offset)
    weights = sch.cache_read(tiles, read_index(sch, tiles, WEIGHT_BLOCK), "warp")
    columns = sch.cache_read(tiles, read_index(sch, tiles, COLUMN_BLOCK), "warp")
    sch.compute_at(weights, slice_)
    sch.compute_at(columns, slice_)
    accumulators = sch.cache_write(tiles, 0, "warp")
    sch.reverse_compute_at(accumulators, warp)
    _tile_loops(sch, accumulators, 16, 16)
    init = sch.decompose_reduction(tiles, step)
    weight_tile = _tile_loops(sch, weights, 16, 8)
    column_tile = _tile_loops(sch, columns, 8, 16)
    sch.transform_layout(weights, ("write", 0), lambda a, b: (a // 16, b // 8, *mma.a_layout(a % 16, b % 8)))
    sch.transform_layout(columns, ("write", 0), lambda a, b: (a // 8, b // 16, *mma.b_layout(a % 8, b % 16)))
    sch.transform_layout(accumulators, ("read", 0),
                         lambda s, a, b: (s, a // 16, b // 16, *mma.c_layout(a % 16, b % 16)))
    sch.tensorize(weight_tile, mma.LOAD_A)
    sch.tensorize(column_tile, mma.LOAD_B)
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], mma.FILL)
    sch.tensorize(sch.get_loops(accumulators)[-2], mma.STORE)
    sch.tensorize(sch.get_loops(block)[-3], mma.MMA_SYNC)
    if config.stages == 2:
        sch.annotate(step, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(step, "software_pipeline_order", [0, 1, 2])


def _tile_loops(sch, block, rows: int, cols: int):
    """Split the last two loops of `block` into rows x cols tiles (tile loops outside); the inner row loop."""
    a, b = sch.get_loops(block)[-2:]
    a_outer, a_inner = sch.split(a, [None, rows])
    b_outer, b_inner = sch.split(b, [None, cols])
    sch.reorder(a_outer, b_outer, a_inner, b_inner)
    return a_inner
