"""Tiles of the fused attention kernels (:mod:`uvic_kernels.triton_attention`): the tiles each
kernel may run, which of them suit a launch (``prune``), and how a sequence splits into
full blocks plus remainder steps and programs.

U-ViT's sequences (257 tokens on CIFAR-10, 334 on MS-COCO) lie just above a multiple of the
block sizes, so each kernel loops over full blocks, then ``TAIL``-wide (16) steps, the last
one masked; after a head's full-block programs come ``TAIL``-row remainder programs, or one
masked full-size program where those would cost more (``REMAINDER_COST``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from uvic_kernels.compat import fix_interpreter_scalar_index

# fmt: off
# (tile lists are grouped a few to a line; a formatter would put each on its own line)

TAIL = 16  # rows / keys per remainder step and per remainder program (tl.dot's minimum)
# A TAIL-row remainder program runs 16-row mma.sync tiles: about 4x the cost per row of a
# full wgmma block (sm_90 SASS census of the forward, cycle model).  A remainder longer
# than BLOCK / REMAINDER_COST rows therefore runs as one masked full-size program.
REMAINDER_COST = 4
MIN_BLOCK = 16  # tl.dot needs every block dimension to be at least 16

try:  # triton >= 3.3 reads the environment through knobs; older releases read it directly
    INTERPRET: bool = bool(triton.knobs.runtime.interpret)
except AttributeError:  # pragma: no cover - depends on the installed triton
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:  # Triton 3.6's interpreter under numpy >= 2.4 refuses range() over scalars
    fix_interpreter_scalar_index()

# Block sizes.  The interpreter runs a single fixed configuration (autotuning with
# more than one config needs a GPU).  On a GPU the kernels are autotuned over a few
# FlashAttention-2 style tiles, keyed on the sequence lengths, the number of heads
# (B * H), the head dim, the mode and the dtype; with UVIC_KERNELS_AUTOTUNE=0 the
# first tile that survives pruning is used directly.
# The interpreter's tiles are all 64x64: the backward then recomputes every score with
# the same tile product as the forward (numpy's matmul may sum in another order for
# other shapes, and at |S| ~ 1e4 one fp32 ulp of a score moves its weight by ~1e-3).
INTERPRET_FWD = {"BLOCK_M": 64, "BLOCK_N": 64}
INTERPRET_BWD_DKDV = {"BLOCK_M": 64, "BLOCK_N": 64}
INTERPRET_BWD_DQ = {"BLOCK_M": 64, "BLOCK_N": 64}
PREPROCESS_BLOCK_M = 64
AUTOTUNE = os.environ.get("UVIC_KERNELS_AUTOTUNE", "1") != "0"
# (BLOCK_M, BLOCK_N, num_stages, num_warps), preferred first; BLOCK_M tiles queries
# and BLOCK_N keys in every kernel.  The backward tiles follow Triton's tutorial:
# dK/dV keeps a wide key block resident, dQ a tall query block.  The dQ list starts
# with 128x64 because its wgmma reads the dS operand from registers (128x32 reads
# both operands from shared memory).  The lists were checked by compiling every kernel
# for sm_90 (ptxas -v, see BENCHMARKS.md): for 16-bit inputs the first tile that survives
# pruning spills no registers at head dims 64 to 128 in any mode (fp32: a few small
# spills, listed there).
GPU_FWD_TILES = [(128, 64, 3, 4), (128, 64, 3, 8), (64, 64, 3, 4), (128, 128, 3, 8), (64, 32, 4, 4)]
GPU_BWD_DKDV_TILES = [
    (64, 128, 3, 8), (32, 128, 3, 4), (32, 128, 3, 8), (32, 64, 3, 4), (64, 64, 2, 4),
]
GPU_BWD_DQ_TILES = [(128, 64, 3, 8), (128, 32, 3, 4), (64, 32, 3, 4), (64, 64, 2, 4)]
# fp32 runs tl.dot in IEEE fp32 on the CUDA cores (FMA): every thread holds whole
# rows / columns of both operands, so the tiles are small and use more warps.
GPU_FWD_TILES_FP32 = [(64, 32, 2, 8), (32, 64, 2, 8), (32, 32, 2, 4), (16, 64, 2, 4)]
GPU_BWD_DKDV_TILES_FP32 = [(32, 32, 2, 16), (16, 32, 2, 8), (16, 32, 2, 4)]
GPU_BWD_DQ_TILES_FP32 = [(64, 32, 2, 8), (32, 64, 2, 8), (32, 32, 2, 4), (16, 64, 2, 4)]
FP32_MAX_TILE = 64 * 32  # fp32 operands take twice the registers / shared memory
# Tiles that spill registers on sm_90 once BLOCK_D exceeds the given value (head dims
# above 64, e.g. 72 padded to 128): kept for small head dims only.
TILE_MAX_BLOCK_D = {
    "fwd": {(128, 64, 3, 4): 64, (128, 128, 3, 8): 64,
            (64, 32, 2, 8): 64, (32, 64, 2, 8): 64, (32, 32, 2, 4): 64},
    "dkdv": {(64, 128, 3, 8): 64, (32, 128, 3, 4): 64, (64, 64, 2, 4): 64,
             (16, 32, 2, 4): 64},
    "dq": {(128, 32, 3, 4): 64, (64, 32, 2, 8): 64, (32, 64, 2, 8): 64, (32, 32, 2, 4): 64},
}
TILES = {
    "fwd": (GPU_FWD_TILES, GPU_FWD_TILES_FP32),
    "dkdv": (GPU_BWD_DKDV_TILES, GPU_BWD_DKDV_TILES_FP32),
    "dq": (GPU_BWD_DQ_TILES, GPU_BWD_DQ_TILES_FP32),
}
assert all(m * n <= FP32_MAX_TILE for _, t32 in TILES.values() for m, n, _, _ in t32)
# Which sequence the program grid of each kernel tiles (the other one is looped over).
PROGRAM_DIM = {"fwd": ("N_Q", "BLOCK_M"), "dq": ("N_Q", "BLOCK_M"), "dkdv": ("N_KV", "BLOCK_N")}
AUTOTUNE_KEY = ["N_Q", "N_KV", "BH", "HEAD_DIM", "MODE"]

# fmt: on


def configs(interpret_tile: dict[str, int], kind: str) -> list[triton.Config]:
    """One fixed config in the interpreter, a small autotuning space on a GPU."""
    if INTERPRET:
        return [triton.Config(dict(interpret_tile), num_warps=4, num_stages=1)]
    tiles16, tiles32 = TILES[kind]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
        for bm, bn, s, w in dict.fromkeys(tiles16 + tiles32)
    ]


def tile_of(c: triton.Config) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_stages, num_warps)`` of a config."""
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps


def smem_bytes(kind: str, tile: tuple[int, int, int, int], block_d: int, elt: int) -> int:
    """Upper estimate of a config's shared memory: the tiles kept for the whole loop
    plus ``num_stages`` buffers of the streamed ones, plus 1 KB of scratch.  For
    16-bit inputs this is at most 1 KB above what Triton 3.8 allocates on sm_90;
    for fp32 (FMA path) it overestimates by up to ~1.8x, which only prunes early."""
    bm, bn, stages, _ = tile
    if kind == "fwd":  # Q resident; K, V streamed
        resident, streamed, rows = bm * block_d, 2 * bn * block_d, 0
    elif kind == "dkdv":  # K, V resident; Q, dO (and LSE, Delta) streamed
        resident, streamed, rows = 2 * bn * block_d, 2 * bm * block_d, 2 * bm
    else:  # dq: Q, dO, O resident; K, V streamed
        resident, streamed, rows = 3 * bm * block_d, 2 * bn * block_d, 0
    return elt * (resident + stages * streamed) + 4 * stages * rows + 1024


def remainder(n: int, block: int) -> tuple[int, int]:
    """``(programs, rows)`` for the ``n % block`` rows left after the full blocks: TAIL-row
    programs, or one masked ``block``-row program where those would cost more."""
    tails = triton.cdiv(n % block, TAIL)
    if tails * TAIL * REMAINDER_COST > block:
        return 1, block
    return tails, tails * TAIL


def num_programs(n: int, block: int) -> int:
    """Programs per head along a sequence of ``n``: full blocks plus remainder programs."""
    return n // block + remainder(n, block)[0]


def computed_fraction(n_q: int, n_kv: int, block_m: int, block_n: int, kind: str) -> float:
    """Share of the score elements a kernel computes that are real (not padding): at least
    86% for every tile at N = 257 and N = 334, against 54% (N = 257) with whole blocks.

    ``kind`` is ``"fwd"``, ``"dq"`` or ``"dkdv"``: each pads its program dimension to
    full blocks plus remainder programs (``remainder``) and its loop dimension to full
    blocks plus ``TAIL``-wide steps.
    """
    n_prog, n_loop, b_prog, b_loop = (
        (n_kv, n_q, block_n, block_m) if kind == "dkdv" else (n_q, n_kv, block_m, block_n)
    )
    rows = (n_prog // b_prog) * b_prog + remainder(n_prog, b_prog)[1]
    cols = (n_loop // b_loop) * b_loop + triton.cdiv(n_loop % b_loop, TAIL) * TAIL
    return n_q * n_kv / (rows * cols)


@functools.cache
def max_shared_mem(device_index: int) -> int:
    """Shared memory one block may use on the device (opt-in maximum), in bytes."""
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Number of streaming multiprocessors of the device."""
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["multiprocessor_count"])


def prune(configs, named_args, kind: str = "fwd", **kwargs):
    """Order of preference, relaxed from the last criterion when nothing is left:

    1. tiles meant for the dtype (fp32 or 16-bit; fp32 never above ``FP32_MAX_TILE``);
    2. shared memory within the device's limit (CUDA tensors only);
    3. no register spills at this ``BLOCK_D`` (``TILE_MAX_BLOCK_D``);
    4. tiles no larger than the sequence lengths (at least one full block).

    Among the survivors, tiles whose full-block programs (``B * H`` times the full blocks
    of the program dimension) occupy every multiprocessor at least once come first, in
    list order: few heads with long blocks would leave SMs idle.  At least one config
    is kept; without autotuning only the first.
    """
    q = named_args["Q"]
    n_q, n_kv = named_args["N_Q"], named_args["N_KV"]
    fp32 = q.dtype == torch.float32
    block_d = kwargs.get("BLOCK_D")
    tiles16, tiles32 = TILES[kind]
    wanted = set(tiles32 if fp32 else tiles16)
    kept = [c for c in configs if tile_of(c) in wanted]
    if not kept:  # configs from elsewhere: at least no large fp32 tiles
        kept = [c for c in configs if not fp32 or tile_of(c)[0] * tile_of(c)[1] <= FP32_MAX_TILE]
        kept = kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    if block_d is not None and q.is_cuda:
        limit = max_shared_mem(q.device.index)

        def smem(c):
            return smem_bytes(kind, tile_of(c), block_d, q.element_size())

        kept = [c for c in kept if smem(c) <= limit] or [min(kept, key=smem)]
    if block_d is not None:
        max_d = TILE_MAX_BLOCK_D[kind]
        kept = [c for c in kept if block_d <= max_d.get(tile_of(c), block_d)] or kept
    fits = [c for c in kept if c.kwargs["BLOCK_M"] <= n_q and c.kwargs["BLOCK_N"] <= n_kv]
    if not fits:
        fits = [min(kept, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    if q.is_cuda and "BH" in named_args:
        sms = multiprocessor_count(q.device.index)
        n_name, block_name = PROGRAM_DIM[kind]
        n = named_args[n_name]
        fits.sort(key=lambda c: named_args["BH"] * (n // c.kwargs[block_name]) < sms)
    return fits if AUTOTUNE else fits[:1]
