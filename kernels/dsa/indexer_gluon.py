"""Gluon score kernel of the lightning indexer for Hopper (sm_90): each head's MMA overlaps the
previous head's ReLU-weighted accumulation inside one warpgroup.

The Triton kernel (:func:`kernels.dsa.indexer_triton.pool_scores_kernel`) cannot overlap them: Triton
waits for every ``tl.dot`` before its result is used (``warp_group_dot_wait {pendings = 0}`` in the
sm_90 TTGIR), so a CTA's tensor cores idle during its epilogue and only other CTAs on the SM fill the
gap. With index dim 64 (the ``small`` DSA shape) the epilogue (a max and an FMA per score and head) is
half the MMA time per head and the kernel reached 52-57% of the bf16 matmul rate.
Here the program issues head ``h``'s asynchronous ``wgmma`` (Gluon's ``warpgroup_mma(is_async=True)``),
then waits for head ``h - 1``'s only (``warpgroup_mma_wait(num_outstanding=1)``) and accumulates it
while head ``h`` runs, the software pipelining FlashAttention-3 uses between its two GEMMs (Shah et al.
2024, "FlashAttention-3", section 3.2). Queries arrive through a ``Q_STAGES``-deep ring of TMA loads
(one ``[BLOCK_M, D]`` tile per head and pool tile, re-read from L2), pool-key tiles through a
double buffer, both signalled by mbarriers. Measured on an H200 (one block of 8192 queries x 65,536
pools): 2.26 against 2.44 ms at index dim 64, 6.24 against 6.43 at 128; halving the epilogue's
instructions still saves 18%, so the epilogue and the MMA mostly alternate even so. The head weights are
staged in shared memory (2.19 ms at 64 against 2.30 with global loads in the head loop, whose L1 misses
stalled the accumulation). Holding a CTA's queries in shared memory instead of the ring (two warpgroups, one
CTA per SM) was slower, 2.44 ms: two CTAs per SM fill each other's gaps better.

Same outputs as the Triton kernel, bit for bit where the products are (the same ``wgmma`` instructions
in the same order; the same ``max`` then ``fma`` per head): scores of the visible pools of every tile some
query of the tile sees, ``-inf`` elsewhere in those tiles, the column-group and segment maxima. Needs
bf16 or fp16 queries and pool keys, ``BLOCK_M`` 64 (one warpgroup, ``num_warps`` 4) and CUDA
capability 9.x; :func:`gluon_pool_scores` raises :class:`kernels.dsa.errors.DSAInputError` otherwise.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.dsa.errors import DSAInputError

BLOCK_M = 64
"""Queries per program: one warpgroup's ``wgmma`` rows."""

# Triton 3.7 renamed the TMA copies (async_copy_global_to_shared -> async_load, async_copy_shared_to_global
# -> async_store; the old names raise): the device's Triton 3.6 has only the old ones, CI's 3.9 only the new.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed after 3.6 too

GLUON_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "Q_STAGES": stages, "TMA_STORE": store, "HEAD_GROUP": group}, num_warps=4)
    for bn, stages, store, group in [(128, 3, False, 8), (128, 3, False, 16), (128, 2, False, 16), (64, 3, True, 8),
                                     (128, 4, False, 8), (128, 3, True, 8)]
]
"""Autotuned configurations of :func:`pool_scores_gluon_kernel`: ``BLOCK_N`` pools per tile, the depth of
the query ring, whether score tiles leave through shared memory and a TMA store, heads per unrolled loop
iteration (``H`` must be a multiple; the last product of each group is not overlapped). Shared memory per
CTA: ``Q_STAGES * 64 * D * 2 + 2 * BLOCK_N * D * 2 + H * 64 * 4`` bytes (query ring, key tiles, staged head
weights), plus ``64 * BLOCK_N * 4`` with ``TMA_STORE``
(configurations that do not fit are skipped by the tuner). The last two (a 4-deep query ring; 128-pool tiles stored
through shared memory and TMA) ran 2-3% faster than the tuner's pick on the last 1M block of the small shape.
Registers (offline sm_90 compile, Triton
3.6): 128-pool tiles 255 (three ``[64, 128]`` float32 tiles: two products and the running sum), 64-pool
tiles ~205: two CTAs per SM."""


def _prune_configs(configs, named_args, **kwargs):
    """The configurations whose ``HEAD_GROUP`` divides the head count."""
    heads = kwargs.get("H", named_args.get("H"))
    return [c for c in configs if heads % c.kwargs["HEAD_GROUP"] == 0]


@gluon.constexpr_function
def _nvmma(block_shape, dtype):
    """The NVMMA shared-memory layout (swizzled for ``wgmma`` and TMA) of a ``block_shape`` tile of ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for(block_shape, dtype)


@gluon.jit
def _load_queries(q_desc, q_smem, q_bar, step, m0, pred, H: gl.constexpr, D: gl.constexpr, Q_STAGES: gl.constexpr):
    """Issue the TMA load of step ``step``'s query tile (head ``step % H``) into its ring slot."""
    slot = step % Q_STAGES
    mbarrier.expect(q_bar.index(slot), q_desc.block_type.nbytes, pred=pred)
    _tma_load(q_desc, [m0, (step % H) * D], q_bar.index(slot), q_smem.index(slot), pred=pred)


@gluon.jit
def _load_pool_keys(pk_desc, pk_smem, pk_bar, tile, first_pool, stride_n, pred):
    """Issue the TMA load of pool tile ``tile`` (pools ``first_pool + tile * stride_n + [0, BLOCK_N)``)
    into buffer ``tile % 2``."""
    slot = tile % 2
    mbarrier.expect(pk_bar.index(slot), pk_desc.block_type.nbytes, pred=pred)
    _tma_load(pk_desc, [first_pool + tile * stride_n, 0], pk_bar.index(slot),
                                    pk_smem.index(slot), pred=pred)


@gluon.jit
def _stage_weights(w_row, mask_m, H: gl.constexpr, BLOCK_M: gl.constexpr):
    """The head weights of the tile's rows (``w_row``: ``[BLOCK_M]`` pointers to each row's ``H`` float32
    weights; 0 where ``mask_m`` is false) staged in shared memory as ``[H, BLOCK_M]``: inside the head loop a
    head's weights are then a shared-memory read, whose latency is short and fixed, instead of a global load
    whose L1 misses stalled the accumulation. (Stored head by head, in ``w_row``'s layout: Triton 3.6
    allocates a ``[H, BLOCK_M]`` buffer that ``index`` can address only with a rank-1 layout, which a 2-d
    initial value cannot have.)"""
    w_smem = gl.allocate_shared_memory(gl.float32, [H, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for h in gl.static_range(H):
        w_smem.index(h).store(gl.load(w_row + h, mask=mask_m, other=0.0))
    return w_smem


@gluon.jit
def _accumulate(acc, product, w):
    """``acc + relu(product) * w[:, None]``."""
    # relu(scale * s) * w == relu(s) * (scale * w) for scale > 0: W arrives pre-scaled. (As an FADD
    # s + |s| with a free abs modifier and w / 2, bit for bit the same, instead of the FMNMX: 2% faster
    # for index dim 64, 4% slower for 128, and 12% slower in the Triton kernel)
    return acc + gl.maximum(product, 0.0) * w[:, None]


@gluon.jit
def _finish_tile(acc, col_max, n0, offs_m, mask_m, lo, hi, lo_max, hi_min, n_pools, OUT, out_desc, out_smem, SEGMAX,
                 stride_ot, stride_gt, m0, n_q,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_N: gl.constexpr,
                 SEG: gl.constexpr, TMA_STORE: gl.constexpr, num_warps: gl.constexpr):
    """Mask the summed tile of pools ``[n0, n0 + BLOCK_N)`` (``-inf`` outside each query's ``[lo, hi)``),
    store it, fold it into the column-group maxima and store its segment maxima. Returns the maxima.
    ``lo_max``/``hi_min``: the largest ``lo`` and smallest ``hi`` of the tile's queries; a tile inside every
    query's range (most of them: the causal edge and document starts cross few) skips the mask."""
    cols_l: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=cols_l)
    if (n0 < lo_max) | (n0 + BLOCK_N > hi_min):
        visible = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        acc = gl.where(visible, acc, float("-inf"))
    if TMA_STORE:   # rows and pools past the descriptor's shape are not written
        tma.store_wait(0)          # the previous tile's store has read out_smem
        _cta_barrier()
        out_smem.store(acc)
        fence_async_shared()
        _tma_store(out_desc, [m0, n0], out_smem)
    else:
        gl.store(OUT + offs_m[:, None] * stride_ot + offs_n[None, :], acc,
                 mask=mask_m[:, None] & (offs_n < n_pools)[None, :])
    col_max = gl.maximum(col_max, gl.max(gl.reshape(acc, [BLOCK_M, BLOCK_N // GROUP_N, GROUP_N]), axis=1))
    if SEG > 0:
        gl.static_assert(BLOCK_N % SEG == 0)
        # stored from the reduction's own layout (the wgmma accumulator's, sliced; lanes of a quad store the same
        # value): a layout conversion here went through shared memory behind a CTA barrier every tile
        seg_max = gl.max(gl.reshape(acc, [BLOCK_M, BLOCK_N // SEG, SEG]), axis=2)
        seg_l: gl.constexpr = seg_max.type.layout
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, seg_l))
        segs = n0 // SEG + gl.arange(0, BLOCK_N // SEG, layout=gl.SliceLayout(0, seg_l))
        gl.store(SEGMAX + rows[:, None] * stride_gt + segs[None, :], seg_max,
                 mask=(rows < n_q)[:, None] & (segs * SEG < n_pools)[None, :])
    return col_max


@triton.autotune(configs=GLUON_CONFIGS, key=["H", "D", "size_class", "N_COLUMNS", "SEG"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@gluon.jit
def pool_scores_gluon_kernel(
    Q, PK, W, OUT, COLMAX, SEGMAX, Q_LO, Q_HI,
    stride_qb, stride_qt, stride_pb, stride_pp, stride_wb, stride_wt, stride_ob, stride_ot,
    stride_cb, stride_ct, stride_gb, stride_gt,
    n_q, n_pools, p_lo, n_pools_total, size_class,
    H: gl.constexpr, D: gl.constexpr, N_COLUMNS: gl.constexpr, GROUP_N: gl.constexpr,
    BLOCK_N: gl.constexpr, Q_STAGES: gl.constexpr, SEG: gl.constexpr,
    TMA_STORE: gl.constexpr, HEAD_GROUP: gl.constexpr,
):
    """Scores of 64 queries against the pool tiles ``pid_n, pid_n + n_prog, ...`` (``n_prog =
    N_COLUMNS / GROUP_N``), with the arguments and outputs of
    :func:`kernels.dsa.indexer_triton.pool_scores_kernel` (whose docstring gives the column groups,
    segments and ``[lo, hi)`` ranges): ``Q`` ``[B, n_q, H, D]`` (``stride(2) == D``), ``PK`` ``[B,
    n_pools_total, D]`` (absolute pools), ``OUT`` ``[B, n_q, n_pools]`` float32 (row stride a multiple of
    4), ``W`` ``[B, n_q, H]`` float32 pre-scaled head weights. Tensor descriptors are made on the device
    (the caller sets ``triton.set_allocator``), so the tuner can vary ``BLOCK_N``.

    The (pool tile, head) steps form one stream, ``HEAD_GROUP`` heads per loop iteration: each head's
    ``wgmma`` is issued before the previous head's product is waited for and accumulated (see the loop).
    Query tiles come through a ``Q_STAGES``-deep ring of TMA loads, a slot refilled as soon as the product
    that read it retires; pool-key tiles through two buffers, tile ``j + 2`` loaded when tile ``j`` is summed.
    The tile's head weights are staged in shared memory once (:func:`_stage_weights`).
    """
    num_warps: gl.constexpr = gl.num_warps()
    gl.static_assert(num_warps == 4)
    BLOCK_M: gl.constexpr = 64
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    m0 = pid_m * BLOCK_M
    n_prog: gl.constexpr = N_COLUMNS // GROUP_N
    stride_n: gl.constexpr = n_prog * BLOCK_N
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=rows_l)
    mask_m = offs_m < n_q
    lo = gl.load(Q_LO + offs_m, mask=mask_m, other=2**31 - 1) - p_lo
    hi = gl.load(Q_HI + offs_m, mask=mask_m, other=0) - p_lo
    n_first = pid_n * BLOCK_N + gl.maximum(gl.min(lo, axis=0) - pid_n * BLOCK_N, 0) // stride_n * stride_n
    n_end = gl.minimum(gl.max(hi, axis=0), n_pools)
    lo_max, hi_min = gl.max(lo, axis=0), gl.min(hi, axis=0)   # the pools every query of the tile sees
    n_tiles = (gl.maximum(n_end - n_first, 0) + stride_n - 1) // stride_n
    n_steps = n_tiles * H

    # TMA zero-fills rows and pools past the shapes (the masked loads' other) and clips the stores
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb, shape=[n_q, H * D], strides=[stride_qt, 1],
                                        block_shape=[BLOCK_M, D], layout=_nvmma([BLOCK_M, D], Q.dtype.element_ty))
    pk_desc = tma.make_tensor_descriptor(PK + b * stride_pb, shape=[n_pools_total, D], strides=[stride_pp, 1],
                                         block_shape=[BLOCK_N, D], layout=_nvmma([BLOCK_N, D], PK.dtype.element_ty))
    OUT = OUT + b * stride_ob
    if TMA_STORE:
        out_desc = tma.make_tensor_descriptor(OUT, shape=[n_q, n_pools], strides=[stride_ot, 1], block_shape=[BLOCK_M, BLOCK_N],
                                              layout=_nvmma([BLOCK_M, BLOCK_N], gl.float32))
        out_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], out_desc.layout)
    else:   # unused
        out_desc = q_desc
        out_smem = gl.allocate_shared_memory(gl.float32, [1, 1], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    W = W + b * stride_wb
    COLMAX = COLMAX + b * stride_cb
    SEGMAX = SEGMAX + b * stride_gb
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES, BLOCK_M, D], q_desc.layout)
    pk_smem = gl.allocate_shared_memory(pk_desc.dtype, [2, BLOCK_N, D], pk_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    pk_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(Q_STAGES):
        mbarrier.init(q_bar.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.init(pk_bar.index(s), count=1)

    first_pool = p_lo + n_first
    _load_pool_keys(pk_desc, pk_smem, pk_bar, 0, first_pool, stride_n, n_tiles > 0)
    _load_pool_keys(pk_desc, pk_smem, pk_bar, 1, first_pool, stride_n, n_tiles > 1)
    for s in gl.static_range(Q_STAGES):
        _load_queries(q_desc, q_smem, q_bar, s, m0, s < n_steps, H, D, Q_STAGES)

    w_smem = _stage_weights(W + offs_m * stride_wt, mask_m, H, BLOCK_M)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    col_max = gl.max(gl.reshape(gl.full([BLOCK_M, BLOCK_N], float("-inf"), gl.float32, mma),
                                [BLOCK_M, BLOCK_N // GROUP_N, GROUP_N]), axis=1)
    # HEAD_GROUP heads per iteration, unrolled. Two register sets take the products in turn (x the
    # group's even heads, y the odd ones): while one set's product runs on the tensor cores the other's
    # is accumulated, then takes the product after next. The group drains at its end: an accumulator in
    # flight across the loop's back edge costs a copy of its registers there, and ptxas then serializes
    # every wgmma (its C7514 warning); fresh zero tiles instead of retired sets cost 64 registers each
    # (C7512, spills).
    gl.static_assert(H % HEAD_GROUP == 0)
    gl.static_assert(HEAD_GROUP % 2 == 0)
    x_dead = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    y_dead = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for i0 in range(0, n_steps, HEAD_GROUP):
        j = i0 // H
        h0 = i0 - j * H
        pk_tile = pk_smem.index(j % 2).permute((1, 0))
        mbarrier.wait(pk_bar.index(j % 2), (j // 2) & 1, pred=h0 == 0)
        mbarrier.wait(q_bar.index(i0 % Q_STAGES), (i0 // Q_STAGES) & 1)
        x = warpgroup_mma(q_smem.index(i0 % Q_STAGES), pk_tile, x_dead, use_acc=False, is_async=True)
        w_x = w_smem.index(h0).load(rows_l)
        mbarrier.wait(q_bar.index((i0 + 1) % Q_STAGES), ((i0 + 1) // Q_STAGES) & 1)
        y = warpgroup_mma(q_smem.index((i0 + 1) % Q_STAGES), pk_tile, y_dead, use_acc=False, is_async=True)
        w_y = w_smem.index(h0 + 1).load(rows_l)
        for g in gl.static_range(2, HEAD_GROUP, 2):
            x_ready = warpgroup_mma_wait(num_outstanding=1, deps=(x,))   # step i0 + g - 2 retired
            _load_queries(q_desc, q_smem, q_bar, i0 + g - 2 + Q_STAGES, m0, i0 + g - 2 + Q_STAGES < n_steps,
                          H, D, Q_STAGES)
            acc = _accumulate(acc, x_ready, w_x)
            # a wait on nothing new (y is the one group in flight) that takes the sum: it pins the
            # accumulation before the next issue (LLVM otherwise sinks it past later waits, keeping
            # every product of the group live and overlapping nothing)
            acc, x_ready = warpgroup_mma_wait(num_outstanding=1, deps=(acc, x_ready))
            mbarrier.wait(q_bar.index((i0 + g) % Q_STAGES), ((i0 + g) // Q_STAGES) & 1)
            x = warpgroup_mma(q_smem.index((i0 + g) % Q_STAGES), pk_tile, x_ready, use_acc=False, is_async=True)
            w_x = w_smem.index(h0 + g).load(rows_l)
            y_ready = warpgroup_mma_wait(num_outstanding=1, deps=(y,))   # step i0 + g - 1 retired
            _load_queries(q_desc, q_smem, q_bar, i0 + g - 1 + Q_STAGES, m0, i0 + g - 1 + Q_STAGES < n_steps,
                          H, D, Q_STAGES)
            acc = _accumulate(acc, y_ready, w_y)
            acc, y_ready = warpgroup_mma_wait(num_outstanding=1, deps=(acc, y_ready))
            mbarrier.wait(q_bar.index((i0 + g + 1) % Q_STAGES), ((i0 + g + 1) // Q_STAGES) & 1)
            y = warpgroup_mma(q_smem.index((i0 + g + 1) % Q_STAGES), pk_tile, y_ready, use_acc=False, is_async=True)
            w_y = w_smem.index(h0 + g + 1).load(rows_l)
        x_dead = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
        _load_queries(q_desc, q_smem, q_bar, i0 + HEAD_GROUP - 2 + Q_STAGES, m0,
                      i0 + HEAD_GROUP - 2 + Q_STAGES < n_steps, H, D, Q_STAGES)
        acc = _accumulate(acc, x_dead, w_x)
        acc, x_dead = warpgroup_mma_wait(num_outstanding=1, deps=(acc, x_dead))
        y_dead = warpgroup_mma_wait(num_outstanding=0, deps=(y,))
        _load_queries(q_desc, q_smem, q_bar, i0 + HEAD_GROUP - 1 + Q_STAGES, m0,
                      i0 + HEAD_GROUP - 1 + Q_STAGES < n_steps, H, D, Q_STAGES)
        acc = _accumulate(acc, y_dead, w_y)
        if h0 + HEAD_GROUP == H:   # tile j summed: its key buffer takes tile j + 2
            _load_pool_keys(pk_desc, pk_smem, pk_bar, j + 2, first_pool, stride_n, j + 2 < n_tiles)
            col_max = _finish_tile(acc, col_max, n_first + j * stride_n, offs_m, mask_m, lo, hi, lo_max, hi_min, n_pools,
                                   OUT, out_desc, out_smem, SEGMAX, stride_ot, stride_gt, m0, n_q,
                                   BLOCK_M, BLOCK_N, GROUP_N, SEG, TMA_STORE, num_warps)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    if TMA_STORE:
        tma.store_wait(0)
    for s in gl.static_range(Q_STAGES):
        mbarrier.invalidate(q_bar.index(s))
    for s in gl.static_range(2):
        mbarrier.invalidate(pk_bar.index(s))
    cm_l: gl.constexpr = gl.BlockedLayout([1, GROUP_N], [32, 1], [num_warps, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, cm_l))
    offs_g = pid_n * GROUP_N + gl.arange(0, GROUP_N, layout=gl.SliceLayout(0, cm_l))
    gl.store(COLMAX + rows[:, None] * stride_ct + offs_g[None, :], gl.convert_layout(col_max, cm_l),
             mask=(rows < n_q)[:, None])


def gluon_pool_scores(q: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor,
                      col_max: torch.Tensor, seg_max: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor,
                      p_lo: int, size_class: int, n_columns: int, group_n: int, seg: int) -> None:
    """Launch :func:`pool_scores_gluon_kernel` (autotuned) for one query block.

    Args:
        q: ``[B, n_q, H, D]`` bf16 or fp16 queries, ``stride(2) == D`` and ``stride(3) == 1``.
        pool_keys: ``[B, P, D]`` pooled keys, same dtype, contiguous (absolute pool indices).
        weights: ``[B, n_q, H]`` float32 head weights times the softmax scale, contiguous.
        scores: ``[B, n_q, n_pools]`` float32 view of the block's score rows (row stride a multiple of 4).
        col_max: ``[B, n_q, n_columns]`` float32 column-group maxima.
        seg_max: ``[B, n_q, cdiv(n_pools, seg)]`` float32 segment maxima (written with ``seg > 0``).
        q_lo, q_hi: ``[n_q]`` int32 absolute visible pool range of each query.
        p_lo: first pool of the block (absolute); the block sees ``scores.shape[-1]`` pools from it.

    Raises:
        DSAInputError: queries or pool keys not bf16/fp16, or a device other than CUDA capability 9.x.
    """
    if q.dtype not in (torch.bfloat16, torch.float16) or pool_keys.dtype != q.dtype:
        raise DSAInputError(f"the Gluon indexer needs bf16 or fp16 queries and pool keys, got {q.dtype} / {pool_keys.dtype}")
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        raise DSAInputError("the Gluon indexer needs a Hopper GPU (CUDA capability 9.x), got "
                            f"{torch.cuda.get_device_name(q.device)}")
    batch, n_q, heads, dim = q.shape
    n_pools = scores.shape[-1]
    if n_q == 0 or n_pools == 0:
        return

    def grid(meta):
        return (n_columns // group_n, triton.cdiv(n_q, BLOCK_M), batch)

    pool_scores_gluon_kernel[grid](
        q, pool_keys, weights, scores, col_max, seg_max, q_lo, q_hi,
        q.stride(0), q.stride(1), pool_keys.stride(0), pool_keys.stride(1), weights.stride(0), weights.stride(1),
        scores.stride(0), scores.stride(1), col_max.stride(0), col_max.stride(1), seg_max.stride(0), seg_max.stride(1),
        n_q, n_pools, p_lo, pool_keys.shape[1], size_class,
        H=heads, D=dim, N_COLUMNS=n_columns, GROUP_N=group_n, SEG=seg,
    )
