"""Triton lightning-indexer scores over k-pools, with a blockwise top-k (CUDA path).

For a block of ``Tq`` queries one kernel launch writes the fused score
``I[t, p] = sum_h w[t, h] * relu(scale * q[t, h] . pool_key[p])`` of every pool the block
can see into a ``[B, Tq, P_visible]`` float32 buffer (invisible pools -> ``-inf``), without
the ``[Tq, H, P]`` per-head intermediate a torch implementation materializes; ``torch.topk``
then keeps the best ``n_select`` pools. Memory: ``O(T * n_select + Tq * P)``.

Tie rule (lower pool index wins among equal scores): ``torch.topk`` on CUDA does not
promise an order among ties, so the rows where a tie straddles the selection boundary
(more pools score ``>=`` the ``n_select``-th value than there are slots) are re-selected
with the composite int64 keys of the torch path. Such rows are rare (exactly equal float
scores) except when every visible pool scores 0 or fewer than ``n_select`` are visible.

FLOPs per launch ``2 * B * Tq * P_visible * H * D`` (+ the ReLU-weighted head sum);
bytes ``~ B * (Tq * H * D * 2 * ceil(P / BLOCK_N) (L2-served) + Tq * P * 4)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dsa.indexer import KPoolGrid, _query_docs, _selection_keys, decode_selection_keys


@triton.jit
def _pool_scores_kernel(
    Q, PK, W, OUT, POOL_END, POOL_DOC, Q_POS, Q_DOC,
    stride_qb, stride_qt, stride_qh,
    stride_pb, stride_pp,
    stride_wb, stride_wt,
    stride_ob, stride_ot,
    n_q, n_pools, p_lo, scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
        s = tl.dot(q, pk_t)
        acc += tl.maximum(s * scale, 0.0) * w[:, None]
    visible = (pool_doc[None, :] == q_doc[:, None]) & (pool_end[None, :] <= q_pos[:, None])
    acc = tl.where(visible, acc + 0.0, float("-inf"))
    tl.store(out_ptr, acc, mask=out_mask)


def _select_with_tie_rule(scores: torch.Tensor, n_select: int, p_lo: int) -> torch.Tensor:
    """Best ``n_select`` pools of ``scores`` ``[B, t, P]`` (pool ``p_lo + j`` in column ``j``).

    ``torch.topk``, then the rows whose boundary value is tied beyond the slots are
    re-selected with composite keys, and every row is ordered by (score desc, index asc).
    """
    values, chosen = scores.topk(n_select, dim=-1)
    boundary = values[..., -1:]
    ambiguous = ((scores >= boundary).sum(-1) > n_select) & torch.isfinite(boundary[..., 0])
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        row_scores = scores[rows]
        pool_index = torch.arange(scores.shape[-1], device=scores.device)
        keys = _selection_keys(row_scores, pool_index, torch.isfinite(row_scores))
        chosen[rows] = decode_selection_keys(keys.topk(n_select, dim=-1).values)[0]
        values = torch.gather(scores, -1, chosen)
    keys = _selection_keys(values, chosen + p_lo, torch.isfinite(values))
    pools, valid = decode_selection_keys(keys.sort(dim=-1, descending=True).values)
    return torch.where(valid, pools, -1)


def triton_pool_topk(
    q: torch.Tensor,
    pool_keys: torch.Tensor,
    weights: torch.Tensor,
    grid: KPoolGrid,
    n_select: int,
    softmax_scale: float,
    q_offset: int,
    query_block: int = 4096,
    block_m: int = 64,
    block_n: int = 128,
) -> torch.Tensor:
    """``[B, T, n_select]`` int64 selected pool indices (-1 = none), best first.

    Same contract as :func:`kernels.dsa.indexer._torch_pool_topk`; ``q``/``pool_keys`` are
    used in their dtype (bf16 on the GPU: fp32 accumulation in ``tl.dot``).
    """
    batch, n_q, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the Triton indexer needs a power-of-two head_dim >= 16, got {dim}")
    q = q.contiguous()
    pool_keys = pool_keys.to(q.dtype).contiguous()
    weights = weights.float().contiguous()
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
        launch = (triton.cdiv(n_pools, block_n), triton.cdiv(t1 - t0, block_m), batch)
        q_blk = q[:, t0:t1]
        w_blk = weights[:, t0:t1]
        _pool_scores_kernel[launch](
            q_blk, pool_keys, w_blk, scores, pool_end, pool_doc, q_pos[t0:t1], q_doc[t0:t1],
            q_blk.stride(0), q_blk.stride(1), q_blk.stride(2),
            pool_keys.stride(0), pool_keys.stride(1),
            w_blk.stride(0), w_blk.stride(1),
            scores.stride(0), scores.stride(1),
            t1 - t0, n_pools, p_lo, softmax_scale,
            H=heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=2,
        )
        k = min(n_select, n_pools)
        selected[:, t0:t1, :k] = _select_with_tie_rule(scores, k, p_lo)
    return selected
