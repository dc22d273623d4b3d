"""Warp-specialized Gluon kernels of sparse MLA attention for Hopper (sm_90): the forward, and the backward's
latent gradient with 64 heads per program. The gather of the selected latent rows runs in producer warps while
two consumer warpgroups run the products and the softmax.

The Triton forward (:func:`kernels.dsa.sparse_attention_triton.sparse_mla_fwd_kernel`) reaches 249 TF/s at the
``full`` shape (64 heads, 512-wide latent, 2,063 selected tokens; one H200, 64k tokens, anchor 779 TF/s): its
``[64, 512]`` float32 accumulator takes a whole SM's registers, one CTA per SM, and within that CTA the gather of
a key block, its two products and the softmax run one after the other (``docs/measurements.md``, "Sparse MLA
tilings one by one"). Here the three overlap, as in FlashMLA's sparse prefill kernel for sm_90 (DeepSeek,
``csrc/sm90/prefill/sparse/phase1.cuh``):

* a producer partition (``PRODUCER_WARPS`` warps, few registers) copies the query tile once and then the
  ``BLOCK_K`` selected latent rows of each key block into a ``STAGES``-deep ring of shared-memory buffers with
  ``cp.async`` (a gather: the rows are arbitrary), each buffer signalled by ``cp.async.mbarrier.arrive.noinc``
  from every producer thread;
* the default partition, two consumer warpgroups (8 warps), computes ``S = Q K^T`` (``wgmma``, the query and the
  key block both read from shared memory; each warpgroup takes half of the block's keys), the online softmax in
  base 2, stores ``P`` (bf16) to shared memory and accumulates ``O += P V`` (each warpgroup owns half of
  ``d_v``: a ``[64, 256]`` float32 accumulator, 128 registers per thread). ``V`` is the latent itself
  (absorbed NoPE-MLA, ``d_v == Dqk``), so one buffer serves both products.
* Per key block ``j`` the consumers issue ``P_j V_j``, then ``Q K_{j+1}^T``, and release block ``j``'s buffer as
  soon as ``P_j V_j`` retires: the product of the next block runs while the buffer is handed back, and the gather
  of block ``j + STAGES`` has ``STAGES - 1`` consumer iterations to land. (Issuing ``Q K_{j+1}^T`` before the
  softmax of block ``j``, FlashAttention-3's order, would leave the gather of block ``j + 1`` no time at all
  with two stages.) The last iteration recomputes ``Q K^T`` of the last block instead of branching around the
  issue (an asynchronous product inside a branch has no value on the other path): ``1 / n_blocks`` of the
  ``QK`` products wasted, 3% at 2,063 selected tokens and ``BLOCK_K`` 64 (33 blocks), 1.5% of all products.

That is the ring schedule (:func:`sparse_mla_fwd_gluon_kernel`). Its softmax runs between the products with both
warpgroups in lock step, the tensor cores idle (Nsight Compute, one H200: the tensor pipe active 47% of cycles).
The training path runs the paired-block schedule instead (:func:`sparse_mla_fwd_pair_kernel`, :data:`FWD_SCHEDULE`):
each consumer warpgroup takes a whole key block of each pair, so one's softmax runs under the other's products.

Same contract as :func:`kernels.dsa.sparse_attention_triton.triton_sparse_mla_fwd`: ``out`` in ``q.dtype``,
``lse`` float32 natural log, ``-inf`` and a zero row for a query without a valid index. Needs bf16/fp16, a head
count that is a multiple of 64 (one ``wgmma`` tile of rows per program), ``d_v == Dqk`` a multiple of 64 up to
512, and CUDA capability 9.x; :func:`gluon_sparse_mla_fwd` raises :class:`kernels.dsa.errors.DSAInputError`
otherwise. It is the forward wherever it runs (``fwd_kernel="auto"``, :func:`kernels.dsa.sparse_attention.choose_kernels`):
checked by ``tests/gpu/gluon_smoke.py`` and ``tests/gpu/dsa_check.py`` and timed by
``tests/benchmarks/sparse_mla_tilings.py`` on an H100 (at the ``full`` shape, 64k tokens: the pair schedule 464
TF/s, the ring 440, the Triton forward 252; anchors 777-779).

The latent gradient (:func:`sparse_mla_dkv_gluon_kernel`, ``dkv_kernel="auto"`` or ``"gluon"``) exists because
Triton's per-query backward cannot take 64 heads in one program: it holds ``q`` and ``dO`` twice each, once per
major order its products read them in (256-352 KiB at 64 heads x 512), so the autotuner falls back to 32- or
16-head programs, each gathering every selected row and adding its own atomic row per key. Here the producer copies
``q`` and ``dO`` once, ``wgmma`` reads each in both orders, and one 64-key latent buffer is released as soon as
``Q K^T`` and ``dO V^T`` retire, so the next gather overlaps ``dS^T q + P^T dO`` and the atomics. Its float32 atomic
rows are bound by the number of requests that carry them, not by their bytes or instructions, and that is a limit
of each SM, not of L2 (on ``n`` of 132 SMs it takes 132/n times as long:
``tests/benchmarks/sparse_mla_sm_share.py``). In the ``wgmma`` fragments (32 bytes of a row per request) the kernel
takes 135.4 ms (one H100, ``full`` shape, 64k tokens),
127.1 ms of it with its products skipped (``PRODUCTS=False``); in 128-byte lines (:data:`ATOMIC_LAYOUTS`,
:data:`DKV_ATOMIC_LAYOUT`) 116.1 ms, 86.9 without products, 82.3 with the atomics predicated off (the conversion
through shared memory included). In four column pieces, each piece's products issued before the previous piece's
atomics and the next block's score products before the last piece's (:data:`DKV_PIECES`,
:data:`DKV_SCORES_AHEAD`), the tensor cores run while the warps issue atomics: 109.6 ms against 117.4 in one
piece, same process. An H200, with 1.41x the copy rate, ran it (and the forward and query gradient) in
the same time, so HBM is not what bounds these kernels. Nor are the gathers: with every query's pools the same 128
(L2-resident) or spread over its whole history the forward and query gradient take within 7% of their time on a
recent window, so their own pipeline (the softmax between one key block's two products) bounds them; only this
kernel's atomics slow down on a spread selection (``docs/dsa_kernels.md``).

The query gradient (:func:`sparse_mla_dq_gluon_kernel`, taken with the Gluon latent gradient:
``triton_sparse_mla_bwd``'s ``dq_kernel="auto"``) has the same producer with a two-deep ring of 32-key buffers;
the consumers form ``dS`` and accumulate ``dq += dS K`` over the blocks. ``rowsum(dO O)`` comes from
:func:`kernels.dsa.sparse_attention_triton.triton_sparse_mla_delta`. Two schedules (:data:`DQ_KERNELS`): both
warpgroups run ``S`` and ``dP`` over half of each block's keys (``"keys"``, :func:`sparse_mla_dq_gluon_kernel`:
``wgmma`` N = 16, each warpgroup reading both ``q`` and ``dO`` per block, 71.6 ms on one H100 at the ``full`` shape,
64k tokens), or one runs ``S`` and the other ``dP`` over all of them (``"products"``,
:func:`sparse_mla_dq_split_kernel`, the default: N = 32, each reads one; 54.1 ms, 492 TF/s of its three products,
with the producer's indices ahead; ``tests/benchmarks/sparse_mla_tilings.py``, anchor 785 TF/s). Forward and
backward together, ``tests/benchmarks/dsa_bench.py table``: 207.6 ms, 299 TF/s (anchor 777), with the latent
gradient in four column pieces and the next block's scores ahead (:data:`DKV_PIECES`, :data:`DKV_SCORES_AHEAD`).

Shared memory per CTA of the forward: ``64 * D * 2`` (queries) ``+ STAGES * BLOCK_K * D * 2`` (key ring)
``+ 64 * BLOCK_K * 2`` (``P``) bytes: 200 KiB at ``D`` 512 with ``(BLOCK_K, STAGES)`` ``(64, 2)`` or ``(32, 4)``; one CTA per SM.
Registers: 12 warps, ``maxnreg`` :data:`MAXNREG` (``12 * 32 * 168 <= 65,536``), the producer
``PRODUCER_REGS``, the consumers what is left (``(12 * 168 - 4 * PRODUCER_REGS) / 8``).

Timed beside the defaults by ``tests/benchmarks/sparse_mla_tilings.py --gluon-only`` and checked by
``tests/gpu/gluon_smoke.py``: the ring forward (``schedule="ring"``; 40.3 ms on an H100 against the pair
schedule's 38.2, and 38.5 with conditional rescaling, ``GLUON_FWD_LAZY``) and the producer's
``INDICES_AHEAD`` (:func:`_producer`; on in the ring forward's ``(64, 2)`` configuration, 46.6 -> 42.5 ms, and in
the ``"products"`` query gradient, 57.2 -> 54.1 ms; off in the ``"keys"`` one and the latent gradient, where it
changed nothing: 72.3 -> 72.0 and 135.4 -> 135.6 ms). With ``products=False`` the ring forward runs its gathers
alone: 17.7 ms of its 41.5 at ``(64, 2)``, so the gathers do not bound it. Timed and checked the same way:
the latent gradient with its atomics in a warpgroup of their own (:data:`DKV_ATOMIC_WARPS`, off: 121.4 ms
against 109.5 on an H100).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.dsa.errors import DSAInputError

BLOCK_H = 64
"""Heads per program: one ``wgmma`` tile of rows, shared by both consumer warpgroups."""
CONSUMER_WARPS = 8
"""The default partition: two warpgroups, one per half of the key block (``S``) and of ``d_v`` (``O``)."""
PRODUCER_WARPS = 4
WG_WARPS = 4
"""One consumer warpgroup: the paired-block forward's default partition and its second consumer partition."""
_WG_WARPS = gl.constexpr(WG_WARPS)
_BLOCK_H = gl.constexpr(BLOCK_H)
_CONSUMER_WARPS = gl.constexpr(CONSUMER_WARPS)
_PRODUCER_WARPS = gl.constexpr(PRODUCER_WARPS)
MAXNREG = 168
"""Register limit of the kernel's 12 warps: ``12 * 32 * 168 = 64,512`` of an SM's 65,536 registers."""

# Triton 3.7 renamed cp.async (async_copy_global_to_shared -> async_load; the old name raises): the device's
# Triton 3.6 has only the old one, CI's 3.9 only the new; and gl.barrier -> gl.thread_barrier.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

GLUON_FWD_CONFIGS = [
    triton.Config({"BLOCK_K": bk, "STAGES": st, "GATHER_ROWS": rows, "PRODUCER_REGS": regs, "INDICES_AHEAD": ahead},
                  num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
    for bk, st, rows, regs, ahead in [(64, 2, 16, 56, True), (32, 4, 16, 56, False), (32, 3, 16, 56, False)]
]
"""Autotuned configurations: key block and ring depth (same shared memory for ``(64, 2)`` and ``(32, 4)``:
wider ``S`` products against a deeper ring), rows per ``cp.async`` batch, the producer's registers (a batch of
16 rows of 512 is 8 16-byte copies per producer thread, each with a 64-bit address; with 8-row batches and 40
registers ptxas spilled 28 bytes) and whether the producer loads a block's indices ahead (:func:`_producer`; on
one H100, ``full`` shape, 64k: ``(64, 2)`` 46.6 -> 42.5 ms with them ahead, the 32-key rings unchanged within
1%). Offline sm_90 compiles (Triton 3.6, :func:`kernels.dsa.sm90.compile_gluon_sparse_fwd` at 64 heads x 512):
no spills but 8 bytes in ``(64, 2)``, whose consumers also hold the softmax's per-element denominator
(``ROW_SUM_AT_END``); ``setmaxnreg`` gives the consumers 224 registers, the producer 56."""


@gluon.constexpr_function
def _nvmma(block_shape, dtype):
    """The NVMMA shared-memory layout (swizzled for ``wgmma``) of a ``block_shape`` tile of ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for(block_shape, dtype)


@gluon.constexpr_function
def _wgmma_layout(n):
    """The register layout of a ``[64, n]`` ``wgmma`` result split over the two consumer warpgroups: each holds
    all 64 rows (four warps of 16) and half of the ``n`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16])


ATOMIC_LAYOUTS = ("fragments", "v4", "halves", "lines")
"""How :func:`sparse_mla_dkv_gluon_kernel` lays out its ``[64, D]`` float32 block before the atomics
(``ATOMIC_LAYOUT``, an index into this tuple):

- ``fragments``: the ``wgmma`` result as it is, 2 floats per thread (``red.v2.f32``); a warp's instruction
  touches 8 rows, 32 bytes each.
- ``v4``: two lanes trade halves (64 shuffles per thread), 4 floats per thread (``red.v4.f32``); 16 rows of 32
  bytes per instruction.
- ``halves``: other columns trade places (128 shuffles per thread); 8 rows of 64 bytes per instruction.
- ``lines``: through 16 KiB of shared memory, 8 lanes cover one 128-byte line of a row; 4 rows of 128 bytes per
  instruction.

The same float32 adds in each; only how many L2 requests carry them differs."""


@gluon.constexpr_function
def _atomic_layout(n, d, mode):
    """The register layout of the latent gradient's ``[n, d]`` float32 block (``n == 64``, over the two consumer
    warpgroups as :func:`_wgmma_layout` splits ``d``) for :data:`ATOMIC_LAYOUTS` ``[mode]``. As linear-layout bases
    ([row, column] per register, lane and warp bit): the ``wgmma`` result's are registers (col 1, row 8, col 8 ..
    d/4), lanes (col 2, col 4, row 1, row 2, row 4), warps (row 16, row 32, col d/2)."""
    assert n == 64 and d >= 128 and d & (d - 1) == 0, (n, d)
    if ATOMIC_LAYOUTS[mode] == "fragments":
        return _wgmma_layout(d)
    high = [[0, c] for c in (8, 16, 32, 64, 128, 256, 512, 1024) if c <= d // 4]
    warps = [[16, 0], [32, 0], [0, d // 2]]
    if ATOMIC_LAYOUTS[mode] == "v4":   # the row-8 register bit and the col-2 lane bit trade places
        regs, lanes = [[0, 1], [0, 2]] + high, [[8, 0], [0, 4], [1, 0], [2, 0], [4, 0]]
    elif ATOMIC_LAYOUTS[mode] == "halves":   # the col-8 register bit and the col-2 lane bit trade places
        regs, lanes = [[0, 1], [0, 2], [8, 0]] + high[1:], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    else:   # "lines": columns 4, 8, 16 on lanes, rows 4 and 8 on registers
        regs, lanes = [[0, 1], [0, 2]] + high[2:] + [[4, 0], [8, 0]], [[0, 4], [0, 8], [0, 16], [1, 0], [2, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[n, d])


@gluon.constexpr_function
def _wg_layout(n):
    """The register layout of a ``[64, n]`` ``wgmma`` result held by one warpgroup (four warps of 16 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _gather_rows(dst, base, stride_row, rows, valid, D: gl.constexpr, GATHER_ROWS: gl.constexpr,
                 layout: gl.constexpr):
    """``cp.async`` of the rows ``base + rows * stride_row`` (``[GATHER_ROWS]`` int64, zero-filled where not
    ``valid``) of ``D`` elements into ``dst`` (a ``[GATHER_ROWS, D]`` shared-memory view)."""
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    _cp_async(dst, ptrs, mask=valid[:, None] & (offs_d[None, :] < D))


@gluon.jit
def _program_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib, stride_it, stride_lb, stride_lt,
                  H: gl.constexpr, D: gl.constexpr):
    """This program's query ``t`` (program 0), 64-head block (program 1) and batch ``b`` (program 2):
    ``(b, q_row, do_row, lse_row, IDX, KV)``, the offsets of its first head in ``Q``, in a contiguous
    ``[B, T, H, D]`` gradient and in ``LSE``, and ``IDX`` and ``KV`` advanced to its index row and batch. int64: at
    1M tokens x H x D the offsets pass 2^31. Asserts the shapes every Gluon sparse MLA kernel needs."""
    gl.static_assert(H % _BLOCK_H == 0)
    gl.static_assert(D % 64 == 0)
    gl.static_assert(D <= 512)   # D // 2 columns per warpgroup: wgmma's N is at most 256
    t = gl.program_id(0).to(gl.int64)
    pid_h = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    n_q = gl.num_programs(0).to(gl.int64)
    q_row = b * stride_qb + t * stride_qt + pid_h * _BLOCK_H * stride_qh
    do_row = ((b * n_q + t) * H + pid_h * _BLOCK_H) * D
    lse_row = b * stride_lb + t * stride_lt + pid_h * _BLOCK_H
    return b, q_row, do_row, lse_row, IDX + b * stride_ib + t * stride_it, KV + b * stride_kvb


@gluon.jit
def _fwd_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib, stride_it, stride_ob, stride_ot,
              stride_oh, stride_lb, stride_lt, H: gl.constexpr, D: gl.constexpr):
    """A forward program's ``(q_row, lse_row, out_row, IDX, KV)``: :func:`_program_rows` and the offset of its
    first head in ``OUT``."""
    b, q_row, _, lse_row, IDX, KV = _program_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib,
                                                  stride_it, stride_lb, stride_lt, H, D)
    out_row = b * stride_ob + gl.program_id(0).to(gl.int64) * stride_ot + gl.program_id(1) * _BLOCK_H * stride_oh
    return q_row, lse_row, out_row, IDX, KV


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, RELEASES: gl.constexpr = 1):
    """``(q_bar, ready, empty)``: the query tile's barrier and the key ring's ``[STAGES, 1]`` full/empty barriers,
    initialized. Every producer thread arrives once per fill (``cp.async.mbarrier.arrive.noinc``), each of the
    ``RELEASES`` consumer partitions once per release."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=32 * _PRODUCER_WARPS)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=32 * _PRODUCER_WARPS)
        mbarrier.init(empty.index(s), count=RELEASES)
    return q_bar, ready, empty


@gluon.jit
def _invalidate_barriers(q_bar, ready, empty, STAGES: gl.constexpr):
    """Invalidate the barriers of :func:`_ring_barriers` once both partitions have finished."""
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _producer(Q, DO, KV, IDX, q_smem, do_smem, kv_smem, q_bar, ready, empty, q_row, do_row, stride_qh, stride_kvs,
              n_idx, n_blocks, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GATHER_ROWS: gl.constexpr, WITH_DO: gl.constexpr, INDICES_AHEAD: gl.constexpr):
    """The producer partition: the query tile ``[64, D]`` into ``q_smem`` (and with ``WITH_DO`` the output
    gradient's tile, rows ``do_row + h * D``, into ``do_smem``; signals ``q_bar``), then key block ``j``'s latent
    rows into ring slot ``j % STAGES`` once the consumers have released it (``empty``), each slot signalled on
    ``ready`` when every producer thread's copies have landed.

    By default each batch of ``GATHER_ROWS`` key rows loads its indices after the wait for the slot, so its copies
    wait a round trip to L2 for them; the gathers run at ~23 GB/s per SM (``docs/dsa_kernels.md``). With
    ``INDICES_AHEAD`` (the ring forward's ``(64, 2)`` configuration) a block's indices are loaded right after the
    previous block's copies are issued, their round trip under the wait for the slot, and the block goes in one
    batch of copies (two key rows per warp and repetition: 8 indices per thread)."""
    warps: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [warps, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    offs_r = gl.arange(0, GATHER_ROWS, layout=rows_l)
    kv_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])
    offs_b = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, kv_layout))
    if INDICES_AHEAD:
        idx = gl.load(IDX + offs_b, mask=offs_b < n_idx, other=-1)
    for r0 in gl.static_range(0, _BLOCK_H, GATHER_ROWS):
        heads = (r0 + offs_r).to(gl.int64)
        _gather_rows(q_smem.slice(r0, GATHER_ROWS), Q + q_row, stride_qh, heads, heads >= 0, D, GATHER_ROWS, layout)
        if WITH_DO:
            _gather_rows(do_smem.slice(r0, GATHER_ROWS), DO + do_row, D, heads, heads >= 0, D, GATHER_ROWS, layout)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)   # a new barrier passes parity 1 at once
        buf = kv_smem.index(slot)
        if INDICES_AHEAD:
            rows = idx.to(gl.int64)
            _gather_rows(buf, KV, stride_kvs, rows, rows >= 0, D, BLOCK_K, kv_layout)
        else:
            for r0 in gl.static_range(0, BLOCK_K, GATHER_ROWS):
                offs_k = j * BLOCK_K + r0 + offs_r
                rows_g = gl.load(IDX + offs_k, mask=offs_k < n_idx, other=-1).to(gl.int64)
                _gather_rows(buf.slice(r0, GATHER_ROWS), KV, stride_kvs, rows_g, rows_g >= 0, D, GATHER_ROWS, layout)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
        if INDICES_AHEAD:
            offs_n = (j + 1) * BLOCK_K + offs_b
            idx = gl.load(IDX + offs_n, mask=offs_n < n_idx, other=-1)


@gluon.jit
def _drain_ring(q_bar, ready, empty, n_blocks, STAGES: gl.constexpr):
    """A default partition that releases each ring slot as soon as its block has landed (benchmarks only): the
    producer's copies with nothing to wait for but their own round trips."""
    gl.static_assert(gl.num_warps() == _CONSUMER_WARPS)
    mbarrier.wait(q_bar, 0)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        _cta_barrier()   # every consumer warp has passed the wait before the slot is handed back
        mbarrier.arrive(empty.index(slot))


@gluon.jit
def _ring_softmax(scores, idx, m_i, l_i, l_block, scale_log2, ROW_SUM_AT_END: gl.constexpr):
    """One key block's step of the online softmax (base 2): ``scores [64, BLOCK_K]`` float32 of ``Q K^T`` with
    the block's indices ``idx [BLOCK_K]`` (``-1``: masked), the running row max ``m_i`` and denominator (``l_i``,
    or ``l_block`` per element with ``ROW_SUM_AT_END``). Returns ``p`` (float32, unnormalized), ``alpha`` (the
    factor the accumulated ``O`` takes: ``exp2(m_old - m_new)``, per row of ``scores``' layout) and the updated
    ``m_i, l_i, l_block``. A row with no valid key so far keeps ``m = -inf`` and ``p = 0``."""
    s = gl.where((idx >= 0)[None, :], scores * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    if ROW_SUM_AT_END:
        l_block = l_block * alpha[:, None] + p
    else:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i, l_block


RESCALE_SLACK = 8.0
"""How far (base-2 logits) a row's max may rise above the max its ``P`` and ``O`` are held at before
``LAZY_RESCALE`` rescales them: ``P`` stays at most ``2^8`` (exact in bf16's exponent range, its sum in float32
far from overflow), and FlashAttention-4's conditional rescaling uses the same bound."""
_RESCALE_SLACK = gl.constexpr(RESCALE_SLACK)


@gluon.jit
def _ring_softmax_lazy(scores, idx, m_i, l_block, acc, scale_log2):
    """:func:`_ring_softmax` with ``ROW_SUM_AT_END`` and conditional rescaling (FlashAttention-4, Dao et al.
    2025): ``P`` is taken against the running max ``m_i`` as long as no logit of the block exceeds it by more than
    :data:`RESCALE_SLACK`; only when one does (the first block with a valid key, then rarely) is the row max formed
    and ``acc`` (``[64, D]`` float32, the ``wgmma`` layout) and ``l_block`` rescaled to it. ``O = acc / l`` and
    the log-sum-exp ``m_i + log2(l)`` are exact for any ``m_i`` the exponentials were taken against, so the skip
    changes only rounding. The common path costs one CTA-wide test instead of the cross-warpgroup row max, and
    drops ``acc``'s 128 multiplies per thread, which stood between the softmax and ``P V`` with the tensor cores
    idle. A row's largest ``P`` is no longer exactly 1, so where one key dominates a row its bf16 rounding
    (relative ``2^-9``, that of ``O``'s own store) reaches ``O``. Returns ``(p, m_i, l_block, acc)``."""
    s = gl.where((idx >= 0)[None, :], scores * scale_log2, float("-inf"))
    # m_i = -inf (no valid key yet) + slack stays -inf: any valid logit of such a row takes the branch
    rises = gl.where(s > (m_i + _RESCALE_SLACK)[:, None], 1, 0)
    if gl.max(rises) > 0:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        l_block = l_block * alpha[:, None]
        m_i = m_new
    p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    return p, m_i, l_block + p, acc


@gluon.jit
def _ring_store(OUT, LSE, out_row, stride_oh, lse_row, acc, m_i, l_i, l_block, ROW_SUM_AT_END: gl.constexpr):
    """``O = acc / l`` (``acc [64, D]`` float32 in the ``wgmma`` layout) into ``OUT`` and its natural-log
    log-sum-exp into ``LSE`` (``-inf`` and ``O = 0`` for a row with no valid key)."""
    o_l: gl.constexpr = acc.type.layout
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    if ROW_SUM_AT_END:
        l_i = gl.sum(l_block, axis=1)
    has_any = l_i > 0
    l_safe = gl.where(has_any, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, rows_o)[:, None]
    lse = gl.where(has_any, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    offs_h = gl.arange(0, _BLOCK_H, layout=rows_o)
    offs_v = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_l))
    gl.store(OUT + out_row + offs_h[:, None] * stride_oh + offs_v[None, :], out.to(OUT.dtype.element_ty))
    gl.store(LSE + lse_row + gl.arange(0, _BLOCK_H, layout=m_i.type.layout), lse)


@gluon.jit
def _ring_start(IDX, q_smem, kv_smem, q_bar, ready, n_idx, D: gl.constexpr, BLOCK_K: gl.constexpr):
    """The ring forward consumers' start: the running max ``m_i`` (``-inf``) and denominator ``l_i`` (and
    ``l_block``, its per-element form) at zero, ``acc [64, D]`` and ``s_init [64, BLOCK_K]`` float32 zeros in the
    ``wgmma`` layouts, the key offsets ``offs_kb`` of a block, and the first block's ``scores`` (``Q K_0^T``) with
    its indices ``idx``."""
    s_l: gl.constexpr = _wgmma_layout(BLOCK_K)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([_BLOCK_H], gl.float32, rows_s)
    acc = gl.zeros([_BLOCK_H, D], gl.float32, _wgmma_layout(D))
    s_init = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, s_l)
    offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    # cp.async writes through the generic proxy, wgmma reads through the async proxy: a proxy fence after each
    # wait orders the two (the PTX memory model's rule; one fence per key block)
    fence_async_shared()
    s_tok = warpgroup_mma(q_smem, kv_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    idx = gl.load(IDX + offs_kb, mask=offs_kb < n_idx, other=-1)
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    return m_i, l_i, s_init, acc, s_init, offs_kb, scores, idx


@gluon.jit
def _consumer(IDX, OUT, LSE, q_all, kv_smem, p_smem, q_bar, ready, empty, out_row, stride_oh, lse_row, n_idx,
              n_blocks, scale_log2, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              ROW_SUM_AT_END: gl.constexpr, LAZY_RESCALE: gl.constexpr = False):
    """The default partition (two warpgroups): online softmax over the key blocks the producer delivers, ``O``
    normalized and stored with its log-sum-exp. With ``ROW_SUM_AT_END`` the softmax's denominator is kept per
    element (``[64, BLOCK_K]``, rescaled with ``O``) and summed over the keys once after the last block: one
    reduction across the two warpgroups (through shared memory, with a barrier) per block instead of two. With
    ``LAZY_RESCALE`` (needs ``ROW_SUM_AT_END``) ``O`` is rescaled only when a row's max rises by more than
    :data:`RESCALE_SLACK` (:func:`_ring_softmax_lazy`). ``q_all``: the query tile as ``[1, 64, D]``."""
    gl.static_assert(gl.num_warps() == _CONSUMER_WARPS)
    gl.static_assert(ROW_SUM_AT_END or not LAZY_RESCALE)
    rows_o: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(D))
    m_i, l_i, l_block, acc, s_init, offs_kb, scores, idx = _ring_start(IDX, q_all.index(0), kv_smem, q_bar, ready,
                                                                       n_idx, D, BLOCK_K)
    for j in range(n_blocks):
        slot = j % STAGES
        if LAZY_RESCALE:
            # the lazy branch leaves too few uniform registers for q's 32 hoisted wgmma descriptors (ptxas spilled
            # them, 192 bytes, reloaded every block): addressed anew in each iteration they stay in the loop
            q_smem = q_all.index(_opaque_zero(j, n_idx + n_blocks))
            p, m_i, l_block, acc = _ring_softmax_lazy(scores, idx, m_i, l_block, acc, scale_log2)
        else:
            q_smem = q_all.index(0)
            p, alpha, m_i, l_i, l_block = _ring_softmax(scores, idx, m_i, l_i, l_block, scale_log2, ROW_SUM_AT_END)
            acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        p_smem.store(p.to(p_smem.dtype))
        # every consumer warp's part of P is in shared memory and visible to wgmma's (async) proxy
        fence_async_shared()
        _cta_barrier()
        acc_tok = warpgroup_mma(p_smem, kv_smem.index(slot), acc, is_async=True)
        # block j + 1's indices: their round trip to L2 runs under P_j V_j and the wait for the block, not in
        # the softmax between the two products
        offs_k = (j + 1) * BLOCK_K + offs_kb
        idx = gl.load(IDX + offs_k, mask=offs_k < n_idx, other=-1)
        nxt = gl.minimum(j + 1, n_blocks - 1)   # the last iteration recomputes its own block's scores, unused
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        fence_async_shared()
        s_tok = warpgroup_mma(q_smem, kv_smem.index(nxt % STAGES).permute((1, 0)), s_init, use_acc=False,
                              is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc_tok,))   # P_j V_j retired; Q K_{j+1}^T may run on
        _cta_barrier()   # both warpgroups' P_j V_j: the slot and P are free
        mbarrier.arrive(empty.index(slot))
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    _ring_store(OUT, LSE, out_row, stride_oh, lse_row, acc, m_i, l_i, l_block, ROW_SUM_AT_END)


@gluon.jit
def _consumer_under_pv(IDX, OUT, LSE, q_smem, kv_smem, p_smem, q_bar, ready, empty, out_row, stride_oh, lse_row,
                       n_idx, n_blocks, scale_log2, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       ROW_SUM_AT_END: gl.constexpr):
    """The default partition of ``SOFTMAX_UNDER_PV``: :func:`_consumer`'s arithmetic, with block ``j + 1``'s
    softmax run while block ``j``'s ``P V`` is on the tensor cores (FlashAttention-3's intra-warpgroup pipelining,
    Shah et al. 2024, section 3.2). Each iteration issues ``Q K_{j+1}^T``, then ``P_j V_j``; awaits the scores
    only (``wgmma`` groups retire in order); forms ``P_{j+1}`` into the other half of the double-buffered
    ``p_smem [2, 64, BLOCK_K]``; then awaits ``P_j V_j`` and rescales ``O`` by the new max. :func:`_consumer`
    leaves the tensor cores idle through every softmax. The last block's ``P V`` runs after the loop, so no
    block's scores are recomputed. With two ring slots it is slower (one H200: 42.3 ms against 40.9): ``P_j V_j``
    now waits for block ``j + 1`` to land, whose gather starts only when block ``j - 1``'s slot is freed at the
    end of the previous iteration; :func:`_consumer` waits for it under ``P_j V_j`` and its softmax."""
    gl.static_assert(gl.num_warps() == _CONSUMER_WARPS)
    rows_o: gl.constexpr = gl.SliceLayout(1, _wgmma_layout(D))
    m_i, l_i, l_block, acc, s_init, offs_kb, scores, idx = _ring_start(IDX, q_smem, kv_smem, q_bar, ready, n_idx, D,
                                                                       BLOCK_K)
    p, alpha, m_i, l_i, l_block = _ring_softmax(scores, idx, m_i, l_i, l_block, scale_log2, ROW_SUM_AT_END)
    p_smem.index(0).store(p.to(p_smem.dtype))
    idx = gl.load(IDX + BLOCK_K + offs_kb, mask=BLOCK_K + offs_kb < n_idx, other=-1)
    for j in range(n_blocks - 1):
        slot = j % STAGES
        nxt = (j + 1) % STAGES
        mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
        # orders both block j + 1's cp.async rows and this thread's part of P_j (generic proxy) before wgmma's
        # reads (async proxy); the barrier: every consumer warp's part of P_j is written
        fence_async_shared()
        _cta_barrier()
        s_tok = warpgroup_mma(q_smem, kv_smem.index(nxt).permute((1, 0)), s_init, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_smem.index(j % 2), kv_smem.index(slot), acc, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))   # P_j V_j may still run
        p, alpha, m_i, l_i, l_block = _ring_softmax(scores, idx, m_i, l_i, l_block, scale_log2, ROW_SUM_AT_END)
        p_smem.index((j + 1) % 2).store(p.to(p_smem.dtype))   # P_{j-1} V_{j-1}, its last reader, retired
        offs_k = (j + 2) * BLOCK_K + offs_kb
        idx = gl.load(IDX + offs_k, mask=offs_k < n_idx, other=-1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _cta_barrier()   # both warpgroups' P_j V_j retired: slot j and P_j are free
        mbarrier.arrive(empty.index(slot))
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    last = n_blocks - 1
    fence_async_shared()
    _cta_barrier()
    acc_tok = warpgroup_mma(p_smem.index(last % 2), kv_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    _ring_store(OUT, LSE, out_row, stride_oh, lse_row, acc, m_i, l_i, l_block, ROW_SUM_AT_END)


@triton.autotune(configs=GLUON_FWD_CONFIGS, key=["H", "D"])
@gluon.jit
def sparse_mla_fwd_gluon_kernel(
    Q, KV, IDX, OUT, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    n_idx, scale_log2,
    H: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GATHER_ROWS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, INDICES_AHEAD: gl.constexpr = False, PRODUCTS: gl.constexpr = True,
    ROW_SUM_AT_END: gl.constexpr = True, SOFTMAX_UNDER_PV: gl.constexpr = False, LAZY_RESCALE: gl.constexpr = False,
):
    """One query ``t`` (program 0), heads ``[64 * pid_h, 64 * pid_h + 64)`` (program 1), batch ``b`` (program
    2): ``Q [B, T, H, D]`` (``stride(3) == 1``), ``KV [B, S, D]`` (``stride(2) == 1``), ``IDX [B, T, K]`` int32
    or int64, ``OUT [B, T, H, D]``, ``LSE [B, T, H]`` float32; the arguments of
    :func:`kernels.dsa.sparse_attention_triton.sparse_mla_fwd_kernel` with ``d_v == Dqk == D``.
    ``PRODUCTS=False`` (benchmarks only; ``OUT`` and ``LSE`` left unwritten) runs the gathers alone;
    ``ROW_SUM_AT_END``: :func:`_consumer` (one H100, ``full`` shape, 64k, ``(64, 2)``: 40.5 ms with it against
    42.1 without, same call); ``SOFTMAX_UNDER_PV``: :func:`_consumer_under_pv` (``P`` double-buffered, 8 KiB more
    shared memory at ``BLOCK_K = 64``); ``LAZY_RESCALE``: :func:`_consumer` rescales ``O`` only when a row's max
    rises by more than :data:`RESCALE_SLACK` (:func:`_ring_softmax_lazy`)."""
    gl.static_assert(BLOCK_K % GATHER_ROWS == 0)
    gl.static_assert(STAGES >= 2)   # the consumers wait for block j + 1 before they release block j
    q_row, lse_row, out_row, IDX, KV = _fwd_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib,
                                                 stride_it, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, H, D)
    n_blocks = gl.cdiv(n_idx, BLOCK_K)

    dtype: gl.constexpr = Q.dtype.element_ty
    q_all = gl.allocate_shared_memory(dtype, [1, _BLOCK_H, D], _nvmma([_BLOCK_H, D], dtype))
    q_smem = q_all.index(0)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D], _nvmma([BLOCK_K, D], dtype))
    q_bar, ready, empty = _ring_barriers(STAGES)

    if PRODUCTS and SOFTMAX_UNDER_PV:
        p_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_H, BLOCK_K], _nvmma([_BLOCK_H, BLOCK_K], dtype))
        gl.warp_specialize([
            (_consumer_under_pv, (IDX, OUT, LSE, q_smem, kv_smem, p_smem, q_bar, ready, empty, out_row, stride_oh,
                                  lse_row, n_idx, n_blocks, scale_log2, D, BLOCK_K, STAGES, ROW_SUM_AT_END)),
            (_producer, (Q, Q, KV, IDX, q_smem, q_smem, kv_smem, q_bar, ready, empty, q_row, q_row, stride_qh,
                         stride_kvs, n_idx, n_blocks, D, BLOCK_K, STAGES, GATHER_ROWS, False, INDICES_AHEAD)),
        ], [_PRODUCER_WARPS], [PRODUCER_REGS])
    elif PRODUCTS:
        p_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, BLOCK_K], _nvmma([_BLOCK_H, BLOCK_K], dtype))
        gl.warp_specialize([
            (_consumer, (IDX, OUT, LSE, q_all, kv_smem, p_smem, q_bar, ready, empty, out_row, stride_oh, lse_row,
                         n_idx, n_blocks, scale_log2, D, BLOCK_K, STAGES, ROW_SUM_AT_END, LAZY_RESCALE)),
            (_producer, (Q, Q, KV, IDX, q_smem, q_smem, kv_smem, q_bar, ready, empty, q_row, q_row, stride_qh,
                         stride_kvs, n_idx, n_blocks, D, BLOCK_K, STAGES, GATHER_ROWS, False, INDICES_AHEAD)),
        ], [_PRODUCER_WARPS], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_drain_ring, (q_bar, ready, empty, n_blocks, STAGES)),
            (_producer, (Q, Q, KV, IDX, q_smem, q_smem, kv_smem, q_bar, ready, empty, q_row, q_row, stride_qh,
                         stride_kvs, n_idx, n_blocks, D, BLOCK_K, STAGES, GATHER_ROWS, False, INDICES_AHEAD)),
        ], [_PRODUCER_WARPS], [PRODUCER_REGS])

    _invalidate_barriers(q_bar, ready, empty, STAGES)


GLUON_FWD_PAIR_CONFIGS = [
    triton.Config({"GATHER_ROWS": rows, "PRODUCER_REGS": regs, "CONSUMER_REGS": 224},
                  num_warps=WG_WARPS, maxnreg=MAXNREG)
    for rows, regs in [(16, 56), (8, 56)]
]
"""Configurations of :func:`sparse_mla_fwd_pair_kernel`: rows per ``cp.async`` batch and the producer's
registers. The kernel's own ``num_warps`` is the first consumer warpgroup (the default partition); the second
and the producer are worker partitions, 12 warps in all under :data:`MAXNREG`: ``4 * 224 + 4 * 224 + 4 * 56 =
12 * 168``."""


@gluon.jit
def _pair_valid(IDX, block, n_idx, s_l: gl.constexpr):
    """Which of key block ``block``'s 64 slots hold an index (not ``-1``, not past ``n_idx``), in the columns of the
    score layout ``s_l``. Loaded one slot per thread and then converted: loaded straight into ``s_l``'s columns,
    each thread would compute 16 slots' 64-bit addresses."""
    offs = block * 64 + gl.arange(0, 64, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    idx = gl.load(IDX + offs, mask=offs < n_idx, other=-1)
    return gl.convert_layout(idx >= 0, gl.SliceLayout(0, s_l))


@gluon.jit
def _pair_softmax(scores, valid, m_prev, m_ref, l_i, acc, scale_log2, rows_o: gl.constexpr):
    """One warpgroup's online softmax over its key block: the block's scaled logits (``-inf`` at ``-1`` slots),
    the new running max ``max(m_ref, rowmax)`` (``m_ref`` the max this warpgroup rescales from: its own for the
    first warpgroup, the first's new max for the second), ``P = exp2(logits - max)``, ``l`` and ``acc``
    rescaled from ``m_prev`` to the new max. Returns ``(p, m_new, l, acc)``; a row without a valid key so far
    keeps ``-inf`` as its max and zeros."""
    s = gl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = gl.maximum(m_ref, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_prev - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    return p, m_new, l_i, acc


@gluon.jit
def _opaque_zero(i, bound):
    """``0`` for a loop counter ``i <= bound`` (the caller's loop guarantees it), in a form the compiler cannot
    fold. Shared-memory buffers indexed with it are addressed anew in each iteration, so LLVM does not hoist
    their ``wgmma`` descriptors out of the loop: in :func:`sparse_mla_fwd_pair_kernel`, whose buffers are the
    same every pair, it hoisted ~64 64-bit descriptors per consumer warpgroup, which ptxas kept in local memory
    and reloaded before each ``wgmma`` (1,156 bytes spilled per thread, offline sm_90 build, Triton 3.6; 196 with
    it, none of them descriptors)."""
    return (i > bound).to(gl.int32)


@gluon.jit
def _pair_scores(q_smem, kv_smem, ready, first: gl.constexpr, second: gl.constexpr, phase, s_init, z=0):
    """``S = Q K^T`` of one key block held as two ``[BLOCK_K, D / 2]`` halves (``kv_smem`` slots ``first`` and
    ``second``, each awaited on its ``ready`` barrier in that order, so the product over the first half runs while
    the second lands): ``[64, BLOCK_K]`` float32. ``z``: the loop's :func:`_opaque_zero`."""
    mbarrier.wait(ready.index(first), phase)
    fence_async_shared()
    tok = warpgroup_mma(q_smem.index(first % 2 + z), kv_smem.index(first + z).permute((1, 0)), s_init, use_acc=False,
                        is_async=True)
    mbarrier.wait(ready.index(second), phase)
    fence_async_shared()
    tok = warpgroup_mma(q_smem.index(second % 2 + z), kv_smem.index(second + z).permute((1, 0)), tok, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(tok,))


@gluon.jit
def _pair_store(OUT, LSE, out_row, stride_oh, lse_row, acc, m_i, l_i, l_mine, l_other, l_bar, half: gl.constexpr,
                HALF: gl.constexpr, s_l: gl.constexpr, o_l: gl.constexpr):
    """Both warpgroups' epilogue: exchange the partial row sums (``l_mine`` written, ``l_other`` read once
    ``l_bar`` of the other warpgroup flips), then this warpgroup's half of ``O`` normalized and, from the first,
    the log-sum-exp (natural log; ``-inf`` and a zero row without a valid key)."""
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    l_mine.store(l_i)
    _cta_barrier()
    mbarrier.arrive(l_bar.index(half))
    mbarrier.wait(l_bar.index(1 - half), 0)
    l_sum = l_i + l_other.load(rows_s)
    has_any = l_sum > 0
    l_safe = gl.where(has_any, l_sum, 1.0)
    out = acc / gl.convert_layout(l_safe, rows_o)[:, None]
    offs_h = gl.arange(0, _BLOCK_H, layout=rows_o)
    offs_v = half * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    gl.store(OUT + out_row + offs_h[:, None] * stride_oh + offs_v[None, :], out.to(OUT.dtype.element_ty))
    if half == 0:
        lse = gl.where(has_any, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        gl.store(LSE + lse_row + gl.arange(0, _BLOCK_H, layout=rows_s), lse)


@gluon.jit
def _pair_first(IDX, OUT, LSE, q_smem, kv_smem, s_smem, m_smem, l_smem, q_bar, ready, empty, m_bar, s_bar, l_bar,
                out_row, stride_oh, lse_row, n_idx, n_pairs, scale_log2, D: gl.constexpr):
    """The first consumer warpgroup (the default partition): the even key block of each pair, ``O[:, :D/2]``.

    Per pair ``i``: ``S_0 = Q K_{2i}^T``, its softmax from its own running max, the new max to ``m_smem[0]``
    (signal ``m_bar[0]``), ``O += P_0 V_{2i}[:, :D/2]`` with ``P_0`` in registers; then the pair's max from the
    second warpgroup (``m_bar[1]``), ``P_0`` rescaled to it into ``s_smem[0]`` (signal ``s_bar[0]``), ``O`` rescaled
    and ``O += P_1 V_{2i+1}[:, :D/2]`` with the second's ``P_1`` from ``s_smem[1]`` (``s_bar[1]``). The next
    pair's ``Q K^T`` is issued before the last product is awaited."""
    HALF: gl.constexpr = D // 2
    s_l: gl.constexpr = _wg_layout(64)
    o_l: gl.constexpr = _wg_layout(HALF)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([_BLOCK_H], gl.float32, rows_s)
    acc = gl.zeros([_BLOCK_H, HALF], gl.float32, o_l)
    s_init = gl.zeros([_BLOCK_H, 64], gl.float32, s_l)

    mbarrier.wait(q_bar, 0)
    scores = _pair_scores(q_smem, kv_smem, ready, 0, 1, 0, s_init)
    for i in range(n_pairs):
        phase = i & 1
        z = _opaque_zero(i, n_idx + n_pairs)
        _cta_barrier()
        mbarrier.arrive(empty.index(1))   # K_{2i}'s upper half: this warpgroup's product over it has retired
        valid = _pair_valid(IDX, 2 * i, n_idx, s_l)
        p, m_own, l_i, acc = _pair_softmax(scores, valid, m_i, m_i, l_i, acc, scale_log2, rows_o)
        m_smem.index(0).store(m_own)
        _cta_barrier()
        mbarrier.arrive(m_bar.index(0))
        acc_tok = warpgroup_mma(gl.convert_layout(p.to(s_smem.dtype), p_op), kv_smem.index(0 + z), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _cta_barrier()
        mbarrier.arrive(empty.index(0))   # K_{2i}'s lower half: the QK and PV products over it have retired
        mbarrier.wait(m_bar.index(1), phase)
        m_i = m_smem.index(1).load(rows_s)
        # the pair's max is >= this block's; a row with no valid key yet has P_0 = 0 and nothing to rescale
        fac = gl.where(m_own == float("-inf"), 0.0, gl.exp2(m_own - m_i))
        s_smem.index(0 + z).store((p * fac[:, None]).to(s_smem.dtype))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(s_bar.index(0))
        l_i = l_i * fac
        acc = acc * gl.convert_layout(fac, rows_o)[:, None]
        mbarrier.wait(s_bar.index(1), phase)
        mbarrier.wait(ready.index(2), phase)   # passed already (the second warpgroup's Q K^T awaited it)
        fence_async_shared()
        acc_tok = warpgroup_mma(s_smem.index(1 + z), kv_smem.index(2 + z), acc, is_async=True)
        if i + 1 < n_pairs:
            # the next pair's product over K_{2i+2}'s lower half runs while P_1 V retires
            mbarrier.wait(ready.index(0), phase ^ 1)
            fence_async_shared()
            s_tok = warpgroup_mma(q_smem.index(0 + z), kv_smem.index(0 + z).permute((1, 0)), s_init, use_acc=False,
                                  is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc_tok,))
            _cta_barrier()
            mbarrier.arrive(empty.index(2))   # K_{2i+1}'s lower half: P_1 V over it has retired
            mbarrier.wait(ready.index(1), phase ^ 1)
            fence_async_shared()
            s_tok = warpgroup_mma(q_smem.index(1 + z), kv_smem.index(1 + z).permute((1, 0)), s_tok, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
            _cta_barrier()
            mbarrier.arrive(empty.index(2))

    _pair_store(OUT, LSE, out_row, stride_oh, lse_row, acc, m_i, l_i, l_smem.index(0), l_smem.index(1), l_bar, 0,
                HALF, s_l, o_l)


@gluon.jit
def _pair_second(IDX, OUT, LSE, q_smem, kv_smem, s_smem, m_smem, l_smem, q_bar, ready, empty, m_bar, s_bar, l_bar,
                 out_row, stride_oh, lse_row, n_idx, n_pairs, scale_log2, D: gl.constexpr):
    """The second consumer warpgroup (a worker partition): the odd key block of each pair, ``O[:, D/2:]``.

    Per pair ``i``: ``S_1 = Q K_{2i+1}^T`` (upper half first: its buffer frees earliest), the softmax from the
    first warpgroup's new max (``m_bar[0]``), which makes its new max the pair's, written to ``m_smem[1]``
    (``m_bar[1]``); ``O += P_1 V_{2i+1}[:, D/2:]`` from registers, ``P_1`` to ``s_smem[1]`` (``s_bar[1]``), and
    ``O += P_0 V_{2i}[:, D/2:]`` once the first's rescaled ``P_0`` is in ``s_smem[0]`` (``s_bar[0]``)."""
    HALF: gl.constexpr = D // 2
    s_l: gl.constexpr = _wg_layout(64)
    o_l: gl.constexpr = _wg_layout(HALF)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([_BLOCK_H], gl.float32, rows_s)
    acc = gl.zeros([_BLOCK_H, HALF], gl.float32, o_l)
    s_init = gl.zeros([_BLOCK_H, 64], gl.float32, s_l)

    mbarrier.wait(q_bar, 0)
    for i in range(n_pairs):
        phase = i & 1
        z = _opaque_zero(i, n_idx + n_pairs)
        scores = _pair_scores(q_smem, kv_smem, ready, 3, 2, phase, s_init, z)
        _cta_barrier()
        mbarrier.arrive(empty.index(2))   # K_{2i+1}'s lower half: this warpgroup's product over it has retired
        valid = _pair_valid(IDX, 2 * i + 1, n_idx, s_l)
        mbarrier.wait(m_bar.index(0), phase)
        m_ref = m_smem.index(0).load(rows_s)
        p, m_i, l_i, acc = _pair_softmax(scores, valid, m_i, m_ref, l_i, acc, scale_log2, gl.SliceLayout(1, o_l))
        m_smem.index(1).store(m_i)
        p16 = p.to(s_smem.dtype)
        s_smem.index(1 + z).store(p16)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(m_bar.index(1))
        mbarrier.arrive(s_bar.index(1))
        p_reg = gl.convert_layout(p16, p_op)
        acc_tok = warpgroup_mma(p_reg, kv_smem.index(3 + z), acc, is_async=True)
        mbarrier.wait(s_bar.index(0), phase)
        mbarrier.wait(ready.index(1), phase)   # passed already (the first warpgroup's Q K^T awaited it)
        fence_async_shared()
        acc_tok = warpgroup_mma(s_smem.index(0 + z), kv_smem.index(1 + z), acc_tok, is_async=True)
        warpgroup_mma_wait(num_outstanding=1, deps=(p_reg,))   # the older group, P_1 V, has retired
        _cta_barrier()
        mbarrier.arrive(empty.index(3))   # K_{2i+1}'s upper half: P_1 V over it has retired
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _cta_barrier()
        mbarrier.arrive(empty.index(1))   # K_{2i}'s upper half: P_0 V over it has retired

    _pair_store(OUT, LSE, out_row, stride_oh, lse_row, acc, m_i, l_i, l_smem.index(1), l_smem.index(0), l_bar, 1,
                HALF, s_l, o_l)


@gluon.jit
def _pair_producer(Q, KV, IDX, q_smem, kv_smem, q_bar, ready, empty, q_row, stride_qh, stride_kvs, n_idx, n_pairs,
                   D: gl.constexpr, GATHER_ROWS: gl.constexpr):
    """The producer partition of :func:`sparse_mla_fwd_pair_kernel`: the query tile as two ``[64, D/2]`` halves,
    then per pair the four half blocks in the order the consumers free them: ``K_{2i}`` lower (slot 0), ``K_{2i+1}``
    upper (slot 3), ``K_{2i}`` upper (slot 1), ``K_{2i+1}`` lower (slot 2)."""
    HALF: gl.constexpr = D // 2
    warps: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [warps, 1], [1, 0])
    offs_r = gl.arange(0, GATHER_ROWS, layout=gl.SliceLayout(1, layout))
    # key rows two per warp and repetition: each thread keeps 8 of a block's indices per block, not 16
    kv_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])
    offs_b = gl.arange(0, 64, layout=gl.SliceLayout(1, kv_layout))
    idx_0 = gl.load(IDX + offs_b, mask=offs_b < n_idx, other=-1)
    idx_1 = gl.load(IDX + 64 + offs_b, mask=64 + offs_b < n_idx, other=-1)
    for half in gl.static_range(2):
        for r0 in gl.static_range(0, _BLOCK_H, GATHER_ROWS):
            heads = (r0 + offs_r).to(gl.int64)
            _gather_rows(q_smem.index(half).slice(r0, GATHER_ROWS), Q + q_row + half * HALF, stride_qh, heads,
                         heads >= 0, HALF, GATHER_ROWS, layout)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    for i in range(n_pairs):
        rows_0 = idx_0.to(gl.int64)
        rows_1 = idx_1.to(gl.int64)
        _gather_half_block(KV, kv_smem, ready, empty, i, 0, stride_kvs, rows_0, HALF, kv_layout)
        _gather_half_block(KV, kv_smem, ready, empty, i, 3, stride_kvs, rows_1, HALF, kv_layout)
        # the next pair's indices, in flight while the producer waits for the last two slots
        offs_n = (2 * i + 2) * 64 + offs_b
        idx_0 = gl.load(IDX + offs_n, mask=offs_n < n_idx, other=-1)
        idx_1 = gl.load(IDX + 64 + offs_n, mask=64 + offs_n < n_idx, other=-1)
        _gather_half_block(KV, kv_smem, ready, empty, i, 1, stride_kvs, rows_0, HALF, kv_layout)
        _gather_half_block(KV, kv_smem, ready, empty, i, 2, stride_kvs, rows_1, HALF, kv_layout)


@gluon.jit
def _gather_half_block(KV, kv_smem, ready, empty, i, slot: gl.constexpr, stride_kvs, rows, HALF: gl.constexpr,
                       layout: gl.constexpr):
    """Pair ``i``'s half block in ``kv_smem`` slot ``slot`` (``K_{2i + slot // 2}``, whose 64 indices are ``rows``,
    columns ``slot % 2`` of the two halves of ``HALF``) once the consumers have released it, signalled on
    ``ready``."""
    mbarrier.wait(empty.index(slot), (i & 1) ^ 1)   # a new barrier passes parity 1 at once
    _gather_rows(kv_smem.index(slot), KV + (slot % 2) * HALF, stride_kvs, rows, rows >= 0, HALF, 64, layout)
    async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@triton.autotune(configs=GLUON_FWD_PAIR_CONFIGS, key=["H", "D"])
@gluon.jit
def sparse_mla_fwd_pair_kernel(
    Q, KV, IDX, OUT, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    n_idx, scale_log2,
    H: gl.constexpr, D: gl.constexpr, GATHER_ROWS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """The sparse MLA forward with key blocks in pairs, one 64-key block per consumer warpgroup (FlashMLA's
    sparse prefill schedule for sm_90, DeepSeek, ``csrc/sm90/prefill/sparse/phase1.cuh``): same arguments and
    contract as :func:`sparse_mla_fwd_gluon_kernel`.

    The ring kernel splits each block's ``Q K^T`` between its two warpgroups (``N`` 32 each, both reading all of
    ``q`` from shared memory) and runs both softmaxes in lock step, the tensor cores idle meanwhile. Here each
    warpgroup takes a whole block of each pair (``N`` 64: ``q`` read once per block), its softmax runs while the
    other warpgroup's products do, and its own ``P`` feeds ``P V`` from registers; only the other block's ``P``
    passes through shared memory. The two keep one running max per row: the first warpgroup's new max goes to
    the second, whose max is the pair's and comes back, so both rescale to it. Each owns half of ``d_v`` (a
    ``[64, D/2]`` float32 accumulator). The latent blocks are held in halves of ``D/2`` columns, each released as
    soon as the products that read it retire: ``K_{2i}``'s lower half after the first warpgroup's ``P_0 V``, its
    upper half after the second's ``P_0 V``; ``K_{2i+1}`` the other way round.

    Shared memory: ``q`` 64 KiB, four half blocks 128 KiB, two ``P`` tiles 16 KiB (at ``D`` 512). The training
    path's forward (:data:`FWD_SCHEDULE`): on one H100 (``full`` shape, 64k) 38.2 ms against the ring kernel's
    40.3. Its buffers are indexed through :func:`_opaque_zero`; before, with 1.1 KB of hoisted ``wgmma``
    descriptors spilled and reloaded before every ``wgmma``, it ran 55.4 ms (``docs/dsa_kernels.md``)."""
    gl.static_assert(64 % GATHER_ROWS == 0)
    gl.static_assert(gl.num_warps() == _WG_WARPS)
    q_row, lse_row, out_row, IDX, KV = _fwd_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib,
                                                 stride_it, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, H, D)
    n_pairs = gl.cdiv(n_idx, 128)

    HALF: gl.constexpr = D // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_H, HALF], _nvmma([_BLOCK_H, HALF], dtype))
    kv_smem = gl.allocate_shared_memory(dtype, [4, 64, HALF], _nvmma([64, HALF], dtype))
    s_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_H, 64], _nvmma([_BLOCK_H, 64], dtype))
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_H], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_H], vec)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    m_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    s_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=32 * _PRODUCER_WARPS)
    for s in gl.static_range(4):
        mbarrier.init(ready.index(s), count=32 * _PRODUCER_WARPS)
        # slots 0 and 3 are read by their own warpgroup only, 1 and 2 by both
        mbarrier.init(empty.index(s), count=1 if s == 0 or s == 3 else 2)
    for w in gl.static_range(2):
        mbarrier.init(m_bar.index(w), count=1)
        mbarrier.init(s_bar.index(w), count=1)
        mbarrier.init(l_bar.index(w), count=1)

    gl.warp_specialize([
        (_pair_first, (IDX, OUT, LSE, q_smem, kv_smem, s_smem, m_smem, l_smem, q_bar, ready, empty, m_bar, s_bar, l_bar,
                       out_row, stride_oh, lse_row, n_idx, n_pairs, scale_log2, D)),
        (_pair_second, (IDX, OUT, LSE, q_smem, kv_smem, s_smem, m_smem, l_smem, q_bar, ready, empty, m_bar, s_bar,
                        l_bar, out_row, stride_oh, lse_row, n_idx, n_pairs, scale_log2, D)),
        (_pair_producer, (Q, KV, IDX, q_smem, kv_smem, q_bar, ready, empty, q_row, stride_qh, stride_kvs, n_idx,
                          n_pairs, D, GATHER_ROWS)),
    ], [_WG_WARPS, _PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(q_bar)
    for s in gl.static_range(4):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for w in gl.static_range(2):
        mbarrier.invalidate(m_bar.index(w))
        mbarrier.invalidate(s_bar.index(w))
        mbarrier.invalidate(l_bar.index(w))


_FWD_KERNELS = {"ring": sparse_mla_fwd_gluon_kernel, "pair": sparse_mla_fwd_pair_kernel}
GLUON_FWD_AHEAD_FLIPPED = [triton.Config(dict(cfg.kwargs, INDICES_AHEAD=not cfg.kwargs["INDICES_AHEAD"]),
                                         num_warps=cfg.num_warps, maxnreg=cfg.maxnreg) for cfg in GLUON_FWD_CONFIGS]
"""The ring forward's configurations with the producer's ``INDICES_AHEAD`` (:func:`_producer`) the other way:
timed and checked beside :data:`GLUON_FWD_CONFIGS` by the benchmarks and the GPU smoke test, not autotuned."""
GLUON_FWD_ROW_SUM_FLIPPED = [triton.Config(dict(GLUON_FWD_CONFIGS[0].kwargs, ROW_SUM_AT_END=False),
                                            num_warps=GLUON_FWD_CONFIGS[0].num_warps,
                                            maxnreg=GLUON_FWD_CONFIGS[0].maxnreg)]
"""The ring forward's first configuration with the denominator summed per block (``ROW_SUM_AT_END=False``,
:func:`_consumer`): timed and checked beside the others, not autotuned."""
GLUON_FWD_UNDER_PV = [triton.Config(dict(GLUON_FWD_CONFIGS[0].kwargs, SOFTMAX_UNDER_PV=True),
                                     num_warps=GLUON_FWD_CONFIGS[0].num_warps, maxnreg=GLUON_FWD_CONFIGS[0].maxnreg)]
"""The ring forward's first configuration with each block's softmax under the previous block's ``P V``
(``SOFTMAX_UNDER_PV``, :func:`_consumer_under_pv`): timed and checked beside the others, not autotuned. Slower on
one H200 (``full`` shape, 64k, same process): 42.3 ms against the default's 40.9 (``docs/dsa_kernels.md``)."""
GLUON_FWD_LAZY = [triton.Config(dict(GLUON_FWD_CONFIGS[0].kwargs, LAZY_RESCALE=True),
                                 num_warps=GLUON_FWD_CONFIGS[0].num_warps, maxnreg=GLUON_FWD_CONFIGS[0].maxnreg)]
"""The ring forward's first configuration with conditional rescaling (``LAZY_RESCALE``,
:func:`_ring_softmax_lazy`): timed and checked beside the others, not autotuned."""
GLUON_FWD_TRIALS = {"ring": GLUON_FWD_CONFIGS + GLUON_FWD_AHEAD_FLIPPED + GLUON_FWD_ROW_SUM_FLIPPED
                    + GLUON_FWD_UNDER_PV + GLUON_FWD_LAZY, "pair": GLUON_FWD_PAIR_CONFIGS}
"""The Gluon forwards by schedule, each with every configuration the benchmarks time and check: ``"ring"`` (both
warpgroups on each key block, a ring of ``STAGES`` buffers; its autotuned configurations, then the same with the
producer's ``INDICES_AHEAD`` the other way, the first with its row sum per block, and the first with its softmax
under ``P V``) and ``"pair"`` (one warpgroup per block of a pair, FlashMLA's schedule)."""
FWD_SCHEDULE = "pair"
"""The schedule :func:`gluon_sparse_mla_fwd` runs (the training path's Gluon forward). One H100, ``full`` shape,
64k, same process (``sparse_mla_tilings.py --gluon-only --fwd-only``): ``"pair"`` 38.2 ms (464 TF/s), the ring
40.3 ms (440), the ring with conditional rescaling 38.5 ms (460); the op's fwd+bwd (``dsa_bench.py table``,
separate processes) 203.3 ms with the pair forward, 205.9 with the ring. With the pair forward shipped, one
H100, ``dsa_bench.py table --ops attention --dkv query`` (anchor 786 TF/s): forward 37.2 ms (477 TF/s) at 64k and
149.9 ms (473) at 256k; fwd+bwd 202.4 ms (306) and 822.7 ms (302). One H200, the same command (anchor 789): forward
37.8 ms (469) and 153.3 ms (462), fwd+bwd 207.1 ms (299.5) and 832.0 ms (298.2)."""


GLUON_DKV_CONFIGS = [
    triton.Config({"BLOCK_K": 64, "GATHER_ROWS": 16, "PRODUCER_REGS": regs}, num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
    for regs in (56,)
]
"""Configurations of :func:`sparse_mla_dkv_gluon_kernel`: one 64-key buffer (``q`` and ``dO`` take 128 KiB of
the SM's shared memory), released as soon as ``Q K^T`` and ``dO V^T`` of its block retire."""
DKV_INDICES_AHEAD = False
"""The producer's ``INDICES_AHEAD`` (:func:`_producer`) :func:`gluon_sparse_mla_dkv` launches with (one H100,
``full`` shape, 64k: 135.4 ms without, 135.6 with)."""
DKV_ATOMIC_LAYOUT = "lines"
"""The :data:`ATOMIC_LAYOUTS` entry :func:`gluon_sparse_mla_dkv` launches with. One H100, ``full`` shape, 64k:
116.5 ms in 128-byte lines against 135.6 in the ``wgmma`` fragments and 138.1 in ``v4``: the number of requests
each SM issues bounds the atomics, not the instructions; the conversion through shared memory costs ~10 ms of it."""

DKV_ATOMIC_WARPS = 0
"""Warps of the latent gradient's own atomics partition (``ATOMIC_WARPS``, :func:`_dkv_atomics`; 0: the consumers
issue the atomics). With 4 it launches :data:`GLUON_DKV_STAGED_CONFIG` in :data:`DKV_STAGED_PIECES` pieces. Off:
slower. One H100, ``full`` shape, 64k, same process (``sparse_mla_backward_configs.py``, anchor 781 TF/s): 121.4
ms against 109.5 for the consumers' atomics, and the op's fwd+bwd 214.8 against 202.1 ms (256k: 888.5 against
843.3)."""
DKV_STAGED_PIECES = 8
"""Column pieces with an atomics partition: ``[64, 64]`` float32, the 16 KiB stage left beside ``q``, ``dO``, the
latent buffer and ``P^T`` / ``dS^T`` (208 KiB)."""
GLUON_DKV_STAGED_CONFIG = triton.Config(
    {"BLOCK_K": 64, "GATHER_ROWS": 16, "PRODUCER_REGS": 56, "ATOMIC_REGS": 72}, num_warps=CONSUMER_WARPS, maxnreg=128)
"""The latent gradient with an atomics partition: 16 warps (``16 * 32 * 128 = 65,536`` registers at launch), then
``setmaxnreg`` gives the producer 56, the atomics 72 (a piece is 32 floats per thread) and the consumers 192.
Offline sm_90 compile (Triton 3.6): 224 KiB of shared memory, the consumers spill 160 bytes (values reloaded
once per piece)."""

DKV_SCORES_AHEAD = True
"""Whether :func:`gluon_sparse_mla_dkv` issues the next key block's score products before the last piece's
atomics (:func:`_dkv_consumer_ahead`; with :data:`DKV_PIECES` >= 2)."""
DKV_PIECES = 4
"""Column pieces :func:`gluon_sparse_mla_dkv` forms and adds each key block's latent gradient in
(:func:`_dkv_consumer`). The atomics alone take 83.3 ms of the kernel's 115.5 at the ``full`` shape, 64k tokens
(one H100, ``tests/benchmarks/sparse_mla_atomics.py``); issued after all of a block's products, they leave the
tensor cores idle. In pieces, each piece's products run under the previous piece's atomics. One H100, same process
(``sparse_mla_tilings.py --gluon-only --dkv-only``, anchor 776 TF/s): one piece 117.4 ms, 2 pieces 116.3 (112.5
with the scores ahead), 4 pieces 111.1 (**109.6** with the scores ahead)."""


@gluon.jit
def _backward_tiles(dtype: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The backward kernels' shared memory for the program's 64 heads: ``(q_smem, do_smem, kv_smem)``, ``q`` and
    ``dO`` as ``[64, D]`` tiles and the latent as a ``[STAGES, BLOCK_K, D]`` ring, ``dtype``, ``wgmma``-swizzled."""
    q_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, D], _nvmma([_BLOCK_H, D], dtype))
    do_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, D], _nvmma([_BLOCK_H, D], dtype))
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, D], _nvmma([BLOCK_K, D], dtype))
    return q_smem, do_smem, kv_smem


@gluon.jit
def _scores_and_dp(q_smem, do_smem, kv_block, s_init, IDX, offs_k, n_idx):
    """``S = Q K^T`` and ``dP = dO V^T`` of one latent block (``V`` is the latent), both issued before either is
    awaited: ``[64, BLOCK_K]`` float32 each, in ``s_init``'s layout; and the block's indices ``IDX[offs_k]``
    (``-1`` past ``n_idx``), loaded while the products run so that their round trip to L2 is not added to them."""
    kv_t = kv_block.permute((1, 0))
    s_tok = warpgroup_mma(q_smem, kv_t, s_init, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_smem, kv_t, s_init, use_acc=False, is_async=True)
    idx = gl.load(IDX + offs_k, mask=offs_k < n_idx, other=-1)
    scores, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, dp_tok))
    return scores, dp, idx


@gluon.jit
def _backward_rows(LSE, DELTA, lse_row, s_l: gl.constexpr):
    """The 64 heads' rows of the backward, in the score layout ``s_l``'s row slice: ``lse`` in base 2 (0 where the
    row has no valid index), whether it has one, and ``delta = rowsum(dO O)``."""
    offs_h = gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, s_l))
    lse = gl.load(LSE + lse_row + offs_h)
    row_ok = lse > float("-inf")
    return gl.where(row_ok, lse * 1.4426950408889634, 0.0), row_ok, gl.load(DELTA + lse_row + offs_h)


@gluon.jit
def _probs_and_ds(scores, dp, idx, lse2, row_ok, delta, scale, scale_log2):
    """``P = exp(scale S - lse)`` (0 at a ``-1`` slot or a row without a valid index) and ``dS = scale P (dP -
    delta)`` of one ``[64, BLOCK_K]`` block, from ``S = Q K^T`` and ``dP = dO V^T``."""
    p = gl.exp2(scores * scale_log2 - lse2[:, None])
    p = gl.where((idx >= 0)[None, :] & row_ok[:, None], p, 0.0)
    return p, p * (dp - delta[:, None]) * scale


@gluon.jit
def _add_rows(DKV, stride_dks, rows, col0: gl.constexpr, block, ATOMICS: gl.constexpr):
    """``DKV[rows[r], col0 + c] += block[r, c]`` with relaxed float32 atomics in ``block``'s layout, skipping rows
    ``-1``. ``ATOMICS=False`` (benchmarks only): issued but predicated off (no row is below -1), the atomics'
    memory traffic out of the timing."""
    offs_d = col0 + gl.arange(0, block.shape[1], layout=gl.SliceLayout(0, block.type.layout))
    keep = rows >= 0 if ATOMICS else rows < -1
    gl.atomic_add(DKV + rows[:, None] * stride_dks + offs_d[None, :], block, mask=keep[:, None], sem="relaxed")


@gluon.jit
def _dkv_piece(dst_smem, pt_smem, q_smem, do_smem, p_init, col0: gl.constexpr):
    """Issue columns ``[col0, col0 + PIECE)`` of one key block's latent gradient, ``dS^T q + P^T dO``
    (``PIECE`` = ``p_init``'s width, ``[BLOCK_K, PIECE]`` float32 in ``p_init``'s layout): two asynchronous
    ``wgmma`` groups, the token of the second returned."""
    width: gl.constexpr = p_init.shape[1]
    if width == q_smem.shape[1]:
        acc = warpgroup_mma(dst_smem, q_smem, p_init, use_acc=False, is_async=True)
        acc = warpgroup_mma(pt_smem, do_smem, acc, is_async=True)
    else:
        acc = warpgroup_mma(dst_smem, q_smem.slice(col0, width, dim=1), p_init, use_acc=False, is_async=True)
        acc = warpgroup_mma(pt_smem, do_smem.slice(col0, width, dim=1), acc, is_async=True)
    return acc


@gluon.jit
def _dkv_block_start(scores, dp, idx, lse2, row_ok, delta, scale, scale_log2, pt_smem, dst_smem, q_smem, do_smem,
                     p_init, IDX, rows_k, n_idx):
    """One key block's ``P^T`` and ``dS^T`` (from its scores, :func:`_probs_and_ds`) into shared memory, every
    consumer warp's part visible to ``wgmma``; then the first column piece's products issued and the block's atomic
    rows ``IDX[rows_k]`` (int64, ``-1`` past ``n_idx``) loaded under them: ``(token, rows)``."""
    p, ds = _probs_and_ds(scores, dp, idx, lse2, row_ok, delta, scale, scale_log2)
    pt_smem.store(gl.permute(p.to(pt_smem.dtype), (1, 0)))
    dst_smem.store(gl.permute(ds.to(dst_smem.dtype), (1, 0)))
    fence_async_shared()
    _cta_barrier()
    acc = _dkv_piece(dst_smem, pt_smem, q_smem, do_smem, p_init, 0)
    rows = gl.load(IDX + rows_k, mask=rows_k < n_idx, other=-1).to(gl.int64)
    return acc, rows


@gluon.jit
def _dkv_next_piece(acc, dst_smem, pt_smem, q_smem, do_smem, p_init, col0: gl.constexpr):
    """Issue the column piece at ``col0`` (:func:`_dkv_piece`), then await the piece ``acc`` is the token of (its
    two ``wgmma`` groups; the new piece's two stay in flight): ``(new token, finished piece)``."""
    nxt = _dkv_piece(dst_smem, pt_smem, q_smem, do_smem, p_init, col0)
    return nxt, warpgroup_mma_wait(num_outstanding=2, deps=(acc,))


@gluon.jit
def _dkv_consumer(IDX, LSE, DELTA, DKV, q_smem, do_smem, kv_smem, pt_smem, dst_smem, q_bar, ready, empty, lse_row,
                  stride_dks, n_idx, n_blocks, scale, scale_log2, D: gl.constexpr, BLOCK_K: gl.constexpr,
                  ATOMICS: gl.constexpr, PRODUCTS: gl.constexpr, ATOMIC_LAYOUT: gl.constexpr,
                  PIECES: gl.constexpr):
    """The default partition of :func:`sparse_mla_dkv_gluon_kernel` (two warpgroups): per key block, ``P`` and
    ``dS`` of the 64 heads (``[64, BLOCK_K]``, recomputed from ``lse`` and ``delta``), then the block's latent
    gradient ``dS^T q + P^T dO`` (``[BLOCK_K, D]``, each warpgroup half of ``D``) added to ``DKV``'s rows in the
    layout :data:`ATOMIC_LAYOUTS` ``[ATOMIC_LAYOUT]``. With ``PIECES > 1`` the gradient is formed and added in
    ``PIECES`` column pieces, each piece's products issued before the previous piece's atomics, so that the
    tensor cores run while the warps issue atomics (:data:`DKV_PIECES`)."""
    gl.static_assert(gl.num_warps() == _CONSUMER_WARPS)
    s_l: gl.constexpr = _wgmma_layout(BLOCK_K)
    o_l: gl.constexpr = _wgmma_layout(D)
    a_l: gl.constexpr = _atomic_layout(BLOCK_K, D, ATOMIC_LAYOUT)
    lse2, row_ok, delta = _backward_rows(LSE, DELTA, lse_row, s_l)
    s_init = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, s_l)
    o_init = gl.zeros([BLOCK_K, D], gl.float32, o_l)
    offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))
    offs_kr = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, a_l))
    PIECE: gl.constexpr = D // PIECES
    pa_l: gl.constexpr = _atomic_layout(BLOCK_K, PIECE, ATOMIC_LAYOUT)
    p_init = gl.zeros([BLOCK_K, PIECE], gl.float32, _wgmma_layout(PIECE))
    offs_pr = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, pa_l))

    mbarrier.wait(q_bar, 0)
    for j in range(n_blocks):
        mbarrier.wait(ready.index(0), j & 1)
        if PRODUCTS:
            fence_async_shared()   # the producer's cp.async (generic proxy) before wgmma's reads (async proxy)
            scores, dp, idx = _scores_and_dp(q_smem, do_smem, kv_smem.index(0), s_init, IDX, j * BLOCK_K + offs_kb,
                                             n_idx)
            # Both warpgroups' products of the block have retired: the buffer takes block j + 1 while this
            # block's gradient is formed (it needs q, dO, P and dS, not the latent)
            _cta_barrier()
            mbarrier.arrive(empty.index(0))
            acc, rows = _dkv_block_start(scores, dp, idx, lse2, row_ok, delta, scale, scale_log2, pt_smem, dst_smem,
                                         q_smem, do_smem, p_init, IDX, j * BLOCK_K + offs_pr, n_idx)
            for c in gl.static_range(PIECES):
                if c + 1 < PIECES:   # the next piece's products run while this piece's atomics issue
                    acc, piece = _dkv_next_piece(acc, dst_smem, pt_smem, q_smem, do_smem, p_init, (c + 1) * PIECE)
                else:
                    piece = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _add_rows(DKV, stride_dks, rows, c * PIECE, gl.convert_layout(piece, pa_l), ATOMICS)
        else:   # the gathers and the atomics alone (benchmarks only): what the products could hide under
            _cta_barrier()
            mbarrier.arrive(empty.index(0))
            rows_k = j * BLOCK_K + offs_kr
            rows = gl.load(IDX + rows_k, mask=rows_k < n_idx, other=-1).to(gl.int64)
            _add_rows(DKV, stride_dks, rows, 0, gl.convert_layout(o_init + scale, a_l), ATOMICS)


@gluon.jit
def _dkv_consumer_ahead(IDX, LSE, DELTA, DKV, q_smem, do_smem, kv_smem, pt_smem, dst_smem, q_bar, ready, empty,
                        lse_row, stride_dks, n_idx, n_blocks, scale, scale_log2, D: gl.constexpr,
                        BLOCK_K: gl.constexpr, ATOMICS: gl.constexpr, ATOMIC_LAYOUT: gl.constexpr,
                        PIECES: gl.constexpr, stage=None, full=None, free=None, STAGED: gl.constexpr = False):
    """:func:`_dkv_consumer` in ``PIECES >= 2`` column pieces with the next key block's ``S = Q K^T`` and ``dP =
    dO V^T`` issued before the last piece's atomics (``SCORES_AHEAD``), so that those products also run while
    atomics issue. The next block's gather has had all but the last piece's atomics to land. The last block
    recomputes its own scores instead of branching around the issue (an asynchronous product inside a branch has
    no value on the other path): ``1 / n_blocks`` of the score products wasted, as in the forward. ``STAGED``:
    each finished piece goes to ``stage`` for the atomics partition (:func:`_stage_piece`, :func:`_dkv_atomics`)
    instead of being added here."""
    gl.static_assert(gl.num_warps() == _CONSUMER_WARPS)
    gl.static_assert(PIECES >= 2)
    s_l: gl.constexpr = _wgmma_layout(BLOCK_K)
    PIECE: gl.constexpr = D // PIECES
    if not STAGED:
        pa_l: gl.constexpr = _atomic_layout(BLOCK_K, PIECE, ATOMIC_LAYOUT)
    else:
        pa_l: gl.constexpr = _wgmma_layout(PIECE)   # the rows' layout only: the atomics partition loads its own
    lse2, row_ok, delta = _backward_rows(LSE, DELTA, lse_row, s_l)
    s_init = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, s_l)
    p_init = gl.zeros([BLOCK_K, PIECE], gl.float32, _wgmma_layout(PIECE))
    offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))
    offs_pr = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, pa_l))

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()   # the producer's cp.async (generic proxy) before wgmma's reads (async proxy)
    scores, dp, idx = _scores_and_dp(q_smem, do_smem, kv_smem.index(0), s_init, IDX, offs_kb, n_idx)
    for j in range(n_blocks):
        # both warpgroups' score products of block j have retired: the buffer takes block j + 1
        _cta_barrier()
        mbarrier.arrive(empty.index(0))
        acc, rows = _dkv_block_start(scores, dp, idx, lse2, row_ok, delta, scale, scale_log2, pt_smem, dst_smem,
                                     q_smem, do_smem, p_init, IDX, j * BLOCK_K + offs_pr, n_idx)
        for c in gl.static_range(PIECES):
            if c + 1 < PIECES:
                acc, piece = _dkv_next_piece(acc, dst_smem, pt_smem, q_smem, do_smem, p_init, (c + 1) * PIECE)
                _piece_out(DKV, stride_dks, rows, c * PIECE, piece, pa_l, ATOMICS, stage, full, free, j * PIECES + c,
                           STAGED)
            else:
                nb = gl.minimum(j + 1, n_blocks - 1)   # the last block's own buffer, unchanged: its scores again
                mbarrier.wait(ready.index(0), nb & 1)
                fence_async_shared()
                kv_t = kv_smem.index(0).permute((1, 0))
                s_tok = warpgroup_mma(q_smem, kv_t, s_init, use_acc=False, is_async=True)
                dp_tok = warpgroup_mma(do_smem, kv_t, s_init, use_acc=False, is_async=True)
                offs_k = nb * BLOCK_K + offs_kb
                idx = gl.load(IDX + offs_k, mask=offs_k < n_idx, other=-1)
                piece = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))   # S and dP may run on
                _piece_out(DKV, stride_dks, rows, c * PIECE, piece, pa_l, ATOMICS, stage, full, free, j * PIECES + c,
                           STAGED)
                scores, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, dp_tok))


STAGE_LAYOUT = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
"""Shared layout of the latent gradient's staged ``[64, PIECE]`` float32 piece (``ATOMIC_WARPS``): 16-byte
vectors XOR-swizzled over 8 rows, so that the ``wgmma`` fragments' 8-byte stores (8 rows of 32 bytes per warp
instruction) spread over all banks, while the atomics partition's loads stay 128-byte row segments."""


@gluon.jit
def _stage_piece(stage, full, free, piece, i):
    """Hand finished piece ``i`` (a ``[64, PIECE]`` float32 ``wgmma`` result over the consumer warpgroups) to the
    atomics partition: wait until it has taken piece ``i - 1`` out of ``stage`` (``free``), store, signal
    ``full`` once every consumer warp's part is in shared memory."""
    mbarrier.wait(free, (i & 1) ^ 1)   # a new barrier passes parity 1 at once
    stage.store(piece)
    _cta_barrier()
    mbarrier.arrive(full)


@gluon.jit
def _piece_out(DKV, stride_dks, rows, col0: gl.constexpr, piece, pa_l: gl.constexpr, ATOMICS: gl.constexpr, stage,
               full, free, i, STAGED: gl.constexpr):
    """Finished column piece ``i`` (``[64, PIECE]`` float32, columns from ``col0``): to the atomics partition's
    ``stage`` (``STAGED``, :func:`_stage_piece`), or added to ``DKV``'s ``rows`` here in the layout ``pa_l``."""
    if STAGED:
        _stage_piece(stage, full, free, piece, i)
    else:
        _add_rows(DKV, stride_dks, rows, col0, gl.convert_layout(piece, pa_l), ATOMICS)


@gluon.jit
def _dkv_atomics(IDX, DKV, stage, full, free, stride_dks, n_idx, n_blocks, BLOCK_K: gl.constexpr,
                 PIECES: gl.constexpr, ATOMICS: gl.constexpr):
    """The atomics partition of :func:`sparse_mla_dkv_gluon_kernel` (``ATOMIC_WARPS``): for each key block's
    ``PIECES`` column pieces in order, take the piece out of ``stage`` (``[BLOCK_K, PIECE]`` float32, once
    ``full``), release it (``free``) and add it to ``DKV``'s rows ``IDX[block]`` with relaxed float32 atomics,
    8 lanes per 128-byte line of a row (the ``lines`` requests), so that the consumers, which issue none, do not
    stall on the atomic queue (:data:`DKV_ATOMIC_WARPS`: slower so far)."""
    warps: gl.constexpr = gl.num_warps()
    PIECE: gl.constexpr = stage.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [warps, 1], [1, 0])
    offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    for j in range(n_blocks):
        rows_k = j * BLOCK_K + offs_r
        rows = gl.load(IDX + rows_k, mask=rows_k < n_idx, other=-1).to(gl.int64)
        for c in gl.static_range(PIECES):
            i = j * PIECES + c
            mbarrier.wait(full, i & 1)
            piece = stage.load(layout)
            _cta_barrier()   # every atomics warp holds its part before the consumers overwrite it
            mbarrier.arrive(free)
            _add_rows(DKV, stride_dks, rows, c * PIECE, piece, ATOMICS)


@triton.autotune(configs=GLUON_DKV_CONFIGS, key=["H", "D"], reset_to_zero=["DKV"])
@gluon.jit
def sparse_mla_dkv_gluon_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DKV,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_dkb, stride_dks,
    n_idx, scale, scale_log2,
    H: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, GATHER_ROWS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ATOMICS: gl.constexpr = True, INDICES_AHEAD: gl.constexpr = False, PRODUCTS: gl.constexpr = True,
    ATOMIC_LAYOUT: gl.constexpr = 0, PIECES: gl.constexpr = 1, SCORES_AHEAD: gl.constexpr = False,
    ATOMIC_WARPS: gl.constexpr = 0, ATOMIC_REGS: gl.constexpr = 72,
):
    """The latent's gradient of one query ``t`` (program 0) and heads ``[64 * pid_h, 64 * pid_h + 64)`` (program
    1), batch ``b`` (program 2), added to ``DKV [B, S, D]`` float32 with atomics: ``sum_h scale * dS[h, k] q[h]
    + P[h, k] dO[h]`` for each selected key ``k``. ``Q [B, T, H, D]`` (``stride(3) == 1``), ``KV [B, S, D]``,
    ``IDX [B, T, K]``, ``DO [B, T, H, D]`` contiguous, ``LSE`` and ``DELTA`` (``rowsum(dO * O)``, as the
    ``dq`` pass of :func:`kernels.dsa.sparse_attention_triton.sparse_mla_bwd_kernel` writes it) ``[B, T, H]``
    float32 with ``LSE``'s strides. ``q`` and ``dO`` are each held once in shared memory and read by ``wgmma``
    in both major orders (as ``A`` of ``Q K^T`` / ``dO V^T``, as ``B`` of ``dS^T q`` / ``P^T dO``): 208 KiB with
    one 64-key latent buffer, where Triton's per-operand copies need 256-352 KiB at 64 heads. ``ATOMICS=False``
    (benchmarks only, ``DKV`` unchanged) issues the atomics predicated off: the kernel's time without their
    memory traffic. ``PRODUCTS=False`` (benchmarks only, ``DKV`` gets a constant) skips the four products: the
    gathers and the atomics alone. ``ATOMIC_LAYOUT`` indexes :data:`ATOMIC_LAYOUTS`: how the block's float32 rows
    are spread over the threads for their atomics. ``PIECES`` (1, 2 or 4) column pieces of each block's gradient,
    each piece's products issued before the previous piece's atomics (:func:`_dkv_consumer`); ``SCORES_AHEAD``
    (with ``PIECES >= 2`` and the products) also the next block's score products before the last piece's atomics
    (:func:`_dkv_consumer_ahead`). ``ATOMIC_WARPS`` (4; with ``SCORES_AHEAD`` and ``PIECES`` 8) moves the atomics
    to a partition of their own (:func:`_dkv_atomics`, ``ATOMIC_REGS`` registers): each finished ``[64, 64]``
    piece goes through a 16 KiB shared ``stage`` (in place of the ``lines`` conversion's scratch) and the consumer
    warps issue no atomics; 16 warps, ``maxnreg`` 128 (:data:`DKV_ATOMIC_WARPS`: slower so far)."""
    gl.static_assert(BLOCK_K == 64)   # the M of the dkv products: one wgmma tile of rows per warpgroup
    gl.static_assert(BLOCK_K % GATHER_ROWS == 0)
    b, q_row, do_row, lse_row, IDX, KV = _program_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib,
                                                       stride_it, stride_lb, stride_lt, H, D)
    n_blocks = gl.cdiv(n_idx, BLOCK_K)
    DKV = DKV + b * stride_dkb

    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem, do_smem, kv_smem = _backward_tiles(dtype, D, BLOCK_K, 1)
    pt_smem = gl.allocate_shared_memory(dtype, [BLOCK_K, _BLOCK_H], _nvmma([BLOCK_K, _BLOCK_H], dtype))
    dst_smem = gl.allocate_shared_memory(dtype, [BLOCK_K, _BLOCK_H], _nvmma([BLOCK_K, _BLOCK_H], dtype))
    q_bar, ready, empty = _ring_barriers(1)

    if ATOMIC_WARPS > 0:
        gl.static_assert(SCORES_AHEAD and PRODUCTS)
        gl.static_assert(D // PIECES == 64)   # a 16 KiB stage: q, dO, the latent buffer, P^T and dS^T take 208
        stage = gl.allocate_shared_memory(gl.float32, [BLOCK_K, D // PIECES], STAGE_LAYOUT)
        full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(full, count=1)
        mbarrier.init(free, count=1)
        gl.warp_specialize([
            (_dkv_consumer_ahead, (IDX, LSE, DELTA, DKV, q_smem, do_smem, kv_smem, pt_smem, dst_smem, q_bar, ready,
                                   empty, lse_row, stride_dks, n_idx, n_blocks, scale, scale_log2, D, BLOCK_K, ATOMICS,
                                   ATOMIC_LAYOUT, PIECES, stage, full, free, True)),
            (_producer, (Q, DO, KV, IDX, q_smem, do_smem, kv_smem, q_bar, ready, empty, q_row, do_row, stride_qh,
                         stride_kvs, n_idx, n_blocks, D, BLOCK_K, 1, GATHER_ROWS, True, INDICES_AHEAD)),
            (_dkv_atomics, (IDX, DKV, stage, full, free, stride_dks, n_idx, n_blocks, BLOCK_K, PIECES, ATOMICS)),
        ], [_PRODUCER_WARPS, ATOMIC_WARPS], [PRODUCER_REGS, ATOMIC_REGS])
        mbarrier.invalidate(full)
        mbarrier.invalidate(free)
    elif SCORES_AHEAD and PRODUCTS:
        gl.warp_specialize([
            (_dkv_consumer_ahead, (IDX, LSE, DELTA, DKV, q_smem, do_smem, kv_smem, pt_smem, dst_smem, q_bar, ready,
                                   empty, lse_row, stride_dks, n_idx, n_blocks, scale, scale_log2, D, BLOCK_K, ATOMICS,
                                   ATOMIC_LAYOUT, PIECES)),
            (_producer, (Q, DO, KV, IDX, q_smem, do_smem, kv_smem, q_bar, ready, empty, q_row, do_row, stride_qh,
                         stride_kvs, n_idx, n_blocks, D, BLOCK_K, 1, GATHER_ROWS, True, INDICES_AHEAD)),
        ], [_PRODUCER_WARPS], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_dkv_consumer, (IDX, LSE, DELTA, DKV, q_smem, do_smem, kv_smem, pt_smem, dst_smem, q_bar, ready, empty,
                             lse_row, stride_dks, n_idx, n_blocks, scale, scale_log2, D, BLOCK_K, ATOMICS, PRODUCTS,
                             ATOMIC_LAYOUT, PIECES)),
            (_producer, (Q, DO, KV, IDX, q_smem, do_smem, kv_smem, q_bar, ready, empty, q_row, do_row, stride_qh,
                         stride_kvs, n_idx, n_blocks, D, BLOCK_K, 1, GATHER_ROWS, True, INDICES_AHEAD)),
        ], [_PRODUCER_WARPS], [PRODUCER_REGS])

    _invalidate_barriers(q_bar, ready, empty, 1)


GLUON_DQ_CONFIGS = [
    triton.Config({"BLOCK_K": 32, "STAGES": 2, "GATHER_ROWS": rows, "PRODUCER_REGS": regs},
                  num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
    for rows, regs in [(16, 56), (8, 40)]
]
"""Configurations of :func:`sparse_mla_dq_gluon_kernel`: ``q`` and ``dO`` take 128 KiB, so the latent ring is two
32-key buffers (64 KiB; ``dS K`` reads the block's buffer too, so one buffer could not be refilled during a
block). Offline sm_90 compiles (Triton 3.6, :func:`kernels.dsa.sm90.compile_gluon_sparse_dq`, 64 heads x 512):
196 KiB, the consumers' ``[64, 512]`` float32 ``dq`` takes 128 of their 224 (232) registers and ptxas spills
120 (88) bytes of ``wgmma`` descriptors; issuing the next block's ``Q K^T`` and ``dO V^T`` during ``dS K`` (the
forward's overlap) spilled 488 bytes, so the consumers run each block's products in turn and only the gather
overlaps them."""


@gluon.jit
def _store_head_rows(OUT, row, stride_h, acc, col0, layout: gl.constexpr):
    """Store ``acc`` (``[64, N]`` float32 in ``layout``) in ``OUT``'s dtype: head ``h``'s row at ``OUT + row + h *
    stride_h``, columns ``col0 .. col0 + N``."""
    offs_h = gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, layout))
    offs_c = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(OUT + row + offs_h[:, None] * stride_h + offs_c[None, :], acc.to(OUT.dtype.element_ty))


@gluon.jit
def _dq_consumer(IDX, DQ, LSE, DELTA, q_smem, do_smem, kv_smem, ds_smem, q_bar, ready, empty, dq_row, stride_dqh,
                 lse_row, n_idx, n_blocks, scale, scale_log2, D: gl.constexpr, BLOCK_K: gl.constexpr,
                 STAGES: gl.constexpr):
    """The default partition of :func:`sparse_mla_dq_gluon_kernel` (two warpgroups): per key block ``P`` and
    ``dS`` of the 64 heads (recomputed from ``lse`` and ``delta``; each warpgroup half of the block's keys),
    ``dS`` through shared memory, then ``dq += dS K`` (each warpgroup half of ``D``), the block's buffer released
    once both warpgroups' ``dS K`` retired."""
    gl.static_assert(gl.num_warps() == _CONSUMER_WARPS)
    s_l: gl.constexpr = _wgmma_layout(BLOCK_K)
    o_l: gl.constexpr = _wgmma_layout(D)
    lse2, row_ok, delta = _backward_rows(LSE, DELTA, lse_row, s_l)
    s_init = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, s_l)
    acc = gl.zeros([_BLOCK_H, D], gl.float32, o_l)
    offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()   # the producer's cp.async (generic proxy) before wgmma's reads (async proxy)
    scores, dp, idx = _scores_and_dp(q_smem, do_smem, kv_smem.index(0), s_init, IDX, offs_kb, n_idx)
    for j in range(n_blocks):
        slot = j % STAGES
        _, ds = _probs_and_ds(scores, dp, idx, lse2, row_ok, delta, scale, scale_log2)
        ds_smem.store(ds.to(ds_smem.dtype))
        # every consumer warp's part of dS is in shared memory and visible to wgmma's (async) proxy
        fence_async_shared()
        _cta_barrier()
        acc = warpgroup_mma(ds_smem, kv_smem.index(slot), acc, is_async=True)
        # S and dP of block j + 1 issued before this wait (the forward's order) spilled 520 bytes per thread at
        # 168 registers and took the kernel from 71.7 to 124.2 ms (one H100, full shape, 64k)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()   # both warpgroups' dS_j K_j retired: the slot and dS are free
        mbarrier.arrive(empty.index(slot))
        if j + 1 < n_blocks:
            nxt = j + 1
            mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
            fence_async_shared()
            scores, dp, idx = _scores_and_dp(q_smem, do_smem, kv_smem.index(nxt % STAGES), s_init, IDX,
                                             nxt * BLOCK_K + offs_kb, n_idx)

    _store_head_rows(DQ, dq_row, stride_dqh, acc, 0, o_l)


@triton.autotune(configs=GLUON_DQ_CONFIGS, key=["H", "D"])
@gluon.jit
def sparse_mla_dq_gluon_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    n_idx, scale, scale_log2,
    H: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GATHER_ROWS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, INDICES_AHEAD: gl.constexpr = False,
):
    """The query gradient of one query ``t`` (program 0) and heads ``[64 * pid_h, 64 * pid_h + 64)`` (program 1),
    batch ``b`` (program 2): ``DQ[h] = sum_k scale * dS[h, k] kv[k]`` over the selected keys, ``dS = P (dP -
    delta)``. ``Q [B, T, H, D]`` (``stride(3) == 1``), ``KV [B, S, D]``, ``IDX [B, T, K]``, ``DO`` and ``DQ``
    ``[B, T, H, D]`` contiguous, ``LSE`` and ``DELTA`` (``rowsum(dO * O)``) ``[B, T, H]`` float32 with ``LSE``'s
    strides. The producer partition gathers ``q`` and ``dO`` once and the latent blocks into a two-deep ring, as
    for the latent gradient (:func:`sparse_mla_dkv_gluon_kernel`), which this kernel completes: together they are
    the backward at 64 heads per program, where Triton's ``dq`` pass (``MODE`` 1) runs its products one after the
    other with the gather (280 TF/s at the ``full`` shape on an H100, anchor 797)."""
    gl.static_assert(BLOCK_K % GATHER_ROWS == 0)
    gl.static_assert(STAGES >= 2)   # block j's buffer is still read by dS_j K_j when block j + 1's is awaited
    b, q_row, do_row, lse_row, IDX, KV = _program_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib,
                                                       stride_it, stride_lb, stride_lt, H, D)
    n_blocks = gl.cdiv(n_idx, BLOCK_K)

    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem, do_smem, kv_smem = _backward_tiles(dtype, D, BLOCK_K, STAGES)
    ds_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, BLOCK_K], _nvmma([_BLOCK_H, BLOCK_K], dtype))
    q_bar, ready, empty = _ring_barriers(STAGES)

    gl.warp_specialize([
        (_dq_consumer, (IDX, DQ, LSE, DELTA, q_smem, do_smem, kv_smem, ds_smem, q_bar, ready, empty, do_row, D,
                        lse_row, n_idx, n_blocks, scale, scale_log2, D, BLOCK_K, STAGES)),
        (_producer, (Q, DO, KV, IDX, q_smem, do_smem, kv_smem, q_bar, ready, empty, q_row, do_row, stride_qh,
                     stride_kvs, n_idx, n_blocks, D, BLOCK_K, STAGES, GATHER_ROWS, True, INDICES_AHEAD)),
    ], [_PRODUCER_WARPS], [PRODUCER_REGS])

    _invalidate_barriers(q_bar, ready, empty, STAGES)


GLUON_DQ_SPLIT_CONFIGS = [
    triton.Config({"BLOCK_K": 32, "STAGES": 2, "GATHER_ROWS": 16, "PRODUCER_REGS": 56, "CONSUMER_REGS": 224},
                  num_warps=WG_WARPS, maxnreg=MAXNREG)
]
"""Configurations of :func:`sparse_mla_dq_split_kernel`: the two-deep ring of 32-key buffers of
:data:`GLUON_DQ_CONFIGS`. Its own ``num_warps`` is the first consumer warpgroup (the default partition); the
second and the producer are worker partitions, ``4 * 224 + 4 * 224 + 4 * 56 = 12 * 164`` registers per thread at
most."""


@gluon.jit
def _dq_split_scores(IDX, DQ, LSE, DELTA, q_smem, kv_smem, p_smem, ds_smem, q_bar, ready, empty, p_bar, ds_bar,
                     ds_free, dq_row, stride_dqh, lse_row, n_idx, n_blocks, scale_log2, D: gl.constexpr,
                     BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The first consumer warpgroup of :func:`sparse_mla_dq_split_kernel` (the default partition): per key block
    ``S = Q K^T`` over the whole block (``wgmma`` N = ``BLOCK_K``), ``P = exp2(scale S - lse)`` (0 at ``-1``
    slots and rows without a valid index) to ``p_smem`` for the second warpgroup (signal ``p_bar``), then, once
    the second has written ``dS`` (``ds_bar``), ``dq[:, :D/2] += dS K[:, :D/2]``."""
    HALF: gl.constexpr = D // 2
    s_l: gl.constexpr = _wg_layout(BLOCK_K)
    o_l: gl.constexpr = _wg_layout(HALF)
    lse2, row_ok, _ = _backward_rows(LSE, DELTA, lse_row, s_l)
    s_init = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, s_l)
    acc = gl.zeros([_BLOCK_H, HALF], gl.float32, o_l)
    offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))

    mbarrier.wait(q_bar, 0)
    for j in range(n_blocks):
        slot = j % STAGES
        buf = j % 2
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        fence_async_shared()   # the producer's cp.async (generic proxy) before wgmma's reads (async proxy)
        s_tok = warpgroup_mma(q_smem, kv_smem.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
        offs_k = j * BLOCK_K + offs_kb
        idx = gl.load(IDX + offs_k, mask=offs_k < n_idx, other=-1)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        p = gl.exp2(scores * scale_log2 - lse2[:, None])
        # P_{j-2}, the buffer's last, was read before the second warpgroup signalled dS_{j-2}, awaited below
        p_smem.index(buf).store(gl.where((idx >= 0)[None, :] & row_ok[:, None], p, 0.0))
        _cta_barrier()
        mbarrier.arrive(p_bar.index(buf))
        mbarrier.wait(ds_bar.index(buf), (j // 2) & 1)
        acc_tok = warpgroup_mma(ds_smem.index(buf), kv_smem.index(slot).slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _cta_barrier()   # this warpgroup's dS_j K_j retired: its reads of the slot and of dS_j are done
        mbarrier.arrive(empty.index(slot))
        mbarrier.arrive(ds_free.index(buf))

    _store_head_rows(DQ, dq_row, stride_dqh, acc, 0, o_l)


@gluon.jit
def _rowsum_do_o(OUT, do_smem, do_row, s_l: gl.constexpr, D: gl.constexpr, q_bar):
    """``delta = rowsum(dO O)`` (float32, ``[64]`` in ``s_l``'s row slice) of the program's 64 heads: ``O`` rows
    ``do_row + h * D`` (bf16/fp16, ``[B, T, H, D]`` contiguous like ``dO``), all four column quarters loaded from
    global memory before the wait for the producer's ``dO`` tile (``q_bar``; one round trip, under the producer's
    gathers), then the tile read from shared memory; products summed in float32."""
    gl.static_assert(D % 64 == 0)
    CHUNK: gl.constexpr = D // 4
    warps: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])
    offs_h = gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
    rows = OUT + do_row + offs_h[:, None].to(gl.int64) * D + offs_c[None, :]
    o0 = gl.load(rows)
    o1 = gl.load(rows + CHUNK)
    o2 = gl.load(rows + 2 * CHUNK)
    o3 = gl.load(rows + 3 * CHUNK)
    mbarrier.wait(q_bar, 0)
    delta = gl.sum(do_smem.slice(0, CHUNK, dim=1).load(layout).to(gl.float32) * o0.to(gl.float32), axis=1)
    delta += gl.sum(do_smem.slice(CHUNK, CHUNK, dim=1).load(layout).to(gl.float32) * o1.to(gl.float32), axis=1)
    delta += gl.sum(do_smem.slice(2 * CHUNK, CHUNK, dim=1).load(layout).to(gl.float32) * o2.to(gl.float32), axis=1)
    delta += gl.sum(do_smem.slice(3 * CHUNK, CHUNK, dim=1).load(layout).to(gl.float32) * o3.to(gl.float32), axis=1)
    return gl.convert_layout(delta, gl.SliceLayout(1, s_l))


@gluon.jit
def _dq_split_grads(DQ, LSE, DELTA, OUT, do_smem, kv_smem, p_smem, ds_smem, q_bar, ready, empty, p_bar, ds_bar,
                    ds_free, dq_row, stride_dqh, lse_row, n_blocks, scale, D: gl.constexpr, BLOCK_K: gl.constexpr,
                    STAGES: gl.constexpr, FUSED_DELTA: gl.constexpr):
    """The second consumer warpgroup of :func:`sparse_mla_dq_split_kernel` (a worker partition): per key block
    ``dP = dO V^T`` over the whole block, ``dS = scale P (dP - delta)`` with the first warpgroup's ``P``
    (``p_bar``) to ``ds_smem`` (signal ``ds_bar``; the buffer's previous ``dS`` freed by the first's ``ds_free``),
    then ``dq[:, D/2:] += dS K[:, D/2:]``. With ``FUSED_DELTA`` it forms ``delta`` itself from ``OUT`` and the
    ``dO`` tile (:func:`_rowsum_do_o`) and writes it to ``DELTA`` for the latent gradient; else it reads it."""
    HALF: gl.constexpr = D // 2
    s_l: gl.constexpr = _wg_layout(BLOCK_K)
    o_l: gl.constexpr = _wg_layout(HALF)
    if FUSED_DELTA:
        delta = _rowsum_do_o(OUT, do_smem, dq_row, s_l, D, q_bar)
        gl.store(DELTA + lse_row + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, s_l)), delta)
    else:
        _, _, delta = _backward_rows(LSE, DELTA, lse_row, s_l)
        mbarrier.wait(q_bar, 0)
    s_init = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, s_l)
    acc = gl.zeros([_BLOCK_H, HALF], gl.float32, o_l)

    for j in range(n_blocks):
        slot = j % STAGES
        buf = j % 2
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        fence_async_shared()
        dp_tok = warpgroup_mma(do_smem, kv_smem.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        mbarrier.wait(p_bar.index(buf), (j // 2) & 1)
        ds = p_smem.index(buf).load(s_l) * (dp - delta[:, None]) * scale
        mbarrier.wait(ds_free.index(buf), ((j // 2) & 1) ^ 1)   # a new barrier passes parity 1 at once
        ds_smem.index(buf).store(ds.to(ds_smem.dtype))
        # every warp's part of dS is in shared memory and visible to wgmma's (async) proxy, both warpgroups'
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(ds_bar.index(buf))
        acc_tok = warpgroup_mma(ds_smem.index(buf), kv_smem.index(slot).slice(HALF, HALF, dim=1), acc,
                                is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _cta_barrier()
        mbarrier.arrive(empty.index(slot))

    _store_head_rows(DQ, dq_row, stride_dqh, acc, HALF, o_l)


@triton.autotune(configs=GLUON_DQ_SPLIT_CONFIGS, key=["H", "D"])
@gluon.jit
def sparse_mla_dq_split_kernel(
    Q, KV, IDX, DO, LSE, DELTA, DQ, OUT,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    n_idx, scale, scale_log2,
    H: gl.constexpr, D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GATHER_ROWS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, INDICES_AHEAD: gl.constexpr = False,
    FUSED_DELTA: gl.constexpr = False,
):
    """The query gradient of :func:`sparse_mla_dq_gluon_kernel` (same arguments and ``OUT``, the forward's output
    ``[B, T, H, D]``, read only with ``FUSED_DELTA``; same result) with the block's two
    score products split between the consumer warpgroups instead of its keys: the first runs ``S = Q K^T``, the
    second ``dP = dO V^T``, each over all ``BLOCK_K`` keys (``wgmma`` N = 32, not 16), so each reads one of ``q``
    and ``dO`` per block instead of both (shared-memory reads per 32-key block: 192 KiB for the two products,
    against 320 KiB); ``P`` (float32) passes to the second through shared memory, ``dS`` back to both, and each
    accumulates half of ``dq``'s columns. With ``FUSED_DELTA`` the second also forms ``delta = rowsum(dO O)`` and
    writes it to ``DELTA`` (``[B, T, H]`` float32) instead of reading it: no separate pass over ``dO`` and ``O``."""
    gl.static_assert(BLOCK_K % GATHER_ROWS == 0)
    gl.static_assert(STAGES >= 2)
    b, q_row, do_row, lse_row, IDX, KV = _program_rows(IDX, KV, stride_qb, stride_qt, stride_qh, stride_kvb, stride_ib,
                                                       stride_it, stride_lb, stride_lt, H, D)
    n_blocks = gl.cdiv(n_idx, BLOCK_K)

    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem, do_smem, kv_smem = _backward_tiles(dtype, D, BLOCK_K, STAGES)
    p_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_H, BLOCK_K], _nvmma([_BLOCK_H, BLOCK_K], gl.float32))
    ds_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_H, BLOCK_K], _nvmma([_BLOCK_H, BLOCK_K], dtype))
    q_bar, ready, empty = _ring_barriers(STAGES, 2)   # both warpgroups release each slot
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(p_bar.index(s), count=1)
        mbarrier.init(ds_bar.index(s), count=1)
        mbarrier.init(ds_free.index(s), count=1)

    gl.warp_specialize([
        (_dq_split_scores, (IDX, DQ, LSE, DELTA, q_smem, kv_smem, p_smem, ds_smem, q_bar, ready, empty, p_bar, ds_bar,
                            ds_free, do_row, D, lse_row, n_idx, n_blocks, scale_log2, D, BLOCK_K, STAGES)),
        (_dq_split_grads, (DQ, LSE, DELTA, OUT, do_smem, kv_smem, p_smem, ds_smem, q_bar, ready, empty, p_bar,
                           ds_bar, ds_free, do_row, D, lse_row, n_blocks, scale, D, BLOCK_K, STAGES, FUSED_DELTA)),
        (_producer, (Q, DO, KV, IDX, q_smem, do_smem, kv_smem, q_bar, ready, empty, q_row, do_row, stride_qh,
                     stride_kvs, n_idx, n_blocks, D, BLOCK_K, STAGES, GATHER_ROWS, True, INDICES_AHEAD)),
    ], [_WG_WARPS, _PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

    _invalidate_barriers(q_bar, ready, empty, STAGES)
    for s in gl.static_range(2):
        mbarrier.invalidate(p_bar.index(s))
        mbarrier.invalidate(ds_bar.index(s))
        mbarrier.invalidate(ds_free.index(s))


DQ_KERNELS = {"keys": sparse_mla_dq_gluon_kernel, "products": sparse_mla_dq_split_kernel}
"""The query gradients by how the two consumer warpgroups share a key block's score products: ``"keys"`` (each
runs ``S`` and ``dP`` over half of the keys, :func:`sparse_mla_dq_gluon_kernel`) or ``"products"`` (one runs
``S``, the other ``dP``, each over all of them, :func:`sparse_mla_dq_split_kernel`)."""
DQ_SCHEDULE = "products"
"""The :data:`DQ_KERNELS` entry :func:`gluon_sparse_mla_dq` launches by default."""
DQ_FUSED_DELTA = True
"""Whether the training path's query gradient (the ``"products"`` schedule) forms ``rowsum(dO O)`` itself
(``FUSED_DELTA``, :func:`_rowsum_do_o`) instead of after
:func:`kernels.dsa.sparse_attention_triton.triton_sparse_mla_delta`'s own pass over ``dO`` and ``O``. One H100,
``full`` shape, 64k, same process: the query gradient 54.1 -> 55.3 ms, the 2.8 ms pass gone; fwd+bwd 205.7 ->
205.0 ms (``dsa_bench``, same call; ``docs/dsa_kernels.md``)."""
DQ_INDICES_AHEAD = {"keys": False, "products": True}
"""The producer's ``INDICES_AHEAD`` each query gradient launches with (one H100, ``full`` shape, 64k: ``"keys"``
71.6 ms without, 72.1 with; ``"products"`` 57.2 ms without, 54.1 with)."""


def gluon_supported(q: torch.Tensor, kv: torch.Tensor, d_v: int, indices: torch.Tensor | None = None) -> str | None:
    """Why the Gluon sparse MLA kernels (:func:`gluon_sparse_mla_fwd`, :func:`gluon_sparse_mla_dkv`,
    :func:`gluon_sparse_mla_dq`) cannot run these inputs (``None`` when they can): the dtype, the head count, the
    widths, the device, or (given ``indices``) no index slot per query."""
    heads, dqk = q.shape[2], q.shape[3]
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"bf16 or fp16 q and kv, got {q.dtype} / {kv.dtype}"
    if heads % BLOCK_H:
        return f"a head count that is a multiple of {BLOCK_H}, got {heads}"
    if d_v != dqk or dqk % 64 or dqk > 512:
        return f"d_v == Dqk, a multiple of 64 up to 512 (absorbed NoPE-MLA), got d_v={d_v}, Dqk={dqk}"
    if indices is not None and indices.shape[2] == 0:
        return "at least one index slot per query"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"a Hopper GPU (CUDA capability 9.x), got {q.device}"
    return None


def _require_supported(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, what: str) -> None:
    """Raise :class:`DSAInputError` naming ``what`` (the kernel) and the reason when it cannot run these inputs."""
    why = gluon_supported(q, kv, d_v, indices)
    if why:
        raise DSAInputError(f"the Gluon sparse MLA {what} needs {why}")


def gluon_sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                         d_v: int, schedule: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, T, H, d_v]`` (q.dtype) and ``lse [B, T, H]`` float32 of
    :func:`kernels.dsa.sparse_attention.sparse_mla_attention`, from :func:`sparse_mla_fwd_gluon_kernel`.

    Args:
        q: ``[B, T, H, Dqk]`` bf16/fp16 absorbed queries, ``H`` a multiple of 64.
        kv: ``[B, S, Dqk]`` latent, same dtype.
        indices: ``[B, T, K]`` int32/int64 selected tokens, ``-1`` skipped.
        softmax_scale: logit scale (natural base).
        d_v: value width; must equal ``Dqk`` (a multiple of 64, at most 512).
        schedule: ``"ring"`` or ``"pair"`` (:data:`GLUON_FWD_TRIALS`); ``None`` takes :data:`FWD_SCHEDULE`.

    Raises:
        DSAInputError: for inputs :func:`gluon_supported` rejects, or ``K == 0``.
        ValueError: for an unknown ``schedule``.
    """
    _require_supported(q, kv, indices, d_v, "forward")
    batch, n_q, heads, dqk = q.shape
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    out = torch.empty(batch, n_q, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_q, heads, dtype=torch.float32, device=q.device)
    launch_fwd(q, kv, indices, out, lse, softmax_scale, schedule=schedule or FWD_SCHEDULE)
    return out, lse


def _tuning(config: triton.Config | None) -> dict:
    """The launch arguments of ``config`` for a kernel's ``.fn`` (outside its autotuner); none for ``None``."""
    return {} if config is None else dict(config.kwargs, num_warps=config.num_warps, maxnreg=config.maxnreg)


def launch_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               softmax_scale: float, config: triton.Config | None = None, schedule: str = "ring",
               products: bool = True) -> None:
    """Launch the Gluon forward of ``schedule`` (:data:`GLUON_FWD_TRIALS`: ``"ring"``
    :func:`sparse_mla_fwd_gluon_kernel`, ``"pair"`` :func:`sparse_mla_fwd_pair_kernel`) into ``out`` and ``lse``:
    autotuned, or with ``config`` (one of that schedule's configurations, or any other) outside the autotuner, as
    the benchmarks and the GPU smoke test time and check each. Inputs as :func:`gluon_sparse_mla_fwd` takes them,
    contiguous and unchecked. ``products=False`` (benchmarks only, ``"ring"`` only; ``out`` and ``lse`` left
    unwritten) runs the producer's gathers alone. Raises ``ValueError`` for an unknown ``schedule``, or
    ``products=False`` with another."""
    if schedule not in _FWD_KERNELS:
        raise ValueError(f"schedule must be one of {sorted(_FWD_KERNELS)}, got {schedule!r}")
    if not products and schedule != "ring":
        raise ValueError(f"products=False needs schedule 'ring', got {schedule!r}")
    batch, n_q, heads, dqk = q.shape
    kernel = _FWD_KERNELS[schedule] if config is None else _FWD_KERNELS[schedule].fn
    kernel[(n_q, heads // BLOCK_H, batch)](
        q, kv, indices, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        indices.shape[2], softmax_scale * 1.4426950408889634,
        H=heads, D=dqk, **_tuning(config), **({} if products else {"PRODUCTS": False}),
    )


def _backward_inputs(q, kv, indices, grad_out, lse, delta, what: str) -> tuple[torch.Tensor, ...]:
    """The backward kernels' inputs, checked (:func:`_require_supported`, naming ``what``) and contiguous."""
    _require_supported(q, kv, indices, grad_out.shape[-1], what)
    return tuple(t.contiguous() for t in (q, kv, indices, grad_out, lse, delta))


def gluon_sparse_mla_dq(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
                        lse: torch.Tensor, delta: torch.Tensor, softmax_scale: float,
                        dq: torch.Tensor | None = None, indices_ahead: bool | None = None,
                        schedule: str | None = None, out: torch.Tensor | None = None,
                        config: triton.Config | None = None) -> torch.Tensor:
    """``dq [B, T, H, Dqk]`` (q.dtype) of :func:`kernels.dsa.sparse_attention.sparse_mla_attention`, from
    :func:`sparse_mla_dq_gluon_kernel`: every selected key of every query, 64 heads per program.

    Args:
        q: ``[B, T, H, Dqk]`` bf16/fp16, ``H`` a multiple of 64; kv: ``[B, S, Dqk]``, same dtype.
        indices: ``[B, T, K]`` int32/int64, ``-1`` skipped.
        grad_out: ``[B, T, H, d_v]`` (``d_v == Dqk``).
        lse, delta: ``[B, T, H]`` float32: the forward's log-sum-exp and ``rowsum(dO * O)`` (with ``out``: a
            contiguous tensor the kernel writes ``rowsum(dO * O)`` into).
        dq: a contiguous ``[B, T, H, Dqk]`` tensor of ``q``'s dtype to write into (``None``: a new one).
        indices_ahead: the producer's ``INDICES_AHEAD`` (:func:`_producer`), or ``None``: the schedule's
            (:data:`DQ_INDICES_AHEAD`).
        schedule: one of :data:`DQ_KERNELS` (benchmarks and checks), or ``None``: :data:`DQ_SCHEDULE`.
        out: the forward's output ``[B, T, H, d_v]``: the ``"products"`` kernel forms ``delta`` from it and
            ``grad_out`` itself (``FUSED_DELTA``, :func:`_rowsum_do_o`) and writes it into ``delta``.
        config: a configuration of the schedule's kernel launched outside the autotuner (benchmarks: any
            ``BLOCK_K``, ``STAGES``, ``GATHER_ROWS``, register split), or ``None``: autotuned.

    Raises:
        DSAInputError: for inputs :func:`gluon_supported` rejects, ``K == 0``, or ``out`` not of
            ``grad_out``'s shape and dtype, or ``delta`` not a contiguous float32 ``[B, T, H]`` with it.
        ValueError: for an unknown ``schedule``, or ``out`` with a schedule other than ``"products"``.
    """
    schedule = schedule or DQ_SCHEDULE
    if schedule not in DQ_KERNELS:
        raise ValueError(f"schedule must be one of {sorted(DQ_KERNELS)}, got {schedule!r}")
    if out is not None and schedule != "products":
        raise ValueError(f"out (delta formed in the kernel) needs schedule 'products', got {schedule!r}")
    if out is not None and (out.shape != grad_out.shape or out.dtype != grad_out.dtype):
        raise DSAInputError(f"out must match grad_out ({tuple(grad_out.shape)}, {grad_out.dtype}), got "
                            f"{tuple(out.shape)}, {out.dtype}")
    if out is not None and (delta.dtype != torch.float32 or delta.shape != lse.shape or not delta.is_contiguous()
                            or lse.stride() != delta.stride()):
        raise DSAInputError(f"delta must be a contiguous float32 {tuple(lse.shape)} tensor like lse to write "
                            f"rowsum(dO O) into, got {delta.dtype} {tuple(delta.shape)} strides {delta.stride()}")
    indices_ahead = DQ_INDICES_AHEAD[schedule] if indices_ahead is None else indices_ahead
    q, kv, indices, grad_out, lse, delta = _backward_inputs(q, kv, indices, grad_out, lse, delta, "query gradient")
    batch, n_q, heads, dqk = q.shape
    dq = torch.empty_like(q) if dq is None else dq
    fused = {} if out is None else {"FUSED_DELTA": True}
    # the "products" kernel's OUT, read only with FUSED_DELTA (delta, contiguous, is written in place)
    out_arg = () if schedule != "products" else (grad_out if out is None else out.contiguous(),)
    kernel = DQ_KERNELS[schedule] if config is None else DQ_KERNELS[schedule].fn
    kernel[(n_q, heads // BLOCK_H, batch)](
        q, kv, indices, grad_out, lse, delta, dq, *out_arg,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        lse.stride(0), lse.stride(1),
        indices.shape[2], softmax_scale, softmax_scale * 1.4426950408889634,
        H=heads, D=dqk, INDICES_AHEAD=indices_ahead, **fused, **_tuning(config),
    )
    return dq


def gluon_sparse_mla_dkv(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
                         lse: torch.Tensor, delta: torch.Tensor, softmax_scale: float, dkv: torch.Tensor,
                         atomics: bool = True, indices_ahead: bool | None = None, products: bool = True,
                         atomic_layout: str | None = None, pieces: int | None = None,
                         scores_ahead: bool | None = None, config: triton.Config | None = None,
                         atomic_warps: int | None = None) -> None:
    """Add the latent's gradient of :func:`kernels.dsa.sparse_attention.sparse_mla_attention` to ``dkv``, from
    :func:`sparse_mla_dkv_gluon_kernel`: every selected key of every query, 64 heads per program.

    Args:
        q: ``[B, T, H, Dqk]`` bf16/fp16, ``H`` a multiple of 64; kv: ``[B, S, Dqk]``, same dtype.
        indices: ``[B, T, K]`` int32/int64, ``-1`` skipped.
        grad_out: ``[B, T, H, d_v]`` (``d_v == Dqk``), contiguous.
        lse, delta: ``[B, T, H]`` float32 contiguous: the forward's log-sum-exp and ``rowsum(dO * O)``.
        dkv: ``[B, S, Dqk]`` float32, accumulated into (atomics).
        atomics: ``False`` for benchmarks only: the atomics are issued predicated off and ``dkv`` is left as it
            is, the kernel's time without their memory traffic.
        products: ``False`` for benchmarks only: no products, a constant added to ``dkv``'s selected rows; the
            time of the gathers and the atomics alone.
        indices_ahead: the producer's ``INDICES_AHEAD`` (:func:`_producer`), or ``None``: :data:`DKV_INDICES_AHEAD`.
        atomic_layout: one of :data:`ATOMIC_LAYOUTS` (benchmarks and checks), or ``None``: :data:`DKV_ATOMIC_LAYOUT`.
        pieces: column pieces of the gradient products and atomics (1, 2 or 4; benchmarks and checks), or
            ``None``: :data:`DKV_PIECES`.
        scores_ahead: the next block's score products under the last piece's atomics (:func:`_dkv_consumer_ahead`;
            needs ``pieces >= 2``), or ``None``: :data:`DKV_SCORES_AHEAD`.
        config: a configuration launched outside the autotuner (benchmarks: ``GATHER_ROWS``, the register split),
            or ``None``: autotuned over :data:`GLUON_DKV_CONFIGS` (with an atomics partition:
            :data:`GLUON_DKV_STAGED_CONFIG`).
        atomic_warps: 4 for the atomics in their own partition (:func:`_dkv_atomics`; ``pieces`` then
            :data:`DKV_STAGED_PIECES` and ``scores_ahead`` on), 0 for the consumers' own, or ``None``:
            :data:`DKV_ATOMIC_WARPS`.

    Raises:
        DSAInputError: for inputs :func:`gluon_supported` rejects, or ``K == 0``.
        ValueError: for ``pieces`` / ``scores_ahead`` / ``atomic_warps`` the kernel has no build for, or
            ``products=False`` with an atomics partition.
    """
    q, kv, indices, grad_out, lse, delta = _backward_inputs(q, kv, indices, grad_out, lse, delta, "latent gradient")
    atomic_warps = DKV_ATOMIC_WARPS if atomic_warps is None else atomic_warps
    staged = atomic_warps > 0
    pieces = (DKV_STAGED_PIECES if staged else DKV_PIECES) if pieces is None else pieces
    indices_ahead = DKV_INDICES_AHEAD if indices_ahead is None else indices_ahead
    scores_ahead = DKV_SCORES_AHEAD if scores_ahead is None else scores_ahead
    if atomic_warps not in (0, 4):
        raise ValueError(f"atomic_warps must be 0 or 4 (one warpgroup), got {atomic_warps}")
    if staged and (pieces != DKV_STAGED_PIECES or not scores_ahead or not products):
        raise ValueError(f"an atomics partition takes pieces={DKV_STAGED_PIECES} with scores_ahead and the products, "
                         f"got pieces={pieces}, scores_ahead={scores_ahead}, products={products}")
    if not staged and (pieces not in (1, 2, 4) or (scores_ahead and pieces < 2)):
        raise ValueError(f"pieces={pieces}, scores_ahead={scores_ahead}: pieces is 1, 2 or 4, and 2 or 4 with "
                         "scores_ahead")
    batch, n_q, heads, dqk = q.shape
    config = GLUON_DKV_STAGED_CONFIG if staged and config is None else config
    kernel = sparse_mla_dkv_gluon_kernel if config is None else sparse_mla_dkv_gluon_kernel.fn
    kernel[(n_q, heads // BLOCK_H, batch)](
        q, kv, indices, grad_out, lse, delta, dkv,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        lse.stride(0), lse.stride(1),
        dkv.stride(0), dkv.stride(1),
        indices.shape[2], softmax_scale, softmax_scale * 1.4426950408889634,
        H=heads, D=dqk, ATOMICS=atomics, INDICES_AHEAD=indices_ahead, PRODUCTS=products,
        ATOMIC_LAYOUT=ATOMIC_LAYOUTS.index(atomic_layout or DKV_ATOMIC_LAYOUT), PIECES=pieces,
        SCORES_AHEAD=scores_ahead, ATOMIC_WARPS=atomic_warps, **_tuning(config),
    )
