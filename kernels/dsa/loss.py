"""DSA indexer training loss: KL(main attention || indexer) on the selected k-pools.

DeepSeek-V3.2 (arXiv 2512.02556, Sec. 2.1, "sparse training stage") trains the
lightning indexer, whose input is detached from the main model, with
``L_I = sum_t KL(p_{t, S_t} || softmax(I_{t, S_t}))``: ``p_t`` is the main attention
distribution of query ``t`` summed over heads and L1-normalized, restricted to the
selected set ``S_t``. glm5_next's indexer scores k-pools, so here both distributions
live on the selected pools (definition in :func:`indexer_kl_loss`). The reduction (mean
over query rows with a selected pool, ``1e-10`` clamp in the log) follows megatron-core's
``dsa_indexer_loss``. The dense definition is :func:`kernels.dsa.naive.naive_indexer_kl_loss`.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from kernels.dsa.errors import DSAInputError
from kernels.dsa.grid import kpool_grid
from kernels.dsa.indexer import compress_on_grid

__all__ = ["indexer_kl_loss"]

_EPS = 1e-10


@torch.no_grad()
def _pool_target(q_blk, kv, lse_blk, pool_indices, pool_ok, kpool, softmax_scale):
    """``[B, t, Kp]`` main-attention mass per selected pool, summed over heads, L1-normalized.

    ``pool_indices`` ``[B, t, Kp * kpool]`` are the pool part of the indexer's output.
    """
    if kv.is_cuda:
        from kernels.dsa.sparse_attention_triton import triton_sparse_mla_mass

        probs = triton_sparse_mla_mass(q_blk, kv, pool_indices, lse_blk, softmax_scale)
    else:
        batch = kv.shape[0]
        tokens = pool_indices.long().clamp_min(0)
        kv_sel = kv[torch.arange(batch, device=kv.device)[:, None, None], tokens].float()
        scores = torch.einsum("bthd,btkd->bthk", q_blk.float(), kv_sel) * softmax_scale
        lse_safe = lse_blk.float().masked_fill(torch.isinf(lse_blk), 0.0)
        probs = torch.exp(scores - lse_safe[..., None]).sum(dim=2)  # [B, t, Kp * kpool]
    return _normalized(probs.view(*pool_ok.shape, kpool).sum(-1).masked_fill(~pool_ok, 0.0))


def _normalized(mass: torch.Tensor) -> torch.Tensor:
    """``mass [..., J]`` L1-normalized over its last dimension (rows without mass stay 0)."""
    return mass / mass.sum(-1, keepdim=True).clamp_min(_EPS)


def _block_kl(q_index_blk, weights_blk, pool_keys, pool_row, pool_ok, target, index_softmax_scale):
    """``[B, t]`` KL per query row (differentiable in the indexer inputs)."""
    batch, pools, dim = pool_keys.shape
    # Gathered with index_select, whose backward is index_add_ (atomic float32 adds), not advanced
    # indexing, whose backward sorts the indices and sums each run of equal ones in one warp: the
    # first query block of a sequence selects its few visible pools thousands of times each, and
    # that backward took ~100 ms per such block on an H200 at 64k (docs/measurements.md, issue 35).
    rows = (pool_row + pools * torch.arange(batch, device=pool_row.device)[:, None, None]).flatten()
    keys_sel = pool_keys.flatten(0, 1).index_select(0, rows).view(*pool_row.shape, dim).float()
    scores = torch.einsum("bthd,btjd->bthj", q_index_blk.float(), keys_sel) * index_softmax_scale
    logits = torch.einsum("bthj,bth->btj", torch.relu(scores), weights_blk.float())
    log_pred = logits.masked_fill(~pool_ok, float("-inf")).log_softmax(-1)
    terms = target * (target.clamp_min(_EPS).log() - log_pred.masked_fill(~pool_ok, 0.0))
    return terms.sum(-1)


def indexer_kl_loss(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    gate_scores: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    indices: torch.Tensor,
    *,
    kpool: int,
    topk: int,
    index_softmax_scale: float,
    softmax_scale: float,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int | None = None,
    torch_path: bool = False,
    pool_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL divergence of the indexer's pool distribution from the main attention's.

    For query ``t`` with selected pools ``j = 0 .. topk/kpool - 1`` (the pool part of
    ``indices``; ``-1`` pools skipped):

    * target ``p[t, j] = sum_h sum_{s in pool j} exp(softmax_scale * q[t, h] . kv[s] - lse[t, h])``,
      the main sparse attention mass (over the selected pools and tail, as attended),
      L1-normalized over the selected pools; no gradient flows into it;
    * prediction ``log_softmax_j(I[t, pool j])`` with the lightning-indexer score
      ``I = sum_h weights[t, h] * relu(index_softmax_scale * q_index[t, h] . pool_key)``;
    * ``loss = mean_t sum_j p[t, j] * (log max(p[t, j], 1e-10) - log_pred[t, j])`` over the
      queries with at least one selected pool.

    Gradients flow into ``q_index``, ``k_index``, ``gate_scores``, ``ape``, ``weights``
    only. DeepSeek-V3.2 detaches the indexer's input from the main model: the caller
    passes indexer projections of a detached hidden state (and detached ``q_resid``).
    Memory: per block of ``block_size`` queries, ``O(block * topk * (H + Dqk))``; the
    block's indexer scores are recomputed in the backward (activation checkpointing). On CUDA the
    indexer side is one fused Triton kernel per direction (:mod:`kernels.dsa.loss_triton`), the
    torch path :func:`_block_kl` elsewhere.

    Args:
        q_index: ``[B, T, H_I, D_I]``; k_index, gate_scores: ``[B, S, D_I]``; ape: ``[kpool, D_I]``;
        weights: ``[B, T, H_I]`` (already scaled by ``H_I ** -0.5``) — as in
            :func:`kernels.dsa.lightning_indexer_topk`.
        q: main absorbed queries ``[B, T, H, Dqk]``; kv: latent ``[B, S, Dqk]``; lse: ``[B, T, H]``
            from :func:`kernels.dsa.sparse_mla_attention` on the same ``indices``.
        indices: ``[B, T, W]`` from :func:`kernels.dsa.lightning_indexer_topk`.
        kpool, topk: as given to the indexer. index_softmax_scale: the indexer's score
            scale. softmax_scale: the main attention's.
        cu_seqlens: the document bounds given to the indexer (``B == 1``).
        block_size: queries per block (default 4096 on CUDA, where the target comes from
            the Triton kernel ``triton_sparse_mla_mass``, 256 elsewhere).
        torch_path: run the indexer side through the torch path on CUDA too (the reference the
            fused kernel is checked and benchmarked against).
        pool_mass: ``[B, T, topk // kpool]`` float32, the target's mass per pool before its
            normalization, as :func:`kernels.dsa.sparse_mla_attention` returns it with
            ``pool_mass=(kpool, topk // kpool)`` from the same forward: the target is not recomputed from
            ``q``, ``kv`` and ``lse`` (one pass over the selected latent fewer).

    Returns:
        Scalar float32 loss (multiply by the loss coefficient outside).

    Raises:
        DSAInputError: on inconsistent shapes.
    """
    if pool_mass is not None and pool_mass.shape != (*q_index.shape[:2], topk // kpool):
        raise DSAInputError(f"pool_mass {tuple(pool_mass.shape)} must be [B, T, topk // kpool] = "
                            f"{[*q_index.shape[:2], topk // kpool]}")
    batch, n_q = q_index.shape[:2]
    if indices.shape[:2] != (batch, n_q) or indices.shape[2] < topk or topk % kpool != 0:
        raise DSAInputError(
            f"indices {tuple(indices.shape)} must be [B, T, >= topk] with topk ({topk}) a multiple of kpool ({kpool})"
        )
    if q.shape[:2] != (batch, n_q) or lse.shape != q.shape[:3] or kv.shape[:2] != k_index.shape[:2]:
        raise DSAInputError(
            f"q {tuple(q.shape)}, lse {tuple(lse.shape)}, kv {tuple(kv.shape)} do not match "
            f"q_index {tuple(q_index.shape)} / k_index {tuple(k_index.shape)}"
        )
    grid = kpool_grid(k_index.shape[1], kpool, cu_seqlens, k_index.device)
    pool_keys = compress_on_grid(k_index, gate_scores, ape, grid)
    starts = indices[..., :topk:kpool].long()
    pool_ok = starts >= 0
    pool_row = grid.pool_of_start(starts.clamp_min(0))
    q, kv, lse = q.detach(), kv.detach(), lse.detach()
    if block_size is None:
        block_size = 4096 if kv.is_cuda else 256
    total = q_index.new_zeros((), dtype=torch.float32)
    # The indexer's inputs are split into blocks, not sliced: a split's backward is one concatenation of the
    # blocks' gradients, where each slice's writes a zero-filled full-length gradient that autograd then adds up
    # (16 of them per 64k-token layer: 3-4 ms per layer on an H100)
    blocks = zip(range(0, n_q, block_size), q_index.split(block_size, dim=1), weights.split(block_size, dim=1))
    for t0, q_blk, w_blk in blocks:
        t1 = min(t0 + block_size, n_q)
        ok = pool_ok[:, t0:t1]
        if pool_mass is None:
            target = _pool_target(q[:, t0:t1], kv, lse[:, t0:t1], indices[:, t0:t1, :topk], ok, kpool, softmax_scale)
        else:
            target = _normalized(pool_mass[:, t0:t1].float().masked_fill(~ok, 0.0))
        args = (q_blk, w_blk, pool_keys, pool_row[:, t0:t1], ok, target, index_softmax_scale)
        if kv.is_cuda and not torch_path:
            from kernels.dsa.loss_triton import triton_indexer_kl

            row_kl = triton_indexer_kl(*args)
        else:
            row_kl = checkpoint(_block_kl, *args, use_reentrant=False)
        total = total + row_kl.sum()
    return total / pool_ok.any(-1).sum().clamp_min(1)
