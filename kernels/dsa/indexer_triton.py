"""Triton lightning-indexer scores over k-pools, with a streaming top-k (CUDA path).

For a block of ``Tq`` queries one kernel launch writes the fused score
``I[t, p] = sum_h w[t, h] * relu(scale * q[t, h] . pool_key[p])`` of every pool the block
can see into a ``[B, Tq, P_visible]`` float32 buffer (invisible pools -> ``-inf``), without
the ``[Tq, H, P]`` per-head intermediate a torch implementation materializes. A second
kernel reads each score row twice: once for a lower bound of its ``n_select``-th value
(the n_select-th largest of ``4 * n_select`` column maxima), once to keep the entries above
it as composite int64 keys (score bits, then the complement of the pool index, as the torch
path; slots taken by atomic increments) and sorts those few keys in registers: exact, and it
applies the tie rule (equal scores: lower pool index wins). Memory: ``O(T * n_select + Tq * P)``.

Per launch, scores: FLOPs ``2 * B * Tq * P_visible * H * D``; bytes ``4 * Tq * P_visible``
written (and read twice by the selection) plus the queries, re-read from L2 once per
``BLOCK_N`` pools.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dsa.errors import DSAInputError
from kernels.dsa.indexer import KPoolGrid, _query_docs, _selection_keys, decode_selection_keys


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in [(64, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 256, 8, 2)]
    ],
    key=["H", "D", "size_class"],
)
@triton.jit
def _pool_scores_kernel(
    Q, PK, W, OUT, POOL_END, POOL_DOC, Q_POS, Q_DOC,
    stride_qb, stride_qt, stride_qh,
    stride_pb, stride_pp,
    stride_wb, stride_wt,
    stride_ob, stride_ot,
    n_q, n_pools, p_lo, size_class,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    # int64: at 1M tokens x 32 heads x 128 the query offsets pass 2^31
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < n_q
    mask_n = offs_n < n_pools
    q_pos = tl.load(Q_POS + offs_m, mask=mask_m, other=-1)
    q_doc = tl.load(Q_DOC + offs_m, mask=mask_m, other=-1)
    pool_end = tl.load(POOL_END + p_lo + offs_n, mask=mask_n, other=2**62)
    pool_doc = tl.load(POOL_DOC + p_lo + offs_n, mask=mask_n, other=-2)
    out_ptr = OUT + b * stride_ob + offs_m[:, None] * stride_ot + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    pk = tl.load(
        PK + b * stride_pb + (p_lo + offs_n)[:, None] * stride_pp + offs_d[None, :], mask=mask_n[:, None], other=0.0
    )
    pk_t = tl.trans(pk)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    q_base = Q + b * stride_qb + offs_m[:, None] * stride_qt + offs_d[None, :]
    w_base = W + b * stride_wb + offs_m * stride_wt
    for h in range(H):
        q = tl.load(q_base + h * stride_qh, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_base + h, mask=mask_m, other=0.0).to(tl.float32)
        # relu(scale * s) * w == relu(s) * (scale * w) for scale > 0: W arrives pre-scaled
        acc += tl.maximum(tl.dot(q, pk_t), 0.0) * w[:, None]
    visible = (pool_doc[None, :] == q_doc[:, None]) & (pool_end[None, :] <= q_pos[:, None])
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(out_ptr, acc, mask=out_mask)


@triton.autotune(
    configs=[triton.Config({"CHUNK_ROWS": r}, num_warps=w) for r in (4, 8, 16) for w in (4, 8)],
    key=["N_COLUMNS", "CAPACITY", "size_class"],
)
@triton.jit
def _candidate_keys_kernel(
    S, COUNT, OUT, stride_s, stride_o, n_cols, p_lo, size_class,
    N_SELECT: tl.constexpr, N_COLUMNS: tl.constexpr, CHUNK_ROWS: tl.constexpr, CAPACITY: tl.constexpr,
):
    """Per score row: a lower bound on its n_select-th value, then the composite keys above it.

    The row is viewed as ``[*, N_COLUMNS]`` (``N_COLUMNS >= 4 * n_select``). The n_select-th
    largest of the column maxima is met by n_select entries of distinct columns, so it bounds
    the row's n_select-th largest value from below; with 4x more columns than selected pools it
    is close to it (about ``n_select * (1 + n_select / (2 N_COLUMNS))`` entries pass for random
    scores, against ``n_select * ln(N_COLUMNS)`` for the minimum of n_select column maxima).
    Passing entries take a slot with an atomic increment of the row's counter (no scan over the
    row) and are written as composite int64 keys to a ``CAPACITY``-slot buffer in registers'
    reach; the sort in registers makes the order exact and deterministic (tie rule: lower pool
    index first). ``COUNT`` gets the number that passed (rows above CAPACITY are redone by
    the caller).
    """
    row = tl.program_id(0).to(tl.int64)
    base = S + row * stride_s
    chunk: tl.constexpr = CHUNK_ROWS * N_COLUMNS
    col_max = tl.full([N_COLUMNS], float("-inf"), tl.float32)
    grid_offs = tl.arange(0, CHUNK_ROWS)[:, None] * N_COLUMNS + tl.arange(0, N_COLUMNS)[None, :]
    for c0 in range(0, n_cols, chunk):
        offs = c0 + grid_offs
        vals = tl.load(base + offs, mask=offs < n_cols, other=float("-inf"))
        col_max = tl.maximum(col_max, tl.max(vals, axis=0))
    ranked = tl.sort(col_max, descending=True)
    bound = tl.max(tl.where(tl.arange(0, N_COLUMNS) == N_SELECT - 1, ranked, float("-inf")), axis=0)
    slots = OUT + row * stride_o
    counter = COUNT + row + tl.zeros([chunk], tl.int32)
    flat = tl.arange(0, chunk)
    for c0 in range(0, n_cols, chunk):
        offs = c0 + flat
        vals = tl.load(base + offs, mask=offs < n_cols, other=float("-inf"))
        keep = (vals >= bound) & (vals > float("-inf"))
        pos = tl.atomic_add(counter, 1, mask=keep)
        vals = tl.where(vals == 0.0, 0.0, vals)  # -0.0 -> +0.0: equal scores get equal keys
        bits = vals.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        key = (ordered << 32) | (4294967295 - (p_lo + offs).to(tl.int64))
        tl.store(slots + pos, key, mask=keep & (pos < CAPACITY))
    # other threads' slot writes and counter increments must be visible to this one's loads
    tl.debug_barrier()
    count = tl.load(COUNT + row)
    idx = tl.arange(0, CAPACITY)
    # empty slots get INVALID_KEY (int64 min), which sorts last
    cand = tl.load(slots + idx, mask=idx < count, other=-9223372036854775808)
    cand = tl.sort(cand, descending=True)
    tl.store(slots + idx, cand, mask=idx < N_SELECT)


def _size_class(n_pools: int) -> int:
    """Autotuning bucket: the first query blocks see few pools, later ones up to ``T / kpool``."""
    return min(3, n_pools.bit_length() // 4)


def _select_with_tie_rule(scores: torch.Tensor, n_select: int, p_lo: int, capacity: int | None = None) -> torch.Tensor:
    """Best ``n_select`` pools of ``scores`` ``[B, t, P]`` (pool ``p_lo + j`` in column ``j``),
    ordered by (score desc, index asc); -1 where fewer are visible.

    A Triton pass keeps the candidates above a per-row lower bound of the n_select-th value
    as composite keys and sorts them (:func:`_candidate_keys_kernel`); sorting distinct
    composite keys is exact and applies the tie rule. Rows with more than ``capacity``
    (default ``4 * n_select`` rounded up to a power of two) candidates, i.e. massive ties,
    are re-selected from their full score row.
    """
    batch, n_rows, n_cols = scores.shape
    flat = scores.view(batch * n_rows, n_cols)
    columns = triton.next_power_of_2(4 * n_select)
    capacity = capacity or columns
    counts = torch.zeros(batch * n_rows, dtype=torch.int32, device=scores.device)
    # CAPACITY slots per row: candidates in, the best N_SELECT sorted keys out
    slots = torch.empty((batch * n_rows, max(capacity, n_select)), dtype=torch.long, device=scores.device)
    _candidate_keys_kernel[(batch * n_rows,)](
        flat, counts, slots, flat.stride(0), slots.stride(0), n_cols, p_lo, _size_class(n_cols),
        N_SELECT=n_select, N_COLUMNS=columns, CAPACITY=capacity,
    )
    keys = slots[:, :n_select]
    overflow = counts > capacity
    if bool(overflow.any()):
        rows = overflow.nonzero().flatten()
        row_scores = flat[rows]
        pool_index = torch.arange(p_lo, p_lo + n_cols, device=scores.device)
        keys[rows] = _selection_keys(row_scores, pool_index, torch.isfinite(row_scores)).topk(n_select, dim=-1).values
    pools, valid = decode_selection_keys(keys)
    return torch.where(valid, pools, -1).view(batch, n_rows, n_select)


def triton_pool_topk(
    q: torch.Tensor,
    pool_keys: torch.Tensor,
    weights: torch.Tensor,
    grid: KPoolGrid,
    n_select: int,
    softmax_scale: float,
    q_offset: int,
    query_block: int = 8192,
) -> torch.Tensor:
    """``[B, T, n_select]`` int64 selected pool indices (-1 = none), best first.

    Same contract as :func:`kernels.dsa.indexer._torch_pool_topk`; ``q``/``pool_keys`` are
    used in their dtype (bf16 on the GPU: fp32 accumulation in ``tl.dot``).
    """
    batch, n_q, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise DSAInputError(f"the Triton indexer needs a power-of-two index head_dim >= 16, got {dim}")
    q = q.contiguous()
    pool_keys = pool_keys.to(q.dtype).contiguous()
    weights = (weights.float() * softmax_scale).contiguous()
    q_pos, q_doc = _query_docs(grid, n_q, q_offset, q.device)
    pool_end = grid.end.masked_fill(~grid.complete, 2**62).contiguous()
    pool_doc = grid.doc.contiguous()
    selected = torch.full((batch, n_q, n_select), -1, dtype=torch.long, device=q.device)
    for t0 in range(0, n_q, query_block):
        t1 = min(t0 + query_block, n_q)
        p_lo = int(grid.doc_first_pool[q_doc[t0]])
        p_hi = int(torch.searchsorted(grid.end, q_pos[t1 - 1], right=True))
        if p_hi <= p_lo:
            continue
        n_pools = p_hi - p_lo
        scores = torch.empty(batch, t1 - t0, n_pools, dtype=torch.float32, device=q.device)
        n_rows = t1 - t0

        def launch(meta, n_pools=n_pools, n_rows=n_rows):
            return (triton.cdiv(n_pools, meta["BLOCK_N"]), triton.cdiv(n_rows, meta["BLOCK_M"]), batch)

        q_blk = q[:, t0:t1]
        w_blk = weights[:, t0:t1]
        _pool_scores_kernel[launch](
            q_blk, pool_keys, w_blk, scores, pool_end, pool_doc, q_pos[t0:t1], q_doc[t0:t1],
            q_blk.stride(0), q_blk.stride(1), q_blk.stride(2),
            pool_keys.stride(0), pool_keys.stride(1),
            w_blk.stride(0), w_blk.stride(1),
            scores.stride(0), scores.stride(1),
            t1 - t0, n_pools, p_lo, _size_class(n_pools), H=heads, D=dim,
        )
        k = min(n_select, n_pools)
        selected[:, t0:t1, :k] = _select_with_tie_rule(scores, k, p_lo)
    return selected
