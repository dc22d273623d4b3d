"""Triton sparse MLA attention (absorbed / MQA form): forward with log-sum-exp, backward.

One program handles one query and a block of ``BLOCK_H`` heads (autotuned per head count
and widths, together with ``BLOCK_K``, warps and stages): it gathers the selected
latent rows ``kv[idx]`` ``BLOCK_K`` at a time (shared by all heads of the block, as in
FlashMLA's sparse kernels), runs an online softmax in base 2 and accumulates
``P @ kv[:, :d_v]`` in float32. The backward recomputes ``P`` from the saved ``lse``,
accumulates ``dq`` in registers and scatter-adds ``dkv`` with float32 atomics.

Per query (all heads), forward: FLOPs ``2 * H * K * (Dqk + d_v)``, gathered bytes
``ceil(H / BLOCK_H) * K * (Dqk + d_v) * 2`` (L2 absorbs the repeats across head blocks).
Backward: FLOPs ``2 * H * K * (2 * Dqk + 2 * d_v)`` (+ the recomputed ``QK``), atomics
``ceil(H / BLOCK_H) * K * Dqk`` float32 adds when ``d_v == Dqk`` (the value's gradient is
folded into the key's row), ``* (Dqk + d_v)`` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634

__all__ = ["triton_sparse_mla_fwd", "triton_sparse_mla_bwd", "triton_sparse_mla_mass"]


def _attention_configs():
    """Head-block x key-block tilings; BLOCK_H 64 lets wgmma use full 64-row tiles for 64 heads."""
    return [
        triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bh, bk, w, st in [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 32, 8, 1)]
    ]


def _prune_head_blocks(configs, named_args, **kwargs):
    """Drop head blocks larger than the (power-of-two rounded, >= 16) head count."""
    limit = max(16, triton.next_power_of_2(named_args["n_heads"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= limit]


_TUNE = dict(key=["n_heads", "DQK", "DV"], prune_configs_by={"early_config_prune": _prune_head_blocks})


@triton.autotune(configs=_attention_configs(), **_TUNE)
@triton.jit
def sparse_mla_fwd_kernel(
    Q, KV, IDX, OUT, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    n_heads, n_idx, scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # at 1M tokens x H x Dqk, offsets pass 2^31
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < n_heads
    q = tl.load(
        Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & (offs_d[None, :] < DQK), other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    for k0 in range(0, n_idx, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_idx, other=-1).to(tl.int64)
        valid = idx >= 0
        rows = kv_base + idx[:, None] * stride_kvs
        kv = tl.load(rows + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < DQK), other=0.0)
        if DV == DQK:  # absorbed NoPE-MLA: the value is the latent itself, gathered once
            v = kv
        else:
            v = tl.load(rows + offs_v[None, :], mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(kv)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has_any = l_i > 0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(
        OUT + b * stride_ob + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
        out.to(OUT.dtype.element_ty), mask=mask_h[:, None] & (offs_v[None, :] < DV),
    )
    tl.store(LSE + b * stride_lb + t * stride_lt + offs_h, lse, mask=mask_h)


@triton.autotune(configs=_attention_configs(), reset_to_zero=["DKV"], **_TUNE)
@triton.jit
def sparse_mla_bwd_kernel(
    Q, KV, IDX, O, DO, LSE, DQ, DKV,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_dkb, stride_dks,
    n_heads, n_idx, scale, scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # at 1M tokens x H x Dqk, offsets pass 2^31
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < n_heads
    row_q = b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    q = tl.load(Q + row_q + offs_d[None, :], mask=mask_h[:, None] & (offs_d[None, :] < DQK), other=0.0)
    # dO and O are contiguous [B, T, H, d_v].
    row_o = ((b * tl.num_programs(0).to(tl.int64) + t) * n_heads + offs_h[:, None]) * DV
    o_mask = mask_h[:, None] & (offs_v[None, :] < DV)
    do = tl.load(DO + row_o + offs_v[None, :], mask=o_mask, other=0.0)
    o = tl.load(O + row_o + offs_v[None, :], mask=o_mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    lse = tl.load(LSE + b * stride_lb + t * stride_lt + offs_h, mask=mask_h, other=float("-inf"))
    row_ok = lse > float("-inf")
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkb
    idx_base = IDX + b * stride_ib + t * stride_it
    for k0 in range(0, n_idx, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_idx, other=-1).to(tl.int64)
        valid = idx >= 0
        rows = kv_base + idx[:, None] * stride_kvs
        kv = tl.load(rows + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < DQK), other=0.0)
        if DV == DQK:  # absorbed NoPE-MLA: the value is the latent itself, gathered once
            v = kv
        else:
            v = tl.load(rows + offs_v[None, :], mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(kv)) * scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(valid[None, :] & row_ok[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kv.dtype), kv)
        dkv = tl.dot(tl.trans(ds).to(q.dtype), q) * scale
        dv = tl.dot(tl.trans(p).to(do.dtype), do)
        dk_rows = dkv_base + idx[:, None] * stride_dks
        if DV == DQK:  # absorbed NoPE-MLA: the value is the whole latent, one atomic row
            tl.atomic_add(dk_rows + offs_d[None, :], dkv + dv, mask=valid[:, None] & (offs_d[None, :] < DQK), sem="relaxed")
        else:
            tl.atomic_add(dk_rows + offs_d[None, :], dkv, mask=valid[:, None] & (offs_d[None, :] < DQK), sem="relaxed")
            tl.atomic_add(dk_rows + offs_v[None, :], dv, mask=valid[:, None] & (offs_v[None, :] < DV), sem="relaxed")
    tl.store(
        DQ + row_q + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
        mask=mask_h[:, None] & (offs_d[None, :] < DQK),
    )


@triton.autotune(configs=_attention_configs(), reset_to_zero=["MASS"], **_TUNE)
@triton.jit
def sparse_mla_mass_kernel(
    Q, KV, IDX, LSE, MASS,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_mb, stride_mt,
    n_heads, n_idx, scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < n_heads
    q = tl.load(
        Q + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & (offs_d[None, :] < DQK), other=0.0,
    )
    lse = tl.load(LSE + b * stride_lb + t * stride_lt + offs_h, mask=mask_h, other=float("-inf"))
    row_ok = lse > float("-inf")
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    mass_base = MASS + b * stride_mb + t * stride_mt
    for k0 in range(0, n_idx, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_idx, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(kv_base + idx[:, None] * stride_kvs + offs_d[None, :],
                     mask=valid[:, None] & (offs_d[None, :] < DQK), other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(kv)) * scale_log2 - lse2[:, None])
        p = tl.where(valid[None, :] & row_ok[:, None], p, 0.0)
        tl.atomic_add(mass_base + offs_k, tl.sum(p, axis=0), mask=offs_k < n_idx, sem="relaxed")


def _grid(n_q: int, heads: int, batch: int):
    return lambda meta: (n_q, triton.cdiv(heads, meta["BLOCK_H"]), batch)


def triton_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v):
    """``out [B, T, H, d_v]`` (q.dtype) and ``lse [B, T, H]`` float32; see ``sparse_mla_attention``."""
    batch, n_q, heads, dqk = q.shape
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    out = torch.empty(batch, n_q, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_q, heads, dtype=torch.float32, device=q.device)
    sparse_mla_fwd_kernel[_grid(n_q, heads, batch)](
        q, kv, indices, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        heads, indices.shape[2], softmax_scale * _LOG2E,
        DQK=dqk, DV=d_v, BLOCK_D=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(d_v),
    )
    return out, lse


def triton_sparse_mla_bwd(q, kv, indices, out, lse, grad_out, softmax_scale, d_v):
    """``dq`` (q.dtype) and ``dkv`` (kv.dtype, accumulated in float32) of ``sparse_mla_attention``."""
    batch, n_q, heads, dqk = q.shape
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    grad_out, lse, out = grad_out.contiguous(), lse.contiguous(), out.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    sparse_mla_bwd_kernel[_grid(n_q, heads, batch)](
        q, kv, indices, out, grad_out, lse, dq, dkv,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        lse.stride(0), lse.stride(1),
        dkv.stride(0), dkv.stride(1),
        heads, indices.shape[2], softmax_scale, softmax_scale * _LOG2E,
        DQK=dqk, DV=d_v, BLOCK_D=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(d_v),
    )
    return dq, dkv.to(kv.dtype)




def triton_sparse_mla_mass(q, kv, indices, lse, softmax_scale):
    """``[B, T, K]`` float32: attention probability of each selected token summed over heads,
    ``sum_h exp(softmax_scale * q[t, h] . kv[idx] - lse[t, h])`` (0 where ``idx == -1``).

    The target of the indexer KL loss (:mod:`kernels.dsa.loss`); FLOPs ``2 H K Dqk`` per query.
    """
    batch, n_q, heads, dqk = q.shape
    q, kv, indices, lse = q.contiguous(), kv.contiguous(), indices.contiguous(), lse.contiguous()
    mass = torch.zeros(indices.shape, dtype=torch.float32, device=q.device)
    sparse_mla_mass_kernel[_grid(n_q, heads, batch)](
        q, kv, indices, lse, mass,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        lse.stride(0), lse.stride(1),
        mass.stride(0), mass.stride(1),
        heads, indices.shape[2], softmax_scale * _LOG2E,
        DQK=dqk, DV=dqk, BLOCK_D=triton.next_power_of_2(dqk),
    )
    return mass
