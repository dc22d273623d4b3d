"""Triton indexer KL loss: the indexer side of :func:`kernels.dsa.indexer_kl_loss`, fused, forward and backward.

One program per query row ``t`` gathers the row's ``J`` selected pool keys ``[J, D]`` (float32, the
k-pool compression's output), computes the lightning-indexer logits over them
``I[j] = sum_h w[h] * relu(scale * q[h] . K[j])``, their log-softmax over the row's selected pools,
and ``KL(target || softmax(I))``: the torch path (:func:`kernels.dsa.loss._block_kl`) does the same in
about ten kernels per query block, with the ``[t, J, D]`` gathered keys, the ``[t, H, J]`` scores and
their float32 copies in memory and an ``index_add_`` backward, all recomputed once more under its
activation checkpoint.

The backward recomputes the row (nothing but the loss is saved) and, with ``G[j] = dL/dI[j] =
g * (softmax[j] * sum(target) - target[j])`` (``g`` the row's incoming gradient), writes
``dw[h] = sum_j G[j] relu(S[h, j])``, ``dq[h] = scale * sum_j dS[h, j] K[j]`` and adds
``dK[j] = scale * sum_h dS[h, j] q[h]`` to the pool keys' gradient with float32 atomics, where
``dS = w[h] * G[j] * [S[h, j] > 0]``. Products are float32 as three tf32 tensor-core products
(:data:`DOT_PRECISION`; the torch path's are IEEE float32): per row ``3 * 2 * H * J * D`` FLOPs (small shape
0.8 MFLOP) and the row's keys, ``J * D * 4`` bytes (32 KiB at the small shape), read once forward and twice
backward, and ``J * D`` float32 atomics. With IEEE float32 products, measured on one H200 (small shape,
4096-row calls): 0.18 ms forward, 0.34 ms backward.

Rows without a selected pool give loss 0 and zero gradients (the torch path's masked log-softmax does
the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_indexer_kl"]

_EPS = 1e-10   # the log clamp of the target, as kernels.dsa.loss (megatron-core's dsa_indexer_loss)
DOT_PRECISION = tl.constexpr("tf32x3")
"""The three products' precision: each float32 operand split into two tf32 parts and three tensor-core products
summed (the low parts' product dropped), about float32's accuracy. As IEEE float32 FMAs the products ran at
~6 TF/s: 0.18 ms per 4,096-row forward call at the small shape on an H100 and 0.34 ms backward, now 0.046 and
0.179 ms (``docs/measurements.md``); against the torch path's IEEE products the loss and the gradients stay within
6.7e-7 relative (the queries' bf16 gradient 3.7e-5), ``tests/gpu/dsa_check.py --kl-only``."""

KL_CONFIGS = [triton.Config({"BLOCK_D": d}, num_warps=w) for d, w in [(16, 4), (32, 4), (16, 8), (32, 8)]]
"""Autotuned key-column steps and warps. sm_90 compiles (Triton 3.6, :mod:`kernels.dsa.sm90`, small shape: 16
heads, 128 pools, 64 columns), forward / backward registers: ``(16, 4)`` 94 / 254 (16 bytes spilled), ``(32, 4)``
174 / 255 (40 spilled), ``(16, 8)`` and ``(32, 8)`` no spill in either (backward 220 and 224); the IEEE kernel
at ``(32, 4)`` took 128 / 255 (136 spilled)."""


@triton.autotune(configs=KL_CONFIGS, key=["n_heads", "n_sel", "dim", "BACKWARD"], reset_to_zero=["DKEYS"])
@triton.jit
def indexer_kl_kernel(
    QI, W, KEYS, ROWS, TGT, LOSS, GROW, DQI, DW, DKEYS,
    stride_qb, stride_qt, stride_qh,
    stride_wb, stride_wt,
    stride_kb, stride_kp,
    stride_rb, stride_rt,
    stride_tb, stride_tt,
    n_q, n_heads, n_sel, n_pools, dim, scale, eps,
    BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):
    """One query row. ``ROWS [B, t, J]`` int32 pool rows of ``KEYS [B, P, D]`` (-1: not selected);
    forward: ``LOSS [B * t]`` float32; backward: ``GROW [B * t]`` in, ``DQI [B, t, H, D]``,
    ``DW [B, t, H]`` (contiguous) out, ``DKEYS [B, P, D]`` float32 contiguous added to. The key width
    is walked ``BLOCK_D`` columns at a time (keys and queries re-read from L1/L2 in the backward), so
    that only the ``[H, J]`` scores stay in registers at the full shape's ``128 x 128`` float32 keys."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < n_heads
    rows = tl.load(ROWS + b * stride_rb + t * stride_rt + offs_j, mask=offs_j < n_sel, other=-1).to(tl.int64)
    ok = rows >= 0
    key_ptr = KEYS + b * stride_kb + rows[:, None] * stride_kp
    q_ptr = QI + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    s = tl.zeros([BLOCK_H, BLOCK_J], tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + offs_d
        keys = tl.load(key_ptr + cols[None, :], mask=ok[:, None] & (cols[None, :] < dim), other=0.0).to(tl.float32)
        q = tl.load(q_ptr + cols[None, :], mask=mask_h[:, None] & (cols[None, :] < dim), other=0.0).to(tl.float32)
        s += tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)
    s = s * scale                                                             # [H, J]
    w = tl.load(W + b * stride_wb + t * stride_wt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    r = tl.maximum(s, 0.0)
    logits = tl.sum(w[:, None] * r, axis=0)                                  # [J]
    m = tl.max(tl.where(ok, logits, float("-inf")), axis=0)
    any_ok = m > float("-inf")
    m = tl.where(any_ok, m, 0.0)
    e = tl.where(ok, tl.exp(logits - m), 0.0)
    total = tl.sum(e, axis=0)
    lse = m + tl.log(tl.where(any_ok, total, 1.0))
    tgt = tl.load(TGT + b * stride_tb + t * stride_tt + offs_j, mask=offs_j < n_sel, other=0.0)
    tgt = tl.where(ok, tgt, 0.0)
    row = b * n_q + t
    if BACKWARD:
        g = tl.load(GROW + row)
        soft = e / tl.where(any_ok, total, 1.0)
        grad_logits = tl.where(ok, g * (soft * tl.sum(tgt, axis=0) - tgt), 0.0)   # [J]
        dw = tl.sum(grad_logits[None, :] * r, axis=1)                             # [H]
        tl.store(DW + row * n_heads + offs_h, dw.to(DW.dtype.element_ty), mask=mask_h)
        ds = tl.where(s > 0.0, w[:, None] * grad_logits[None, :], 0.0) * scale    # [H, J]
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + offs_d
            keys = tl.load(key_ptr + cols[None, :], mask=ok[:, None] & (cols[None, :] < dim), other=0.0).to(tl.float32)
            q = tl.load(q_ptr + cols[None, :], mask=mask_h[:, None] & (cols[None, :] < dim), other=0.0).to(tl.float32)
            dq = tl.dot(ds, keys, input_precision=DOT_PRECISION)                  # [H, BLOCK_D]
            dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)           # [J, BLOCK_D]
            tl.store(DQI + (row * n_heads + offs_h[:, None]) * dim + cols[None, :], dq.to(DQI.dtype.element_ty),
                     mask=mask_h[:, None] & (cols[None, :] < dim))
            tl.atomic_add(DKEYS + (b * n_pools + rows[:, None]) * dim + cols[None, :], dk,
                          mask=ok[:, None] & (cols[None, :] < dim), sem="relaxed")
    else:
        terms = tl.where(ok, tgt * (tl.log(tl.maximum(tgt, eps)) - (logits - lse)), 0.0)
        tl.store(LOSS + row, tl.sum(terms, axis=0))


def _launch(q_index, weights, pool_keys, rows, target, scale, grad_row=None):
    batch, n_q, heads, dim = q_index.shape
    n_sel = rows.shape[2]
    block_h, block_j = (max(16, triton.next_power_of_2(n)) for n in (heads, n_sel))
    dev = q_index.device
    backward = grad_row is not None
    loss = torch.empty(batch, n_q, dtype=torch.float32, device=dev)
    if not backward:
        grad_row = dq = dw = dkeys = loss   # placeholders the forward does not touch
    else:
        grad_row = grad_row.float().contiguous()
        dq = torch.empty(batch, n_q, heads, dim, dtype=q_index.dtype, device=dev)
        dw = torch.empty(batch, n_q, heads, dtype=weights.dtype, device=dev)
        dkeys = torch.zeros(pool_keys.shape, dtype=torch.float32, device=dev)
    indexer_kl_kernel[(n_q, batch)](
        q_index, weights, pool_keys, rows, target, loss, grad_row, dq, dw, dkeys,
        q_index.stride(0), q_index.stride(1), q_index.stride(2),
        weights.stride(0), weights.stride(1),
        pool_keys.stride(0), pool_keys.stride(1),
        rows.stride(0), rows.stride(1),
        target.stride(0), target.stride(1),
        n_q, heads, n_sel, pool_keys.shape[1], dim, scale, _EPS,
        BLOCK_H=block_h, BLOCK_J=block_j, BACKWARD=backward,
    )
    return (dq, dw, dkeys) if backward else loss


class _IndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_index, weights, pool_keys, rows, target, scale):
        ctx.save_for_backward(q_index, weights, pool_keys, rows, target)
        ctx.scale = scale
        return _launch(q_index, weights, pool_keys, rows, target, scale)

    @staticmethod
    def backward(ctx, grad_row):
        q_index, weights, pool_keys, rows, target = ctx.saved_tensors
        dq, dw, dkeys = _launch(q_index, weights, pool_keys, rows, target, ctx.scale, grad_row)
        return dq, dw, dkeys.to(pool_keys.dtype), None, None, None


def triton_indexer_kl(q_index: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, pool_row: torch.Tensor,
                      pool_ok: torch.Tensor, target: torch.Tensor, index_softmax_scale: float) -> torch.Tensor:
    """``[B, t]`` float32 KL of each query row, differentiable in ``q_index``, ``weights`` and ``pool_keys``.

    The same value and gradients as :func:`kernels.dsa.loss._block_kl` (to float32 rounding).

    Args:
        q_index: indexer queries ``[B, t, H_I, D_I]`` (last dim contiguous).
        weights: per-head weights ``[B, t, H_I]`` (last dim contiguous).
        pool_keys: compressed pool keys ``[B, P, D_I]`` (last dim contiguous).
        pool_row: ``[B, t, J]`` int, each selected pool's row of ``pool_keys``.
        pool_ok: ``[B, t, J]`` bool, the pool is selected (``False``: the slot is ``-1``).
        target: ``[B, t, J]`` float32 main-attention mass per pool, L1-normalized, 0 where not ``pool_ok``.
        index_softmax_scale: the indexer's score scale.
    """
    q_index, weights, pool_keys = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_index, weights, pool_keys))
    rows = pool_row.masked_fill(~pool_ok, -1).to(torch.int32).contiguous()
    return _IndexerKL.apply(q_index, weights, pool_keys, rows, target.float().contiguous(), index_softmax_scale)
