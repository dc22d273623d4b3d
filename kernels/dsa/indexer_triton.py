"""Triton lightning-indexer scores over k-pools, with a streaming top-k (CUDA path).

For a block of ``Tq`` queries one score launch writes the fused score
``I[t, p] = sum_h w[t, h] * relu(scale * q[t, h] . pool_key[p])`` of every pool the block can see
into a ``[B, Tq, P_visible]`` float32 buffer (invisible pools -> ``-inf``), without the
``[Tq, H, P]`` per-head intermediate a torch implementation materializes, together with the row
maxima of ``N_COLUMNS`` disjoint column groups and of every :data:`SEGMENT` consecutive pools. The
score kernel is :func:`pool_scores_kernel` or, on Hopper, the Gluon one
(:mod:`kernels.dsa.indexer_gluon`); :func:`resolve_score_kernel` picks it.

The selection (:func:`select_kernel`), one program per row, bisects the group maxima for a key that
``n_select`` of them reach: a lower bound of the row's ``n_select``-th value. In blocks that see at
least :data:`SEGMENT_MIN_POOLS` pools it reads only the segments whose maximum reaches the bound
(a little more than ``n_select`` of them), one segment per thread, slots from prefix sums; in smaller
blocks it reads whole rows in 16-byte vectors, slots from atomic increments. The candidates (score
and pool index in one int64 slot) are few: their composite int64 keys (score bits, then the
complement of the pool index, as the torch path) are sorted in registers and the decoded pool
indices written: exact, with the tie rule (equal scores: lower pool index wins). A row with more
candidates than its slots hold (massive ties) is selected exactly by the same program in a few more
reads of the row (:func:`_select_tied`).

Each query sees one contiguous range of pools ``[lo, hi)`` (its document's complete pools up to it):
the score kernel masks with two compares, skips the pool tiles no query of its tile sees (the causal
triangle inside a block, other documents' pools), and the selection reads each row's range only. The
host never waits for the device: block bounds come from the grid's host copy of the document bounds.
Memory: ``O(T * n_select + Tq * P)``. :func:`triton_expand_selection` turns the pool indices into the
``[B, T, W]`` int32 token indices in one kernel, and :func:`triton_kpool_compress` makes the pooled keys
the scores use in one kernel (keys and gates read once).

Per launch, scores: FLOPs ``2 * B * Tq * P_visible * H * D``; bytes ``4 * Tq * P_visible`` written and
read once by the selection (about ``1/5`` of it where segments are read), plus the queries, re-read
from L2 once per ``BLOCK_N`` pools. The measurements behind the constants below are in
``kernels/dsa/README.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dsa.errors import DSAInputError
from kernels.dsa.grid import KPoolGrid, query_docs
from kernels.dsa.indexer_gluon import gluon_pool_scores


SCORE_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "PAIR": pair}, num_warps=w, num_stages=st, maxnreg=regs)
    for bm, bn, w, st, pair, regs in [
        (128, 128, 8, 3, True, None), (128, 128, 8, 2, True, None), (64, 128, 4, 3, False, None),
        # capped at 168 registers: three 64x128 CTAs per SM where shared memory allows (index dim 64:
        # 72 KiB each; ptxas spills 24 bytes per thread with segment maxima)
        (64, 128, 4, 3, False, 168), (64, 128, 4, 2, False, 168)]
]
"""Autotuned configurations of :func:`pool_scores_kernel`. On an H200 the tuner picks 64x128 with 4 warps:
two CTAs per SM, one's epilogue beside the other's MMA (6.43 ms per 8192 x 65,536 block for the full shape,
86% of the matmul rate, against 7.75 for 128x128 with ``PAIR``); for index dim 64 the 168-register cap (three
CTAs per SM) is 9-20% faster again. ``PAIR`` keeps the 128x128 tiles competitive where 64-row ones are not
chosen (53% -> 57% of the matmul rate). Tiles of 256 pools are never chosen, and with 32 column groups per
256 pools the selection's bound would stay loose up to ~1,000 visible pools."""


@triton.autotune(configs=SCORE_CONFIGS, key=["H", "D", "size_class", "N_COLUMNS", "SEG"])
@triton.jit
def pool_scores_kernel(
    Q, PK, W, OUT, COLMAX, SEGMAX, Q_LO, Q_HI,
    stride_qb, stride_qt, stride_qh,
    stride_pb, stride_pp,
    stride_wb, stride_wt,
    stride_ob, stride_ot,
    stride_cb, stride_ct,
    stride_gb, stride_gt,
    n_q, n_pools, p_lo, size_class,
    H: tl.constexpr, D: tl.constexpr, N_COLUMNS: tl.constexpr, GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIR: tl.constexpr, SEG: tl.constexpr,
):
    """Scores of ``BLOCK_M`` queries against the pool tiles ``pid_n, pid_n + n_prog, ...``
    (``n_prog = N_COLUMNS / GROUP_N`` programs along the pools) and the row maxima of this
    program's ``GROUP_N`` column groups: pool ``c`` of a tile (``c < BLOCK_N``) is in group
    ``pid_n * GROUP_N + c mod GROUP_N`` (a reshape to ``[BLOCK_M, BLOCK_N / GROUP_N, GROUP_N]``
    reduced over the middle axis). The maxima fold in registers (``[BLOCK_M, GROUP_N]``, small
    beside the accumulator) and are stored once: no atomics. ``PAIR``: two heads' loads and
    products are written before either's ReLU-weighted accumulation (same summation order), 7-8%
    faster on 128x128 tiles of the full shape, although Triton still waits for each product before
    the next is issued (``warp_group_dot_wait {pendings = 0}`` in the sm_90 TTGIR), so no epilogue
    overlaps an MMA. ``SEG > 0`` (divides ``BLOCK_N``): also the row maxima of every ``SEG``
    consecutive pools (segment ``s``: pools ``[s * SEG, (s + 1) * SEG)``) into ``SEGMAX`` ``[B, n_q,
    cdiv(n_pools, SEG)]``, for the selection to skip segments below its bound.

    Queries and pool keys arrive through tensor descriptors (``tl.make_tensor_descriptor``, out-of-range
    rows zero-filled) rather than per-element pointer tensors, whose registers made ptxas spill (296
    bytes per thread, 8 with descriptors; ``q`` must have ``stride_qh == D``; the caller sets
    ``triton.set_allocator``); score tiles leave through a descriptor too (a TMA store from shared
    memory that overlaps the next tile; ``stride_ot`` a multiple of 4 floats). ``Q_LO``/``Q_HI``
    (``[n_q]`` int32, absolute pool indices): each query's visible pools ``[lo, hi)``: two registers
    per query instead of per-tile loads of pool ends and documents; a program skips the pool tiles
    that no query of its tile sees, leaving them unwritten."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n_prog: tl.constexpr = N_COLUMNS // GROUP_N
    # int64: at 1M tokens x 32 heads x 128 the query offsets pass 2^31
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_N)
    mask_m = offs_m < n_q
    # each query sees the pools [lo, hi) of this block (its document's complete pools up to it)
    lo = tl.load(Q_LO + offs_m, mask=mask_m, other=2**31 - 1) - p_lo
    hi = tl.load(Q_HI + offs_m, mask=mask_m, other=0) - p_lo
    # pool tiles no query of this tile sees are skipped (neither scored nor stored): the causal
    # triangle inside the block and other documents' pools; the selection reads [lo, hi) only
    stride_n: tl.constexpr = n_prog * BLOCK_N
    n_first = pid_n * BLOCK_N + tl.maximum(tl.min(lo, axis=0) - pid_n * BLOCK_N, 0) // stride_n * stride_n
    n_end = tl.minimum(tl.max(hi, axis=0), n_pools)
    lo_max, hi_min = tl.max(lo, axis=0), tl.min(hi, axis=0)   # the pools every query of the tile sees
    w_base = W + b * stride_wb + offs_m * stride_wt
    pid_b, n_batch = tl.program_id(2), tl.num_programs(2)   # the batch index as int32 (descriptor coordinates)
    q_desc = tl.make_tensor_descriptor(Q, shape=[n_batch, n_q, H * D], strides=[stride_qb, stride_qt, 1],
                                       block_shape=[1, BLOCK_M, D])
    pk_desc = tl.make_tensor_descriptor(PK, shape=[n_batch, p_lo + n_pools, D], strides=[stride_pb, stride_pp, 1],
                                        block_shape=[1, BLOCK_N, D])
    out_desc = tl.make_tensor_descriptor(OUT, shape=[n_batch, n_q, n_pools],
                                         strides=[stride_ob, stride_ot, 1], block_shape=[1, BLOCK_M, BLOCK_N])
    col_max = tl.full([BLOCK_M, GROUP_N], float("-inf"), tl.float32)
    for n0 in range(n_first, n_end, stride_n):
        offs_n = n0 + offs_c
        pk_t = tl.trans(pk_desc.load([pid_b, p_lo + n0, 0]).reshape(BLOCK_N, D))
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # relu(scale * s) * w == relu(s) * (scale * w) for scale > 0: W arrives pre-scaled
        if PAIR:
            tl.static_assert(H % 2 == 0)
            for h in range(0, H, 2):
                q0 = q_desc.load([pid_b, pid_m * BLOCK_M, h * D]).reshape(BLOCK_M, D)
                q1 = q_desc.load([pid_b, pid_m * BLOCK_M, (h + 1) * D]).reshape(BLOCK_M, D)
                w0 = tl.load(w_base + h, mask=mask_m, other=0.0).to(tl.float32)
                w1 = tl.load(w_base + h + 1, mask=mask_m, other=0.0).to(tl.float32)
                s0 = tl.dot(q0, pk_t)
                s1 = tl.dot(q1, pk_t)
                acc += tl.maximum(s0, 0.0) * w0[:, None]
                acc += tl.maximum(s1, 0.0) * w1[:, None]
        else:
            for h in range(H):
                q = q_desc.load([pid_b, pid_m * BLOCK_M, h * D]).reshape(BLOCK_M, D)
                w = tl.load(w_base + h, mask=mask_m, other=0.0).to(tl.float32)
                acc += tl.maximum(tl.dot(q, pk_t), 0.0) * w[:, None]
        if (n0 < lo_max) | (n0 + BLOCK_N > hi_min):   # a tile inside every query's range skips the mask
            visible = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
            acc = tl.where(visible, acc, float("-inf"))
        # rows and pools past the buffer's bounds are not written
        out_desc.store([pid_b, pid_m * BLOCK_M, n0], acc.reshape(1, BLOCK_M, BLOCK_N))
        col_max = tl.maximum(col_max, tl.max(tl.reshape(acc, (BLOCK_M, BLOCK_N // GROUP_N, GROUP_N)), axis=1))
        if SEG > 0:
            tl.static_assert(BLOCK_N % SEG == 0)
            offs_s = n0 // SEG + tl.arange(0, BLOCK_N // SEG)
            seg_max = tl.max(tl.reshape(acc, (BLOCK_M, BLOCK_N // SEG, SEG)), axis=2)
            tl.store(SEGMAX + b * stride_gb + offs_m[:, None] * stride_gt + offs_s[None, :], seg_max,
                     mask=mask_m[:, None] & (offs_s[None, :] * SEG < n_pools))
    offs_g = pid_n * GROUP_N + tl.arange(0, GROUP_N)
    tl.store(COLMAX + b * stride_cb + offs_m[:, None] * stride_ct + offs_g[None, :], col_max,
             mask=mask_m[:, None])


SELECT_CONFIGS = [triton.Config({"CHUNK": c, "LOOP_STAGES": st}, num_warps=w)
                  for c, st, w in [(512, 2, 4), (512, 3, 4), (1024, 3, 4), (2048, 3, 4), (2048, 1, 4), (4096, 1, 4),
                                   (512, 2, 2), (512, 2, 1), (1024, 3, 2), (1024, 1, 1)]]
"""Autotuned configurations of :func:`select_kernel`. The kernel is latency-bound (a load, a slot and a
store per chunk, serially): small chunks keep few registers (64-80 at 1024-2048 against 151 at 8192: more
programs per SM) and pipelined loads overlap the chain (at 65,536 pools, whole rows: CHUNK 1024 with 3
stages 1.17 ms per 8192 rows against 1.51 for 4096 unpipelined). With short rows (64k tokens: rows of at
most 4,096 pools) the two in-register sorts per row dominate; one or two warps per row do them with fewer
cross-warp exchanges. Where rows are read by segments one warp per row is the fastest too; with ``CHUNK``
1024 and ``SEGMENT`` 32 each lane holds one segment per step."""


@triton.jit
def _put_candidates(slots, pos, vals, pools, mask):
    """Store candidates in a row's slots (``CAPACITY`` int64; ``mask`` keeps ``pos`` inside them): at ``pos``, the
    float32 bits of a score ``vals`` in the high half and its absolute pool index ``pools`` (int32, >= 0) in the
    low half, one 8-byte store (the composite keys are built by :func:`_sorted_pools` for the few candidates,
    not for every entry)."""
    tl.store(slots + pos, (vals.to(tl.int32, bitcast=True).to(tl.int64) << 32) | pools.to(tl.int64), mask=mask)


@triton.jit
def _sorted_pools(slots, count, n_keys: tl.constexpr):
    """The pools of the first ``count`` (``<= n_keys``) candidates at ``slots`` (:func:`_put_candidates`), best
    first (``[n_keys]`` int64, -1 past ``count``)."""
    idx = tl.arange(0, n_keys)
    valid = idx < count
    slot = tl.load(slots + idx, mask=valid, other=0)
    bits, pools = (slot >> 32).to(tl.int32), (slot & 4294967295).to(tl.int32)
    # empty slots get INVALID_KEY (int64 min), which sorts last and decodes to -1
    cand = tl.where(valid, _composite_key(bits.to(tl.float32, bitcast=True), pools), -9223372036854775808)
    cand = tl.sort(cand, descending=True)
    return tl.where(cand == -9223372036854775808, -1, 4294967295 - (cand & 4294967295))


@triton.jit
def _ordered(vals):
    """Order-preserving int32 image of float32 ``vals`` (-0.0 folded into +0.0: equal scores, equal
    images), the high half of a composite selection key (:func:`kernels.dsa.indexer.selection_keys`)."""
    bits = tl.where(vals == 0.0, 0.0, vals).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _passes(vals, bound):
    """Which float32 ``vals`` are candidates: at or above ``bound`` (a float32 scalar, possibly ``-inf``) and
    finite, in one compare (the bound raised to ``-FLT_MAX`` leaves out ``-inf``, the masked entries)."""
    return vals >= tl.maximum(bound, -3.4028234663852886e38)


@triton.jit
def _search_bound(col_max, N_SELECT: tl.constexpr, N_COLUMNS: tl.constexpr, SLACK: tl.constexpr):
    """A lower bound of a row's ``N_SELECT``-th value from its ``[N_COLUMNS]`` float32 column-group maxima,
    without sorting them: bisection on their :func:`_ordered` images for a key that ``N_SELECT`` to
    ``N_SELECT + SLACK`` maxima reach (the ``N_SELECT``-th largest itself if the bisection ends first). Every
    maximum is a distinct group's, so at least ``N_SELECT`` entries reach the returned float32. (~70 SASS
    instructions per step with one warp; a sort of 512 maxima is 2,320.)"""
    key = _ordered(col_max)
    lo = tl.min(key, axis=0).to(tl.int64)          # count(key >= lo) = N_COLUMNS >= N_SELECT
    hi = tl.max(key, axis=0).to(tl.int64) + 1      # count(key >= hi) = 0
    n_lo = tl.full([], N_COLUMNS, tl.int32)
    while (hi - lo > 1) & (n_lo > N_SELECT + SLACK):
        mid = lo + (hi - lo) // 2
        n = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        enough = n >= N_SELECT
        lo, n_lo, hi = tl.where(enough, mid, lo), tl.where(enough, n, n_lo), tl.where(enough, hi, mid)
    k = lo.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _composite_key(vals, pools):
    """int64 composite keys of float32 scores ``vals`` of pools ``pools`` (absolute indices): the
    ordered score, then the complement of the pool index (equal scores: lower pool first)."""
    return (_ordered(vals).to(tl.int64) << 32) | (4294967295 - pools.to(tl.int64))


@triton.jit
def _take_candidates(vals, offs, bound, counter, slots, p_lo, CAPACITY: tl.constexpr):
    """Write the entries of ``vals`` (float32 scores of pools ``p_lo + offs``) at or above
    ``bound`` to the next free ``slots`` (:func:`_put_candidates`; ``counter``: the row's
    count, ``[len(vals)]`` pointers to it; slots past ``CAPACITY`` are counted, not written).
    Relaxed atomics: the barrier before the sort publishes the slots (acquire-release ones were 29%
    slower at 65,536 pools)."""
    keep = _passes(vals, bound)
    pos = tl.atomic_add(counter, 1, mask=keep, sem="relaxed")
    _put_candidates(slots, pos, vals, p_lo + offs, keep & (pos < CAPACITY))


@triton.jit
def _opaque_lanes(n: tl.constexpr, zero):
    """``tl.arange(0, n)[None, :]`` (``[1, n]`` int32) as ``lane ^ zero`` (``zero``: a runtime int32 0), so the
    compiler does not see the values as contiguous. A load through them takes the layout of the scattered
    stores that follow (one thread per row of the tile, its ``n`` values in registers) instead of a vectorized
    one, and nothing is converted through shared memory in between (on sm_90 a 2-d tile with vector loads had
    three ``[32, 64]`` conversions per step). The loads stay coalesced: a warp reads whole rows."""
    return tl.arange(0, n)[None, :] ^ zero


@triton.jit
def _places(ones, start):
    """Where the marked entries of a ``[R, n]`` tile go in a list filled from ``start`` on, row by row:
    ``ones`` int32 0/1; returns ``[R, n]`` int32 places (meaningful where marked) and ``start`` plus their number.
    Prefix sums along each row (in a thread's registers when the row is) and over the rows' counts (a 1-d
    prefix sum over a whole chunk cost five warp shuffles per value)."""
    per_row = tl.sum(ones, axis=1)
    places = start + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(ones, axis=1) - 1
    return places, start + tl.sum(per_row, axis=0)


@triton.jit
def _compact_hits(seg_row, hits, s0, s_lo, s_hi, bound, n_hits, SEG_CHUNK: tl.constexpr):
    """Append to ``hits`` (from ``n_hits`` on) the segments ``s`` of ``[s0, s0 + SEG_CHUNK)`` inside ``[s_lo, s_hi)``
    whose maximum (``seg_row[s]``, float32) reaches ``bound`` and is finite. Returns ``n_hits`` plus their number.
    The chunk is a ``[SEG_CHUNK / 32, 32]`` tile of runs of segments (one run below 32), placed by
    :func:`_places`, each run read as int64 pairs of maxima (``seg_row`` 8-byte aligned: the maxima's row stride
    is even; ``s0`` a multiple of ``SEG_CHUNK``)."""
    RUN: tl.constexpr = SEG_CHUNK if SEG_CHUNK < 32 else 32
    runs = s0 + tl.arange(0, SEG_CHUNK // RUN)[:, None] * RUN
    even = runs + 2 * _opaque_lanes(RUN // 2, (n_hits < 0).to(tl.int32))
    _, _, keep0, keep1, pos0, pos1, n_hits = _passing_pairs(seg_row, even, True, s_lo, s_hi, bound, n_hits)
    tl.store(hits + pos0, even, mask=keep0)
    tl.store(hits + pos1, even + 1, mask=keep1)
    return n_hits


@triton.jit
def _passing_pairs(base, even, valid, lo, hi, bound, start):
    """The float32 pairs ``base[even], base[even + 1]`` (``base`` 8-byte aligned, ``even`` an int32 tile of even
    offsets), each read as one int64 (little-endian: the first float in the low half) where ``valid`` and
    one of the two offsets is in ``[lo, hi)``, and which of them pass ``bound`` (:func:`_passes`) with their
    places in a list filled from ``start`` on (:func:`_places`; both pass: the first a place before the second).
    Returns ``v0, v1`` (float32, ``-inf`` outside ``[lo, hi)``), ``keep0, keep1``, ``pos0, pos1`` and ``start``
    plus the number passing."""
    pair = tl.load(base.to(tl.pointer_type(tl.int64)) + even // 2, mask=valid & (even < hi) & (even + 1 >= lo),
                   other=0)
    v0 = tl.where(valid & (even >= lo) & (even < hi),
                  (pair & 4294967295).to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    v1 = tl.where(valid & (even + 1 >= lo) & (even + 1 < hi),
                  (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    keep0, keep1 = _passes(v0, bound), _passes(v1, bound)
    pos1, start = _places(keep0.to(tl.int32) + keep1.to(tl.int32), start)
    return v0, v1, keep0, keep1, pos1 - keep1.to(tl.int32), pos1, start


@triton.jit
def _take_segments(row, hits, k0, n_hits, lo, hi, bound, slots, p_lo, written, SEG: tl.constexpr,
                   SEGS: tl.constexpr, CAPACITY: tl.constexpr):
    """Candidates of the hit segments ``k0 .. k0 + SEGS - 1`` of a score row: the entries of ``[lo, hi)`` at or
    above ``bound`` in segments ``hits[k]`` (``k < n_hits``; ``SEG`` pools each) to the slots from ``written`` on
    (:func:`_put_candidates`). Returns ``written`` plus their number.

    The segments form a ``[SEGS, SEG]`` tile held one segment per thread (:func:`_opaque_lanes`): a
    candidate's slot comes from prefix sums (:func:`_places`), and no entry takes an atomic (one
    warp-aggregated ``ATOMG`` per entry, and the layout conversions around them, were 40% of the
    selection's instructions at 65,536 pools). Each thread reads its segment as ``SEG / 2`` int64 score
    pairs (the row 8-byte aligned: its stride is a multiple of 16 pools): a warp-wide load touches 32
    cache lines either way, and pairs halve those requests (-27 to -31% per block)."""
    k = k0 + tl.arange(0, SEGS)
    seg = tl.load(hits + k, mask=k < n_hits, other=0)
    even = 2 * (seg[:, None] * (SEG // 2) + _opaque_lanes(SEG // 2, (n_hits < 0).to(tl.int32)))
    v0, v1, keep0, keep1, pos0, pos1, written = _passing_pairs(row, even, (k < n_hits)[:, None], lo, hi, bound,
                                                               written)
    _put_candidates(slots, pos0, v0, p_lo + even, keep0 & (pos0 < CAPACITY))
    _put_candidates(slots, pos1, v1, p_lo + even + 1, keep1 & (pos1 < CAPACITY))
    return written


@triton.jit
def _count_at_least(row, lo, hi, key, CHUNK: tl.constexpr):
    """Visible entries of the score row ``row`` in ``[lo, hi)`` whose :func:`_ordered` image is
    ``>= key`` (int64 scalar, at most ``2^31 - 1``), one read of the range."""
    flat = tl.arange(0, CHUNK)
    key32 = key.to(tl.int32)
    n = tl.full([], 0, tl.int32)
    for c0 in range(lo // CHUNK * CHUNK, hi, CHUNK):
        offs = c0 + flat
        vals = tl.load(row + offs, mask=(offs >= lo) & (offs < hi), other=float("-inf"))
        n += tl.sum(((_ordered(vals) >= key32) & (vals > float("-inf"))).to(tl.int32), 0)
    return n


@triton.jit
def _select_tied(row, lo, hi, bound, slots, p_lo, N_SELECT: tl.constexpr, CHUNK: tl.constexpr):
    """Exact selection of a row whose candidates overflowed their slots (massive ties): its best
    ``N_SELECT`` visible entries of ``[lo, hi)`` to the first ``N_SELECT`` slots (:func:`_put_candidates`),
    in pool order (the caller sorts them). Returns ``N_SELECT`` (int32). ``CHUNK`` entries per step
    (small: this rare path's vectors set the kernel's register count too).

    The ``N_SELECT``-th largest score ``s`` (as its :func:`_ordered` image, at or above ``bound``'s)
    by bisection: at most 32 reads of the range, one when ``s`` is the bound (the tie sits at the
    bound; the bisection also ends with the count above ``s``). Then one read keeps the entries
    above ``s`` and the first ``N_SELECT - (entries above s)`` entries equal to ``s`` in pool order
    (the tie rule), placed by prefix sums."""
    k_lo = _ordered(bound).to(tl.int64)          # count(>= k_lo) >= N_SELECT
    k_hi = tl.full([], 2**31 - 1, tl.int64)      # count(>= k_hi) == 0: 0x7FFFFFFF is a NaN's image
    above = tl.full([], 0, tl.int32)             # count(>= k_hi) < N_SELECT
    n = _count_at_least(row, lo, hi, k_lo + 1, CHUNK)
    k_hi, above = tl.where(n < N_SELECT, k_lo + 1, k_hi), tl.where(n < N_SELECT, n, above)
    while k_hi - k_lo > 1:
        mid = (k_lo + k_hi) // 2
        n = _count_at_least(row, lo, hi, mid, CHUNK)
        k_lo = tl.where(n >= N_SELECT, mid, k_lo)
        k_hi, above = tl.where(n >= N_SELECT, k_hi, mid), tl.where(n >= N_SELECT, above, n)
    need = N_SELECT - above                      # k_hi == k_lo + 1: above counts the entries > s
    s = k_lo.to(tl.int32)
    flat = tl.arange(0, CHUNK)
    written = tl.full([], 0, tl.int32)
    ties = tl.full([], 0, tl.int32)
    for c0 in range(lo // CHUNK * CHUNK, hi, CHUNK):
        offs = c0 + flat
        vals = tl.load(row + offs, mask=(offs >= lo) & (offs < hi), other=float("-inf"))
        image = _ordered(vals)
        visible = vals > float("-inf")
        tie = visible & (image == s)
        keep = (visible & (image > s)) | (tie & (ties + tl.cumsum(tie.to(tl.int32), 0) <= need))
        _put_candidates(slots, written + tl.cumsum(keep.to(tl.int32), 0) - 1, vals, p_lo + offs, keep)
        written += tl.sum(keep.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    return written


TIE_CHUNK = tl.constexpr(256)
"""Entries per step of the selection's exact pass over rows whose candidates overflow (:func:`_select_tied`)."""


# COUNT is zeroed before each configuration's timing runs: accumulated over them, every row would
# overflow its slots and take the slow exact pass (_select_tied) in the tuning call
@triton.autotune(configs=SELECT_CONFIGS, key=["N_COLUMNS", "CAPACITY", "size_class", "SEG"], reset_to_zero=["COUNT"])
@triton.jit
def select_kernel(
    S, COLMAX, SEGMAX, HITS, COUNT, SLOTS, OUT, Q_LO, Q_HI,
    stride_sb, stride_st, stride_cb, stride_ct, stride_gb, stride_gt, stride_nb, stride_ob, stride_ot,
    n_rows, n_cols, p_lo, size_class,
    N_SELECT: tl.constexpr, N_COLUMNS: tl.constexpr, CAPACITY: tl.constexpr,
    CHUNK: tl.constexpr, LOOP_STAGES: tl.constexpr, SEG: tl.constexpr, SEG_CHUNK: tl.constexpr,
    BOUND_SLACK: tl.constexpr,
):
    """Per score row: a lower bound on its n_select-th value, the composite keys above it,
    and the decoded pool indices of the best ``N_SELECT`` (-1 where fewer are visible).

    The bound (:func:`_search_bound`) is a key that ``N_SELECT`` to ``N_SELECT + BOUND_SLACK`` of the row's
    ``N_COLUMNS`` column-group maxima (written by the score kernel) reach: met by ``N_SELECT`` entries of
    distinct groups, so it bounds the row's ``N_SELECT``-th value from below; with ``N_COLUMNS >= 4 *
    N_SELECT`` it is close to it (about ``N_SELECT * (1 + N_SELECT / (2 N_COLUMNS))`` entries pass for random
    scores). Passing entries take a slot and are written to a ``CAPACITY``-slot int64 scratch row
    (:func:`_put_candidates`); their composite int64 keys (score bits, then the complement of the pool
    index, as the torch path), sorted in registers, make the order exact and deterministic (tie rule: lower
    pool index first). Reading whole rows (``SEG`` 0), a slot is a relaxed atomic increment of the row's
    ``COUNT`` (zeroed by the caller); reading segments, it comes from prefix sums (:func:`_take_segments`) and
    ``COUNT`` is not used. A row with more than ``CAPACITY`` candidates is selected again by
    :func:`_select_tied` (massive ties). Rows with at most ``CAPACITY / 2`` candidates (nearly all) sort half
    as many keys. Only each row's visible pools ``[Q_LO, Q_HI)`` (``[n_rows]`` int32, absolute) are read: the
    score kernel leaves other tiles unwritten.

    ``SEG > 0`` (needs the score kernel's ``SEGMAX`` of the same ``SEG``): only the ``SEG``-pool segments whose
    maximum reaches the bound are read (every passing entry lies in one): their indices are compacted
    ``SEG_CHUNK`` at a time (:func:`_compact_hits`) into the row's ``HITS`` scratch (int32, ``cdiv(n_cols, SEG)``
    entries), then gathered ``CHUNK / SEG`` segments per step (:func:`_take_segments`). For random scores a
    little more than ``N_SELECT`` segments pass: about 7% of the row at 65,536 pools, ``SEG`` 32, ``N_SELECT`` 128.
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // n_rows
    t = row % n_rows
    base = S + b * stride_sb + t * stride_st
    flat = tl.arange(0, CHUNK)
    # the row's visible pools [lo, hi): only those were scored (the score kernel skips other tiles)
    lo = tl.load(Q_LO + t) - p_lo
    hi = tl.load(Q_HI + t) - p_lo
    col_max = tl.load(COLMAX + b * stride_cb + t * stride_ct + tl.arange(0, N_COLUMNS))
    bound = _search_bound(col_max, N_SELECT, N_COLUMNS, BOUND_SLACK)
    slots = SLOTS + row * CAPACITY
    count_ptr = COUNT + b * stride_nb + t
    counter = count_ptr + tl.zeros([CHUNK], tl.int32)
    if SEG > 0:
        tl.static_assert(CHUNK % SEG == 0)
        n_segs = tl.cdiv(n_cols, SEG)
        seg_row = SEGMAX + b * stride_gb + t * stride_gt
        hits = HITS + row * n_segs
        n_hits = tl.full([], 0, tl.int32)
        s_lo, s_hi = lo // SEG, tl.cdiv(hi, SEG)
        for s0 in range(s_lo // SEG_CHUNK * SEG_CHUNK, s_hi, SEG_CHUNK):
            n_hits = _compact_hits(seg_row, hits, s0, s_lo, s_hi, bound, n_hits, SEG_CHUNK)
        # the hit list, written by every thread, is read by others below
        tl.debug_barrier()
        written = tl.full([], 0, tl.int32)
        for k0 in tl.range(0, n_hits, CHUNK // SEG, num_stages=LOOP_STAGES):
            written = _take_segments(base, hits, k0, n_hits, lo, hi, bound, slots, p_lo, written, SEG, CHUNK // SEG,
                                     CAPACITY)
    else:
        # whole 16-byte vectors of the row ([lo, hi) widened to multiples of 4 floats: inside the row's padded
        # stride), masked to [lo, hi) after the load: vector loads instead of one per float
        lo4, hi4 = lo // 4 * 4, (hi + 3) // 4 * 4
        for c0 in tl.range(lo4 // CHUNK * CHUNK, hi4, CHUNK, num_stages=LOOP_STAGES):
            offs = c0 + flat
            vals = tl.load(base + offs, mask=(offs >= lo4) & (offs < hi4))
            vals = tl.where((offs >= lo) & (offs < hi), vals, float("-inf"))
            _take_candidates(vals, offs, bound, counter, slots, p_lo, CAPACITY)
    # other threads' slot writes and counter increments must be visible to this one's loads
    tl.debug_barrier()
    if SEG > 0:
        count = written
    else:
        count = tl.load(count_ptr)
    if count > CAPACITY:   # massive ties: more candidates than slots; an exact pass over the row
        count = _select_tied(base, lo, hi, bound, slots, p_lo, N_SELECT, TIE_CHUNK)
        tl.debug_barrier()
    out = OUT + b * stride_ob + t * stride_ot
    # (a runtime branch may not rebind a name to another shape: each branch stores its own)
    if count <= CAPACITY // 2:   # CAPACITY // 2 >= 2 * N_SELECT (candidate_capacity)
        half = tl.arange(0, CAPACITY // 2)
        tl.store(out + half, _sorted_pools(slots, count, CAPACITY // 2), mask=half < N_SELECT)
    else:
        whole = tl.arange(0, CAPACITY)
        tl.store(out + whole, _sorted_pools(slots, count, CAPACITY), mask=whole < N_SELECT)


@triton.jit
def expand_kernel(
    POOLS, START, Q_POS, Q_DOC_START, OUT,
    stride_pb, stride_pt, stride_ob, stride_ot,
    n_q, n_select,
    KPOOL: tl.constexpr, KPOOL_P2: tl.constexpr, SELECT_P2: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Token indices of ``BLOCK_T`` queries' selected pools (and tails), written once.

    Row ``t`` of ``OUT`` gets ``START[p] + j`` (``j < KPOOL``) at ``i * KPOOL + j`` for its
    ``i``-th pool ``p`` (``-1`` for ``p = -1``) and, with ``TAIL``, the visible tokens of its
    current incomplete pool at ``n_select * KPOOL + j`` (:func:`kernels.dsa.indexer.tail_indices`):
    every element of the row, so ``OUT`` needs no fill.
    """
    b = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, SELECT_P2)
    offs_j = tl.arange(0, KPOOL_P2)
    mask_t = offs_t < n_q
    mask_ti = mask_t[:, None] & (offs_i[None, :] < n_select)
    pools = tl.load(POOLS + b * stride_pb + offs_t[:, None] * stride_pt + offs_i[None, :], mask=mask_ti, other=-1)
    start = tl.load(START + tl.maximum(pools, 0), mask=mask_ti & (pools >= 0), other=0)
    tokens = tl.where((pools >= 0)[:, :, None], (start[:, :, None] + offs_j[None, None, :]).to(tl.int32), -1)
    row = OUT + b * stride_ob + offs_t[:, None, None] * stride_ot
    mask = mask_ti[:, :, None] & (offs_j[None, None, :] < KPOOL)
    tl.store(row + offs_i[None, :, None] * KPOOL + offs_j[None, None, :], tokens, mask=mask)
    if TAIL:
        q_pos = tl.load(Q_POS + offs_t, mask=mask_t, other=0)
        doc_start = tl.load(Q_DOC_START + offs_t, mask=mask_t, other=0)
        count = (q_pos - doc_start + 1) % KPOOL
        tail = tl.where(offs_j[None, :] < count[:, None], (q_pos + 1 - count)[:, None] + offs_j[None, :], -1)
        tl.store(OUT + b * stride_ob + offs_t[:, None] * stride_ot + n_select * KPOOL + offs_j[None, :],
                 tail.to(tl.int32), mask=mask_t[:, None] & (offs_j[None, :] < KPOOL - 1))


EXPAND_ROWS = 8
"""Queries per :func:`expand_kernel` program: at 1M tokens (8.6 GB written) 2.78 / 2.95 / 3.21 / 3.60 ms for
8 / 1 / 4 / 2 on an H200, ``fill_`` of the output 1.86 ms; 16 spills registers (offline sm_90)."""


def expand_constants(kpool: int, n_select: int, select_tail: bool, block_t: int) -> dict:
    """The :func:`expand_kernel` constexprs for ``kpool``-token pools, ``n_select`` pools per query, with or
    without tails, ``block_t`` queries per program (here and in :mod:`kernels.dsa.sm90`)."""
    return dict(KPOOL=kpool, KPOOL_P2=triton.next_power_of_2(kpool), SELECT_P2=triton.next_power_of_2(max(n_select, 1)),
                TAIL=select_tail, BLOCK_T=block_t)


def triton_expand_selection(pools: torch.Tensor, grid: KPoolGrid, n_q: int, q_offset: int, topk: int,
                            select_tail: bool, block_t: int = EXPAND_ROWS) -> torch.Tensor:
    """:func:`kernels.dsa.indexer.expand_selection` in one kernel: pool indices ``[B, T,
    topk // kpool]`` (int64, -1 = none) -> token indices ``[B, T, W]`` int32, each output byte
    written once (the torch path fills, gathers, masks and copies: ~24 ms of the indexer's 0.78 s
    at 1M tokens, full shape, on an H200). ``block_t``: queries per program."""
    batch, kpool = pools.shape[0], grid.kpool
    n_select = pools.shape[-1]
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.empty((batch, n_q, width), dtype=torch.int32, device=pools.device)
    if n_q == 0 or width == 0:
        return out
    pools = pools.contiguous()
    q_pos, q_doc = query_docs(grid, n_q, q_offset, pools.device)
    doc_start = grid.doc_bounds[q_doc].contiguous()
    expand_kernel[(triton.cdiv(n_q, block_t), batch)](
        pools, grid.start.contiguous(), q_pos, doc_start, out,
        pools.stride(0), pools.stride(1), out.stride(0), out.stride(1), n_q, n_select,
        **expand_constants(kpool, n_select, select_tail, block_t),
    )
    return out


@triton.jit
def compress_kernel(
    K, G, APE, START, DOC, DOC_BOUNDS, OUT,
    stride_kb, stride_ks, stride_gb, stride_gs, stride_ob, stride_op,
    n_pools,
    D: tl.constexpr, D_P2: tl.constexpr, KPOOL: tl.constexpr, KPOOL_P2: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Pooled keys of ``BLOCK_P`` pools of batch row ``b``: per channel ``d``, the softmax over the
    pool's tokens (those inside its document) of ``G[t, d] + APE[i, d]`` weighting ``K[t, d]``, in
    float32 (:func:`kernels.dsa.indexer.compress_on_grid`); keys and gates read once."""
    b = tl.program_id(1).to(tl.int64)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_i = tl.arange(0, KPOOL_P2)
    offs_d = tl.arange(0, D_P2)
    mask_p = offs_p < n_pools
    start = tl.load(START + offs_p, mask=mask_p, other=0)
    end = tl.load(DOC_BOUNDS + tl.load(DOC + offs_p, mask=mask_p, other=0) + 1, mask=mask_p, other=0)
    tokens = start[:, None] + offs_i[None, :]                                               # [P, I]
    present = (mask_p[:, None] & (offs_i[None, :] < KPOOL) & (tokens < end[:, None]))[:, :, None] \
        & (offs_d[None, None, :] < D)                                                        # [P, I, D]
    gates = tl.load(G + b * stride_gb + tokens[:, :, None] * stride_gs + offs_d[None, None, :], mask=present,
                    other=float("-inf")).to(tl.float32)
    ape = tl.load(APE + offs_i[:, None] * D + offs_d[None, :], mask=(offs_i[:, None] < KPOOL) & (offs_d[None, :] < D),
                  other=0.0).to(tl.float32)
    logits = gates + ape[None, :, :]
    weights = tl.exp(logits - tl.max(logits, axis=1)[:, None, :])
    weights = weights / tl.sum(weights, axis=1)[:, None, :]
    keys = tl.load(K + b * stride_kb + tokens[:, :, None] * stride_ks + offs_d[None, None, :], mask=present,
                   other=0.0).to(tl.float32)
    pooled = tl.sum(weights * keys, axis=1)                                                  # [P, D]
    tl.store(OUT + b * stride_ob + offs_p[:, None] * stride_op + offs_d[None, :], pooled.to(OUT.dtype.element_ty),
             mask=mask_p[:, None] & (offs_d[None, :] < D))


COMPRESS_ELEMENTS = 16384
"""Gate (and key) elements one :func:`compress_kernel` program holds: ``BLOCK_P * kpool * D``, e.g. 16
pools of 16 tokens at index dim 64 (195 registers, no spill, offline sm_90). At 1M tokens on an H200:
0.122 / 0.166 / 0.458 ms at 16,384 / 8192 / 4096 for index dim 64, 0.216 / 0.315 / 0.912 for 128; 8 warps
slower; the torch path 2.78 and 4.20 ms."""

COMPRESS_WARPS = 4
"""Warps per :func:`compress_kernel` program."""


def triton_kpool_compress(keys: torch.Tensor, gate_scores: torch.Tensor, ape: torch.Tensor,
                          grid: KPoolGrid) -> torch.Tensor:
    """:func:`kernels.dsa.indexer.compress_on_grid` in one kernel, forward only (the indexer's
    selection; the KL loss, which trains the compression, keeps the differentiable torch path).
    Per channel, ``pool_key[p, d] = sum_i softmax_i(gate[start_p + i, d] + ape[i, d]) * keys[start_p + i, d]``
    over the pool's tokens inside its document (``Glm5NextTextIndexer.get_pooled_states``).

    Args:
        keys, gate_scores: ``[B, S, D]`` bf16, fp16 or fp32 (last dim contiguous).
        ape: ``[kpool, D]`` positional bias.
        grid: the pools (:func:`kernels.dsa.grid.kpool_grid` over the ``S`` keys).

    Returns:
        ``[B, P, D]`` pooled keys in ``keys.dtype``, computed in float32: the torch path's values up to
        float32 rounding (another summation order and ``exp``), so a bf16 result can differ from it by
        one bf16 ulp (``tests/gpu/dsa_check.py`` checks that, and the same error against float64).
        Bytes: the keys and gates read once, ``[B, P, D]`` written (at 1M tokens, index dim 64, bf16:
        0.27 GB, 0.12 ms on an H200; the torch path materializes float32 ``[B, P, kpool, D]``
        intermediates: 2.78 ms).

    Raises:
        DSAInputError: float64 inputs (the float64 reference stays on the torch path).
    """
    if keys.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DSAInputError(f"the Triton k-pool compression takes bf16, fp16 or fp32 keys, got {keys.dtype}")
    batch, _, dim = keys.shape
    n_pools, kpool = grid.start.numel(), grid.kpool
    keys, gate_scores = (x if x.stride(-1) == 1 else x.contiguous() for x in (keys, gate_scores))
    ape = ape.contiguous()
    out = torch.empty(batch, n_pools, dim, dtype=keys.dtype, device=keys.device)
    if n_pools == 0 or batch == 0:
        return out
    constants = compress_constants(dim, kpool)
    compress_kernel[(triton.cdiv(n_pools, constants["BLOCK_P"]), batch)](
        keys, gate_scores, ape, grid.start, grid.doc, grid.doc_bounds, out,
        keys.stride(0), keys.stride(1), gate_scores.stride(0), gate_scores.stride(1), out.stride(0), out.stride(1),
        n_pools, **constants, num_warps=COMPRESS_WARPS,
    )
    return out


def compress_constants(dim: int, kpool: int) -> dict:
    """The :func:`compress_kernel` constexprs for index dim ``dim`` and ``kpool``-token pools: ``BLOCK_P`` pools
    per program from :data:`COMPRESS_ELEMENTS` (here and in :mod:`kernels.dsa.sm90`)."""
    d_p2, kpool_p2 = triton.next_power_of_2(dim), triton.next_power_of_2(kpool)
    block_p = max(1, COMPRESS_ELEMENTS // (d_p2 * kpool_p2))
    return dict(D=dim, D_P2=d_p2, KPOOL=kpool, KPOOL_P2=kpool_p2, BLOCK_P=block_p)


def size_class(n_pools: int) -> int:
    """Autotuning bucket of a query block that sees ``n_pools`` pools: 0 below 256, then one class
    per factor 4 (256, 1,024, 4,096, 16,384) and 5 from 65,536 (the last blocks at 1M tokens,
    kpool 16). The tuner times a key's configurations on the first block of that key."""
    return min(5, max(0, (n_pools.bit_length() - 7) // 2))


GROUP_N = 32
"""Column groups per score program (its maxima stay in registers beside the accumulator): 16
programs along the pools with :data:`COLUMNS_PER_SELECTED` 4 and 128 selected pools."""

COLUMNS_PER_SELECTED = 4
"""Column groups per selected pool. More columns give a tighter bound (about ``n_select * (1 + n_select /
(2 columns))`` candidates for random scores: 144 of 128 with 4 per selected pool, 160 with 2) at the price of
more maxima to keep and search; 2 (with ``GROUP_N`` 16) ran within 2% end to end on an H200, either way."""

SEGMENT = 32
"""Pools per segment whose row maxima the score kernel keeps so that the selection reads only the segments
that can hold a candidate. The selection gathers about ``n_select`` segments per row whatever the row's
length, so narrower segments cut its work while the score kernel keeps more maxima: at 1M tokens, small
shape, on an H200 the selection took 58 / 43 / 37 ms with 64- / 32- / 16-pool segments and the Gluon score
kernel 152 / 161 / 171 ms; end to end 0.2205 / 0.2116 / 0.2141 s."""

SEGMENT_MIN_POOLS = 16384
"""Query blocks that see fewer pools read whole rows: there the score kernel's segment maxima cost more than
the selection saves (one 8192-query block, full shape, whole rows against 64-pool segments: 2.01 vs 2.07 ms
at 8192 pools, 3.49 vs 3.25 at 16,384, 10.37 vs 10.29 at 65,536; 8192 and 32,768 as the threshold ran within
0.6% at 1M and up to 3% slower at 256k)."""

SEGMENT_CHUNK = 1024
"""Segment maxima the selection compacts at a time (one step up to 32,768 pools at ``SEGMENT`` 32, two at 65,536)."""

BOUND_SLACK = 32
"""How many maxima beyond ``n_select`` may reach the selection's bound when its bisection stops
(:func:`_search_bound`): a looser bound lets a few more candidates pass, more bisection steps cost
more than they save (small shape, 1M tokens: selection 31.4 ms against 36.2 ms for the exact
``n_select``-th maximum by a sort)."""

SCORE_BUFFER_ELEMENTS = 2**29
"""Float32 scores one query block should hold (2 GiB): ``triton_pool_topk`` takes query blocks of the
multiple of the block unit (:func:`_block_unit`) nearest to the rows whose ``[B, rows, pools]`` buffer
fits, at least one unit (one unit at 1M tokens, kpool 16; four at 256k; the whole sequence at 64k).
Bigger blocks mean fewer launches; the causal triangle inside a block costs nothing, the score kernel
skips the tiles no query of a tile sees."""

QUERY_BLOCK_MIN = 8192
"""The fewest queries of a block unit (:func:`_block_unit`): fewer would mean more launches."""

SCORE_BLOCK_M = 64
"""Queries per score program: the Gluon kernel's ``BLOCK_M``. (The Triton kernel's 128-query tilings make
half as many programs of a unit: whole waves still, at up to 8 programs per SM.)"""


def resolve_score_kernel(score_kernel: str, q: torch.Tensor) -> str:
    """The score kernel ``score_kernel`` names for queries ``q`` (``[B, T, H, D]``): ``"triton"``
    (:func:`pool_scores_kernel`), ``"gluon"`` (:func:`kernels.dsa.indexer_gluon.gluon_pool_scores`: Hopper only,
    each head's ``wgmma`` overlapping the previous head's ReLU-weighted accumulation) or ``"auto"``: ``"gluon"``
    for bf16/fp16 queries on a Hopper GPU (CUDA capability 9.x) with an even head count, ``"triton"`` otherwise
    (other GPUs such as B200, fp32, the Triton interpreter on the CPU). Both write the same scores bit for bit;
    on an H200, one block of 8192 queries x 65,536 pools took 2.26 ms (Gluon) against 2.44 (Triton) at index
    dim 64 and 6.24 against 6.43 at 128.

    Raises:
        DSAInputError: ``score_kernel`` is none of ``"auto"``, ``"triton"``, ``"gluon"``, or ``"gluon"`` with
            an odd number of heads.
    """
    if score_kernel not in ("auto", "triton", "gluon"):
        raise DSAInputError(f"score_kernel must be 'auto', 'triton' or 'gluon', got {score_kernel!r}")
    heads = q.shape[2]
    if score_kernel == "gluon" and heads % 2:
        raise DSAInputError(f"the Gluon score kernel needs an even number of index heads, got {heads}")
    if score_kernel == "auto":
        hopper = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
        score_kernel = "gluon" if hopper and q.dtype in (torch.bfloat16, torch.float16) and heads % 2 == 0 else "triton"
    return score_kernel


def _padded(n_pools: int) -> int:
    """Row stride of the score buffer: ``n_pools`` rounded up to a multiple of 16."""
    return -(-n_pools // 16) * 16


def _even(n: int) -> int:
    """``n`` rounded up to an even number."""
    return n + (n & 1)


def _block_unit(device: torch.device) -> int:
    """Queries per block unit on ``device``: on CUDA the smallest multiple of ``SCORE_BLOCK_M * SMs`` (64 x 132 =
    8448 on an H200, 9472 on a B200) of at least :data:`QUERY_BLOCK_MIN` queries; :data:`QUERY_BLOCK_MIN`
    elsewhere (the interpreter). A block of ``n_q`` such queries launches ``n_prog * n_q / 64`` score programs
    (``n_prog`` = 16 at ``index_topk`` 2048, kpool 16), a multiple of ``16 * SMs``: whole waves at 1, 2, 4, 8 or
    16 programs per SM, where 8192-query blocks gave 2048 programs, 7.76 waves of two per SM (the last one a
    quarter empty) on an H200: -2.5% end to end at 1M tokens (small shape), -1.5% (full)."""
    if device.type != "cuda":
        return QUERY_BLOCK_MIN
    wave = SCORE_BLOCK_M * torch.cuda.get_device_properties(device).multi_processor_count
    return -(-QUERY_BLOCK_MIN // wave) * wave


def _query_block(batch: int, n_pools: int, unit: int) -> int:
    """Queries per block: the multiple of ``unit`` (:func:`_block_unit`) nearest to the rows whose score
    buffer fits :data:`SCORE_BUFFER_ELEMENTS` for ``n_pools`` pools, at least ``unit`` (so the buffer may
    pass the budget by half a unit's rows: 2.2 GB at 256k tokens and 1M with 8448-query units)."""
    rows = SCORE_BUFFER_ELEMENTS / max(batch * n_pools, 1)
    return max(1, round(rows / unit)) * unit


def _set_descriptor_allocator(device: torch.device) -> None:
    """Give Triton global scratch on ``device`` for device-side tensor descriptors (128 bytes per
    descriptor and program; ``triton.set_allocator`` is process-wide, the last call wins)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def n_columns(n_select: int) -> int:
    """Column groups per score row: ``>= COLUMNS_PER_SELECTED * n_select`` (a tight bound), a power
    of two and a multiple of ``GROUP_N`` (each score program owns ``GROUP_N`` of them)."""
    return max(triton.next_power_of_2(COLUMNS_PER_SELECTED * n_select), GROUP_N)


def candidate_capacity(n_select: int) -> int:
    """Candidate slots per row: ``4 * n_select`` rounded up to a power of two."""
    return triton.next_power_of_2(4 * n_select)


def launch_pool_scores(score_kernel: str, q: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor,
                       scores: torch.Tensor, col_max: torch.Tensor, seg_max: torch.Tensor, q_lo: torch.Tensor,
                       q_hi: torch.Tensor, p_lo: int, columns: int, seg: int) -> None:
    """One query block's scores, column-group maxima and segment maxima with the ``score_kernel``
    (``"triton"``: :func:`pool_scores_kernel`, ``"gluon"``: :func:`kernels.dsa.indexer_gluon.gluon_pool_scores`),
    both autotuned. ``q`` ``[B, n_q, H, D]``, ``pool_keys`` ``[B, P, D]`` (same 16-bit dtype for Gluon),
    ``weights`` ``[B, n_q, H]`` float32 pre-scaled, ``scores`` ``[B, n_q, n_pools]`` float32 (row stride a
    multiple of 4), ``col_max`` ``[B, n_q, columns]``, ``seg_max`` ``[B, n_q, cdiv(n_pools, seg)]``,
    ``q_lo``/``q_hi`` ``[n_q]`` int32 absolute visible pool ranges, ``p_lo`` the block's first pool."""
    batch, n_q, heads, dim = q.shape
    n_pools = scores.shape[-1]
    if score_kernel == "gluon":
        gluon_pool_scores(q, pool_keys, weights, scores, col_max, seg_max, q_lo, q_hi, p_lo, size_class(n_pools),
                          columns, GROUP_N, seg)
        return

    def launch(meta):
        return (columns // GROUP_N, triton.cdiv(n_q, meta["BLOCK_M"]), batch)

    pool_scores_kernel[launch](
        q, pool_keys, weights, scores, col_max, seg_max, q_lo, q_hi,
        q.stride(0), q.stride(1), q.stride(2),
        pool_keys.stride(0), pool_keys.stride(1),
        weights.stride(0), weights.stride(1),
        scores.stride(0), scores.stride(1),
        col_max.stride(0), col_max.stride(1),
        seg_max.stride(0), seg_max.stride(1),
        n_q, n_pools, p_lo, size_class(n_pools), H=heads, D=dim, N_COLUMNS=columns, GROUP_N=GROUP_N, SEG=seg,
    )


def triton_pool_topk(
    q: torch.Tensor,
    pool_keys: torch.Tensor,
    weights: torch.Tensor,
    grid: KPoolGrid,
    n_select: int,
    softmax_scale: float,
    q_offset: int,
    query_block: int | None = None,
    score_kernel: str = "auto",
) -> torch.Tensor:
    """``[B, T, n_select]`` int64 selected pool indices (-1 = none), best first.

    Same contract as :func:`kernels.dsa.indexer.torch_pool_topk`; ``q``/``pool_keys`` are
    used in their dtype (bf16 on the GPU: fp32 accumulation in ``tl.dot``). Per block of
    ``query_block`` queries (default :func:`_query_block`: as many block units, :func:`_block_unit`, as
    the :data:`SCORE_BUFFER_ELEMENTS` budget allows): the score kernel (scores, column and segment
    maxima, only the tiles some query of a tile sees), then :func:`select_kernel` (bound, candidates,
    sort, decode; each row's visible pools only, or only its segments that can hold a candidate where the
    block sees at least :data:`SEGMENT_MIN_POOLS` pools; rows whose candidates overflow their slots,
    massive ties, are redone exactly in the kernel) into the output. The block bounds come from the grid's
    host copy of the document bounds: the call never waits for the device. ``score_kernel``: ``"auto"``,
    ``"triton"`` or ``"gluon"`` (:func:`resolve_score_kernel`); all select the same pools.

    Raises:
        DSAInputError: the index head dim is not a power of two >= 16, or there are 2^31 - 1 pools
            or more (pool indices are int32 in the kernels); an unknown ``score_kernel``; with the Gluon
            score kernel, an odd number of index heads, inputs other than bf16/fp16 or a GPU other than Hopper.
    """
    batch, n_q, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise DSAInputError(f"the Triton indexer needs a power-of-two index head_dim >= 16, got {dim}")
    score_kernel = resolve_score_kernel(score_kernel, q)
    q = q.contiguous()
    pool_keys = pool_keys.to(q.dtype).contiguous()
    weights = (weights.float() * softmax_scale).contiguous()
    if pool_keys.shape[1] >= 2**31 - 1:
        raise DSAInputError(f"the Triton indexer needs fewer than 2^31 - 1 pools, got {pool_keys.shape[1]}")
    # each query's visible pools [lo, hi) as int32 pool indices (the kernels' Q_LO / Q_HI)
    q_lo, q_hi = (r.int().contiguous() for r in grid.visible_ranges(*query_docs(grid, n_q, q_offset, q.device)))
    selected = torch.empty((batch, n_q, n_select), dtype=torch.long, device=q.device)
    if n_q == 0:
        return selected
    # visible pools of each query block: [lo of its first query, hi of its last), on the host
    if query_block is None:
        query_block = _query_block(batch, pool_keys.shape[1], _block_unit(q.device))
    blocks = []
    for t0 in range(0, n_q, query_block):
        t1 = min(t0 + query_block, n_q)
        p_lo, p_hi = grid.visible_range(q_offset + t0)[0], grid.visible_range(q_offset + t1 - 1)[1]
        if p_hi > p_lo:
            blocks.append((t0, t1, p_lo, p_hi))
        if p_hi - p_lo < n_select:   # the selection writes min(n_select, visible pools) entries per row
            selected[:, t0:t1].fill_(-1)
    if not blocks:
        return selected
    columns, capacity = n_columns(n_select), candidate_capacity(n_select)
    _set_descriptor_allocator(q.device)

    def block_seg(n_pools: int) -> int:
        """The segment width of a block that sees ``n_pools`` pools (0: whole rows)."""
        return SEGMENT if n_pools >= SEGMENT_MIN_POOLS else 0

    rows_max = max(t1 - t0 for t0, t1, _, _ in blocks)
    pools_max = max(hi - lo for _, _, lo, hi in blocks)
    # rows padded to 16 pools: a tensor descriptor's row stride must be a multiple of 16 bytes
    score_buf = torch.empty(batch * rows_max * _padded(pools_max), dtype=torch.float32, device=q.device)
    col_max = torch.empty(batch, rows_max, columns, dtype=torch.float32, device=q.device)
    # segment maxima and the selection's list of the segments it reads (the widest block's); maxima rows
    # of an even stride: 8-byte aligned for the selection's pair loads
    segs_max = _even(triton.cdiv(pools_max, block_seg(pools_max)) if block_seg(pools_max) else 1)
    seg_buf = torch.empty(batch * rows_max * segs_max, dtype=torch.float32, device=q.device)
    hits = torch.empty(batch * rows_max * segs_max, dtype=torch.int32, device=q.device)
    # per row: the candidates' score bits and pool indices (int64 each; _put_candidates)
    slots = torch.empty(batch * rows_max, capacity, dtype=torch.int64, device=q.device)
    counts = torch.zeros(batch, n_q, dtype=torch.int32, device=q.device)

    for t0, t1, p_lo, p_hi in blocks:
        n_pools, n_rows = p_hi - p_lo, t1 - t0
        width = block_seg(n_pools)
        row = _padded(n_pools)
        scores = score_buf[: batch * n_rows * row].view(batch, n_rows, row)[:, :, :n_pools]
        n_segs = triton.cdiv(n_pools, width) if width else 1
        seg_stride = _even(n_segs)
        seg_max = seg_buf[: batch * n_rows * seg_stride].view(batch, n_rows, seg_stride)[:, :, :n_segs]
        q_blk, w_blk = q[:, t0:t1], weights[:, t0:t1]

        launch_pool_scores(score_kernel, q_blk, pool_keys, w_blk, scores, col_max, seg_max, q_lo[t0:t1],
                           q_hi[t0:t1], p_lo, columns, width)
        out, cnt = selected[:, t0:t1], counts[:, t0:t1]
        select_kernel[(batch * n_rows,)](
            scores, col_max, seg_max, hits, cnt, slots, out, q_lo[t0:t1], q_hi[t0:t1],
            scores.stride(0), scores.stride(1), col_max.stride(0), col_max.stride(1),
            seg_max.stride(0), seg_max.stride(1), cnt.stride(0), out.stride(0), out.stride(1),
            n_rows, n_pools, p_lo, size_class(n_pools),
            N_SELECT=min(n_select, n_pools), N_COLUMNS=columns, CAPACITY=capacity, SEG=width,
            SEG_CHUNK=SEGMENT_CHUNK, BOUND_SLACK=BOUND_SLACK,
        )
    return selected
