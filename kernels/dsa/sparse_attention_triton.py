"""Triton sparse MLA attention (absorbed / MQA form): forward with log-sum-exp, backward.

One program handles one query and a block of ``BLOCK_H`` heads (autotuned per head count
and widths, together with ``BLOCK_K``, warps and stages): it gathers the selected
latent rows ``kv[idx]`` ``BLOCK_K`` at a time (shared by all heads of the block, as in
FlashMLA's sparse kernels), runs an online softmax in base 2 and accumulates
``P @ kv[:, :d_v]`` in float32; asked for the DSA indexer KL's target, it also stores each k-pool's
log2-sum-exp2 of its scores per head (:func:`triton_sparse_mla_fwd`, ``pool_mass``). The backward
recomputes ``P`` from the saved ``lse`` and accumulates ``dq`` in registers. ``dkv`` comes one of two ways:

* per query (``runs=None``): the query's program scatter-adds its ``dkv`` rows with float32
  atomics, one ``Dqk``-wide row per selected key, query and head block. At 8 heads these
  atomics bound the backward (69 G adds per 64k-token call).
* per key run (``runs=kpool``, the indexer's layout: slots ``[r * kpool, (r + 1) * kpool)`` hold
  one k-pool's consecutive tokens or ``-1``, the last, shorter group the query's own pool's first
  tokens, then ``-1``): :func:`run_scan_kernel` finds each query's runs in one pass over its indices, the
  (query, run) pairs are sorted by the run's first token (``torch.sort``, stable), and
  :func:`sparse_mla_bwd_runs_kernel` walks the sorted list in fixed chunks,
  recomputing ``P`` and ``dP`` of each pair's query rows against the run's ``kpool`` latent rows
  (masked past the pair's run length) and summing ``dS^T Q + P^T dO`` over all queries of the run in
  registers: one atomic row flush per run and chunk instead of one per query. A run is any group
  whose slots hold ``s, s + 1, ..., s + c - 1`` and then only ``-1``; the slots of other groups
  (a permutation, a hole) go through the per-query atomics, so any index layout stays exact.

Per query (all heads), forward: FLOPs ``2 * H * K * (Dqk + d_v)``, gathered bytes
``ceil(H / BLOCK_H) * K * (Dqk + d_v) * 2`` (L2 absorbs the repeats across head blocks).
Backward per query: FLOPs ``2 * H * K * (2 * Dqk + 2 * d_v)`` (+ the recomputed ``QK``); per-query
atomics ``ceil(H / BLOCK_H) * K * Dqk`` float32 adds; the run pass instead reads the query's
``q`` and ``dO`` rows once per selected run (``H * (Dqk + d_v) * 2`` bytes) and recomputes ``QK`` and
``dO V^T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dsa.errors import DSAInputError

_LOG2E = 1.4426950408889634

__all__ = ["triton_sparse_mla_fwd", "triton_sparse_mla_bwd", "triton_sparse_mla_mass", "triton_sparse_mla_pool_mass",
           "pool_mass_from_log2", "run_pairs", "run_scan", "torch_run_scan"]


def _attention_configs():
    """Head-block x key-block tilings; BLOCK_H 64 lets wgmma use full 64-row tiles for 64 heads. With few
    heads the kernels stream gathered latent rows (``2 * H`` FLOPs per byte at 8 heads): the 16-row
    tilings vary the bytes in flight per program (key block, stages) and the warps sharing them."""
    return [
        triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bh, bk, w, st in [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (16, 32, 4, 3), (16, 64, 8, 3),
                              (32, 32, 8, 2), (64, 32, 8, 2), (64, 32, 8, 1), (64, 64, 8, 1)]
    ]


def _prune_head_blocks(configs, named_args, **kwargs):
    """Drop head blocks larger than the (power-of-two rounded, >= 16) head count."""
    limit = max(16, triton.next_power_of_2(named_args["n_heads"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= limit]


_TUNE = dict(key=["n_heads", "DQK", "DV"], prune_configs_by={"early_config_prune": _prune_head_blocks})


@triton.autotune(configs=_attention_configs(), **_TUNE)
@triton.jit
def sparse_mla_fwd_kernel(
    Q, KV, IDX, OUT, LSE, POOL_LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_pb, stride_pt, stride_ph,
    n_heads, n_idx, scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    KPOOL: tl.constexpr = 1, N_POOLS: tl.constexpr = 0,
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
    # with N_POOLS: KPOOL divides BLOCK_K, so a block of slots holds whole pools, pool k0 // KPOOL first
    offs_c = tl.arange(0, BLOCK_K // KPOOL)
    pool_base = POOL_LSE + b * stride_pb + t * stride_pt + offs_h[:, None] * stride_ph
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_it
    for k0 in range(0, n_idx, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_idx, other=-1).to(tl.int64)
        valid = idx >= 0
        kv, v = _gather_latent(kv_base, stride_kvs, idx, valid, offs_d, offs_v, DQK, DV)
        s = tl.dot(q, tl.trans(kv)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_hi = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_hi, v)
        if N_POOLS > 0:
            # each pool's log2-sum-exp2 of its scores, per head: log2(sum_pool p) + m
            pool_sum = tl.sum(tl.reshape(p, [BLOCK_H, BLOCK_K // KPOOL, KPOOL]), axis=2)
            pools = k0 // KPOOL + offs_c
            keep = mask_h[:, None] & (pools < N_POOLS)[None, :]
            tl.store(pool_base + pools[None, :], tl.where(pool_sum > 0, tl.log2(pool_sum) + m_safe[:, None],
                                                          float("-inf")), mask=keep)
        m_i = m_new
    has_any = l_i > 0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(
        OUT + b * stride_ob + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
        out.to(OUT.dtype.element_ty), mask=mask_h[:, None] & (offs_v[None, :] < DV),
    )
    tl.store(LSE + b * stride_lb + t * stride_lt + offs_h, lse, mask=mask_h)


@triton.jit
def _gather_latent(kv_base, stride_kvs, idx, valid, offs_d, offs_v, DQK: tl.constexpr, DV: tl.constexpr):
    """The latent rows ``kv [BLOCK_K, BLOCK_D]`` of the selected slots ``idx`` (zeros where not ``valid``) and
    their value ``v`` (the latent itself when ``DV == DQK``, else its first ``DV`` columns, loaded apart)."""
    rows = kv_base + idx[:, None] * stride_kvs
    kv = tl.load(rows + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < DQK), other=0.0)
    if DV == DQK:  # absorbed NoPE-MLA: the value is the latent itself, gathered once
        v = kv
    else:
        v = tl.load(rows + offs_v[None, :], mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0)
    return kv, v


@triton.jit
def _slot_block(q, do, delta, lse2, row_ok, kv_base, stride_kvs, idx, valid, offs_d, offs_v, scale_log2,
                DQK: tl.constexpr, DV: tl.constexpr):
    """One block of selected slots against a block of heads: the gathered latent ``kv [BLOCK_K, BLOCK_D]``,
    its value ``v``, the probabilities ``p`` and ``dS = P (dP - rowsum(dO O))`` (both ``[BLOCK_H, BLOCK_K]``
    float32, unscaled)."""
    kv, v = _gather_latent(kv_base, stride_kvs, idx, valid, offs_d, offs_v, DQK, DV)
    p = tl.exp2(tl.dot(q, tl.trans(kv)) * scale_log2 - lse2[:, None])
    p = tl.where(valid[None, :] & row_ok[:, None], p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return kv, p, ds


@triton.jit
def _scatter_dkv(dkv_base, stride_dks, idx, mask, q, do, p, ds, offs_d, offs_v, scale,
                 DQK: tl.constexpr, DV: tl.constexpr):
    """Add ``scale * dS^T q`` and ``P^T dO`` of a slot block to the ``dkv`` rows of its keys where ``mask``
    (float32 atomics)."""
    dkv = tl.dot(tl.trans(ds).to(q.dtype), q) * scale
    dv = tl.dot(tl.trans(p).to(do.dtype), do)
    dk_rows = dkv_base + idx[:, None] * stride_dks
    if DV == DQK:  # absorbed NoPE-MLA: the value is the whole latent, one atomic row
        tl.atomic_add(dk_rows + offs_d[None, :], dkv + dv, mask=mask[:, None] & (offs_d[None, :] < DQK), sem="relaxed")
    else:
        tl.atomic_add(dk_rows + offs_d[None, :], dkv, mask=mask[:, None] & (offs_d[None, :] < DQK), sem="relaxed")
        tl.atomic_add(dk_rows + offs_v[None, :], dv, mask=mask[:, None] & (offs_v[None, :] < DV), sem="relaxed")


@triton.autotune(configs=_attention_configs(), reset_to_zero=["DKV"], key=["n_heads", "DQK", "DV", "RUN", "MODE"],
                 prune_configs_by=_TUNE["prune_configs_by"])
@triton.jit
def sparse_mla_bwd_kernel(
    Q, KV, IDX, O, DO, LSE, DQ, DKV, RUN_OK, SCATTER, DELTA,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_dkb, stride_dks,
    n_heads, n_idx, n_runs, scale, scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    RUN: tl.constexpr, MODE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Per-query backward of one query and head block. ``MODE`` 0: ``dq`` and every selected key's ``dkv``
    (float32 atomics). With k-pool runs (``RUN > 0``), 1: ``dq`` only, and ``rowsum(dO * O)`` to ``DELTA``
    (contiguous ``[B, T, H]``); 2: ``dkv`` of the slots outside runs only (``RUN_OK [B, T, n_runs]``, each
    run's length, 0 for a group that is not a run), blocks without such a slot skipped and queries
    without any (``SCATTER [B, T]`` uint8 0) not read at all, ``DELTA`` read. Split so that the ``dq`` pass compiles without the
    ``dkv`` products (sm_90, 8 heads: 156 registers, no spills, 3 CTAs per SM, against 255 registers and a
    spill with them)."""
    t = tl.program_id(0).to(tl.int64)  # at 1M tokens x H x Dqk, offsets pass 2^31
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    # dO and O are contiguous [B, T, H, d_v]; DELTA, RUN_OK and SCATTER are contiguous too.
    query = b * tl.num_programs(0).to(tl.int64) + t
    if MODE == 2:   # most queries of the indexer's layout have every slot in a run: nothing to read
        need = tl.load(SCATTER + query).to(tl.int32)   # 0 or 1
        n_loop = n_idx * need
        mask_h = offs_h < n_heads * need
    else:
        n_loop = n_idx
        mask_h = offs_h < n_heads
    row_q = b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    q = tl.load(Q + row_q + offs_d[None, :], mask=mask_h[:, None] & (offs_d[None, :] < DQK), other=0.0)
    row_o = (query * n_heads + offs_h[:, None]) * DV
    o_mask = mask_h[:, None] & (offs_v[None, :] < DV)
    do = tl.load(DO + row_o + offs_v[None, :], mask=o_mask, other=0.0)
    if MODE == 2:
        delta = tl.load(DELTA + query * n_heads + offs_h, mask=mask_h, other=0.0)
    else:
        o = tl.load(O + row_o + offs_v[None, :], mask=o_mask, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    if MODE == 1:
        tl.store(DELTA + query * n_heads + offs_h, delta, mask=mask_h)
    lse = tl.load(LSE + b * stride_lb + t * stride_lt + offs_h, mask=mask_h, other=float("-inf"))
    row_ok = lse > float("-inf")
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkb
    idx_base = IDX + b * stride_ib + t * stride_it
    for k0 in range(0, n_loop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_base + offs_k, mask=offs_k < n_idx, other=-1).to(tl.int64)
        valid = idx >= 0
        if MODE == 1:
            kv, p, ds = _slot_block(q, do, delta, lse2, row_ok, kv_base, stride_kvs, idx, valid, offs_d, offs_v,
                                    scale_log2, DQK, DV)
            dq += tl.dot(ds.to(kv.dtype), kv)
        elif MODE == 0:
            kv, p, ds = _slot_block(q, do, delta, lse2, row_ok, kv_base, stride_kvs, idx, valid, offs_d, offs_v,
                                    scale_log2, DQK, DV)
            dq += tl.dot(ds.to(kv.dtype), kv)
            _scatter_dkv(dkv_base, stride_dks, idx, valid, q, do, p, ds, offs_d, offs_v, scale, DQK, DV)
        else:  # slots of a run get their dkv from the run pass (a run's slots past its length are -1)
            in_runs = offs_k < n_runs * RUN
            run_ok = tl.load(RUN_OK + query * n_runs + offs_k // RUN, mask=in_runs, other=0)
            scatter = valid & ~(in_runs & (run_ok != 0))
            if tl.max(scatter.to(tl.int32), axis=0) > 0:
                kv, p, ds = _slot_block(q, do, delta, lse2, row_ok, kv_base, stride_kvs, idx, valid, offs_d, offs_v,
                                        scale_log2, DQK, DV)
                _scatter_dkv(dkv_base, stride_dks, idx, scatter, q, do, p, ds, offs_d, offs_v, scale, DQK, DV)
    if MODE != 2:
        tl.store(
            DQ + row_q + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
            mask=mask_h[:, None] & (offs_d[None, :] < DQK),
        )


RUN_ROWS, RUN_CHUNK, RUN_WARPS, RUN_STAGES = 16, 256, 4, 2
"""The run pass's launch: (query, head) rows per step, sorted pairs per program, warps, stages. Fixed, not
autotuned: the kernel adds into a ``dkv`` that already holds the per-query kernel's rows, which an autotuner
would have to copy and restore around every trial (zeroing it, ``reset_to_zero``, made the autotuning call
27% off on the H200). The candidates measured there (ms per call at 4k tokens, small / full shape):
rows 16 w4 s2 1.97 / 14.3; rows 16 s1 2.29 / 19.4; rows 32 s2 2.01 / 15.0; rows 32 s1 2.27 / 18.5;
rows 32 w8 s2 3.39 / 28.2."""


@triton.jit
def sparse_mla_bwd_runs_kernel(
    Q, KV, DO, LSE, DELTA, KEYS, PAIRS, COUNTS, ENDS, DKV,
    stride_kvb, stride_kvs,
    stride_dkb, stride_dks,
    n_pairs, n_keys, seq_keys, n_heads, scale, scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    RUN: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
):
    """``dkv`` of runs, key-centric: the sorted (query, run) pairs ``[c * CHUNK, (c + 1) * CHUNK)``.

    ``KEYS [n_pairs]`` int32: each pair's run start as ``b * seq_keys + s`` ascending, ``n_keys``
    (``= B * seq_keys``) for pairs without a run (sorted last); ``PAIRS [n_pairs]`` int32: the
    pair's query as ``b * T + t``; ``COUNTS [n_pairs]`` uint8: the pair's run length (keys
    ``s .. s + count - 1``); ``ENDS [n_keys]`` int32: one past the last pair of each key.
    ``Q [B, T, H, DQK]``, ``DO [B, T, H, DV]`` contiguous; ``LSE``, ``DELTA`` contiguous float32
    ``[B, T, H]``. Each key segment of the chunk sums ``scale * dS^T q + P^T dO`` over its pairs in
    float32 and adds it to ``DKV`` rows ``s .. s + RUN - 1`` once (atomics: a run's pairs may span
    chunks).
    """
    start = tl.program_id(0) * CHUNK
    stop = tl.minimum(start + CHUNK, n_pairs)
    offs_r = tl.arange(0, RUN)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_m = tl.arange(0, ROWS)
    i = start
    while i < stop:
        key = tl.load(KEYS + i)
        is_run = key < n_keys
        seg_end = tl.where(is_run, tl.minimum(tl.load(ENDS + tl.minimum(key, n_keys - 1)), stop), stop)
        if is_run:
            b = (key // seq_keys).to(tl.int64)
            s0 = (key % seq_keys).to(tl.int64)
            in_seq = (s0 + offs_r) < seq_keys   # a short run near the end: its rows past the keys are not read
            kv_rows = KV + b * stride_kvb + (s0 + offs_r)[:, None] * stride_kvs
            kv = tl.load(kv_rows + offs_d[None, :], mask=in_seq[:, None] & (offs_d[None, :] < DQK), other=0.0)
            if DV == DQK:
                v = kv
            else:
                v = tl.load(kv_rows + offs_v[None, :], mask=in_seq[:, None] & (offs_v[None, :] < DV), other=0.0)
            acc = tl.zeros([RUN, BLOCK_D], tl.float32)
            acc_v = tl.zeros([RUN, BLOCK_DV], tl.float32)
            # rows are the segment's (pair, head) products in order, ROWS at a time: no head padding,
            # and a pair's heads may span two steps
            for g0 in range(i * n_heads, seg_end * n_heads, ROWS):
                g = g0 + offs_m
                live = g < seg_end * n_heads
                query = tl.load(PAIRS + g // n_heads, mask=live, other=0).to(tl.int64)
                count = tl.load(COUNTS + g // n_heads, mask=live, other=0).to(tl.int32)
                row = query * n_heads + g % n_heads
                q = tl.load(Q + row[:, None] * DQK + offs_d[None, :], mask=live[:, None] & (offs_d[None, :] < DQK),
                            other=0.0)
                do = tl.load(DO + row[:, None] * DV + offs_v[None, :], mask=live[:, None] & (offs_v[None, :] < DV),
                             other=0.0)
                lse = tl.load(LSE + row, mask=live, other=float("-inf"))
                delta = tl.load(DELTA + row, mask=live, other=0.0)
                row_ok = lse > float("-inf")
                lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
                p = tl.exp2(tl.dot(q, tl.trans(kv)) * scale_log2 - lse2[:, None])
                p = tl.where(row_ok[:, None] & (offs_r[None, :] < count[:, None]), p, 0.0)
                dp = tl.dot(do, tl.trans(v))
                ds = p * (dp - delta[:, None]) * scale
                acc += tl.dot(tl.trans(ds).to(q.dtype), q)
                if DV == DQK:
                    acc += tl.dot(tl.trans(p).to(do.dtype), do)
                else:
                    acc_v += tl.dot(tl.trans(p).to(do.dtype), do)
            dk_rows = DKV + b * stride_dkb + (s0 + offs_r)[:, None] * stride_dks
            tl.atomic_add(dk_rows + offs_d[None, :], acc, mask=in_seq[:, None] & (offs_d[None, :] < DQK), sem="relaxed")
            if DV != DQK:
                tl.atomic_add(dk_rows + offs_v[None, :], acc_v, mask=in_seq[:, None] & (offs_v[None, :] < DV),
                              sem="relaxed")
        i = seg_end


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


DELTA_ROWS = 16
"""(query, head) rows per program of :func:`sparse_mla_delta_kernel`."""


@triton.jit
def sparse_mla_delta_kernel(DO, O, DELTA, n_rows, DV: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS: tl.constexpr):
    """``DELTA[r] = sum_v DO[r, v] * O[r, v]`` in float32 over ``n_rows`` contiguous rows of width ``DV``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    acc = tl.zeros([ROWS], dtype=tl.float32)
    for v0 in range(0, DV, BLOCK_DV):
        offs = v0 + tl.arange(0, BLOCK_DV)
        mask = live[:, None] & (offs[None, :] < DV)
        do = tl.load(DO + rows[:, None] * DV + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        o = tl.load(O + rows[:, None] * DV + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(do * o, axis=1)
    tl.store(DELTA + rows, acc, mask=live)


def triton_sparse_mla_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O)`` of the attention backward (FlashAttention-2, Dao 2023, Algorithm 2 line 4).

    Args:
        out, grad_out: ``[B, T, H, d_v]`` bf16/fp16/fp32, the forward's output and its gradient.

    Returns:
        ``delta [B, T, H]`` float32, each row's product summed in float32 without float32 copies of the
        inputs (at 64k tokens x 64 heads x 512 these would be 8.6 GB each).
    """
    out, grad_out = out.contiguous(), grad_out.contiguous()
    *lead, d_v = out.shape
    delta = torch.empty(lead, dtype=torch.float32, device=out.device)
    n_rows = delta.numel()
    sparse_mla_delta_kernel[(triton.cdiv(n_rows, DELTA_ROWS),)](
        grad_out, out, delta, n_rows, DV=d_v, BLOCK_DV=min(128, triton.next_power_of_2(d_v)), ROWS=DELTA_ROWS)
    return delta


def _grid(n_q: int, heads: int, batch: int):
    return lambda meta: (n_q, triton.cdiv(heads, meta["BLOCK_H"]), batch)


def triton_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v, pool_mass=None):
    """``out [B, T, H, d_v]`` (q.dtype) and ``lse [B, T, H]`` float32; see ``sparse_mla_attention``.

    ``pool_mass=(kpool, n_pools)`` also returns ``mass [B, T, n_pools]`` float32, the attention probability of
    slots ``[j * kpool, (j + 1) * kpool)`` summed over those slots and all heads (the indexer KL's target before
    its normalization: :func:`triton_sparse_mla_mass` summed per pool). The forward's softmax leaves each pool's
    log2-sum-exp2 per head (``[B, T, H, n_pools]`` float32, written once per pool) instead of a second pass
    over the gathered latent; ``exp2`` of it less the final ``lse`` and a sum over heads finish it here.

    Raises:
        DSAInputError: ``kpool`` does not divide 16, the smallest key block of the kernel's tilings.
    """
    batch, n_q, heads, dqk = q.shape
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    out = torch.empty(batch, n_q, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_q, heads, dtype=torch.float32, device=q.device)
    kpool, n_pools = pool_mass or (1, 0)
    if 16 % kpool:
        raise DSAInputError(f"the Triton forward's pool mass needs kpool to divide 16 (its key blocks hold whole "
                            f"pools), got {kpool}")
    pool_lse = torch.empty(batch, n_q, heads, n_pools, dtype=torch.float32, device=q.device)
    sparse_mla_fwd_kernel[_grid(n_q, heads, batch)](
        q, kv, indices, out, lse, pool_lse,
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1),
        indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        pool_lse.stride(0), pool_lse.stride(1), pool_lse.stride(2),
        heads, indices.shape[2], softmax_scale * _LOG2E,
        DQK=dqk, DV=d_v, BLOCK_D=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(d_v),
        KPOOL=kpool, N_POOLS=n_pools,
    )
    return (out, lse, pool_mass_from_log2(pool_lse, lse)) if pool_mass else (out, lse)


def pool_mass_from_log2(pool_lse: torch.Tensor, lse: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """``[B, T, J]`` float32 pool mass summed over heads from the forward's per-head pool log2-sum-exp2
    ``pool_lse [B, T, H, J]`` and its natural-log ``lse [B, T, H]``: ``sum_h exp2(pool_lse - lse * log2(e))``,
    ``block`` queries at a time (bounds the ``exp2`` temporary). A row without a valid slot (``lse = -inf``,
    its pools ``-inf`` too) gives 0."""
    lse2 = (lse * _LOG2E).masked_fill(torch.isinf(lse), 0.0)
    mass = torch.empty(pool_lse.shape[:2] + pool_lse.shape[3:], dtype=torch.float32, device=pool_lse.device)
    for t0 in range(0, pool_lse.shape[1], block):
        mass[:, t0:t0 + block] = torch.exp2(pool_lse[:, t0:t0 + block] - lse2[:, t0:t0 + block, :, None]).sum(2)
    return mass


def triton_sparse_mla_pool_mass(q, kv, indices, lse, softmax_scale, kpool: int, n_pools: int, block: int = 4096):
    """``[B, T, n_pools]`` float32: :func:`triton_sparse_mla_mass` over the first ``kpool * n_pools`` slots summed
    per pool of ``kpool``, ``block`` queries at a time (the per-slot mass is ``[B, block, kpool * n_pools]``
    float32): the pool mass of a forward that does not fold it in (the Gluon one, or a kept output)."""
    mass = torch.empty(*q.shape[:2], n_pools, dtype=torch.float32, device=q.device)
    for t0 in range(0, q.shape[1], block):
        slots = triton_sparse_mla_mass(q[:, t0:t0 + block], kv, indices[:, t0:t0 + block, : kpool * n_pools],
                                       lse[:, t0:t0 + block], softmax_scale)
        mass[:, t0:t0 + block] = slots.view(*slots.shape[:2], n_pools, kpool).sum(-1)
    return mass


@triton.jit
def run_scan_kernel(IDX, RUN_OK, SCATTER, KEYS, stride_ib, stride_it, n_q, width, n_runs, n_keys, no_run_key,
                    RUN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RUN: tl.constexpr):
    """One query's ``[n_runs, RUN]`` slot groups: each group's run length (0: not a run), its sort key, and
    whether the query has a selected slot outside every run. The definition is :func:`torch_run_scan`'s."""
    # int64 offsets: one rank's 1M queries x 2,063 slots pass 2^31 elements
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    s = tl.arange(0, BLOCK_RUN)[None, :]
    slot = r[:, None] * RUN + s
    # slots past the width, past a group's RUN and past the last group read as -1, as the reference pads them
    idx = tl.load(IDX + b * stride_ib + t * stride_it + slot, mask=(s < RUN) & (slot < width), other=-1)
    valid = idx >= 0
    count = tl.sum(valid.to(tl.int32), 1)
    first = tl.sum(tl.where(s == 0, idx, 0), 1)
    expected = tl.where(s < count[:, None], first[:, None] + s, -1)
    is_run = (first >= 0) & (tl.sum((idx != expected).to(tl.int32), 1) == 0)
    row = b * n_q + t
    in_range = r < n_runs
    tl.store(RUN_OK + row * n_runs + r, tl.where(is_run, count, 0).to(tl.uint8), mask=in_range)
    key = tl.where(is_run, first + b * n_keys, no_run_key).to(tl.int32)
    tl.store(KEYS + row * n_runs + r, key, mask=in_range)
    outside = tl.max(((~is_run) & (count > 0)).to(tl.int32), 0)
    tl.store(SCATTER + row, outside.to(tl.uint8))


def torch_run_scan(indices: torch.Tensor, run: int, n_keys: int, query_block: int = 32768):
    """Reference of :func:`run_scan_kernel` in torch: ``(run_ok [B, T, R] uint8, scatter [B, T] uint8, keys
    [B, T, R] int32)`` of ``indices [B, T, W]`` (definitions in :func:`run_pairs`), ``query_block`` queries at a
    time (the ``[t, R, run]`` comparisons are its full-width temporaries)."""
    batch, n_q, width = indices.shape
    n_runs = -(-width // run)
    steps = torch.arange(run, dtype=indices.dtype, device=indices.device)
    run_ok = torch.empty(batch, n_q, n_runs, dtype=torch.uint8, device=indices.device)
    scatter = torch.empty(batch, n_q, dtype=torch.uint8, device=indices.device)
    for t0 in range(0, n_q, query_block):
        blk = indices[:, t0:t0 + query_block]
        blk = torch.nn.functional.pad(blk, (0, n_runs * run - width), value=-1).unflatten(-1, (n_runs, run))
        first = blk[..., :1]
        valid = blk >= 0
        count = valid.sum(-1, keepdim=True)   # a run's slots are its length's first, then -1
        is_run = (first[..., 0] >= 0) & (blk == torch.where(steps < count, first + steps, -1)).all(-1)
        run_ok[:, t0:t0 + query_block] = torch.where(is_run, count[..., 0], 0).to(torch.uint8)
        scatter[:, t0:t0 + query_block] = (~is_run & valid.any(-1)).any(-1).to(torch.uint8)
    first = indices[:, :, ::run].to(torch.int32)
    offset = (torch.arange(batch, dtype=torch.int32, device=indices.device) * n_keys)[:, None, None]
    keys = torch.where(run_ok.bool(), first + offset, batch * n_keys)
    return run_ok, scatter, keys


def run_scan_tile(n_runs: int, run: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_RUN, warps)`` of :func:`run_scan_kernel` for ``n_runs`` groups of ``run`` slots: the
    groups and slots rounded to powers of two, 16 slots per thread (the 2,063-slot selection's [256, 16] tile
    takes 8 warps)."""
    block_r, block_run = triton.next_power_of_2(n_runs), triton.next_power_of_2(run)
    return block_r, block_run, max(1, min(8, block_r * block_run // 512))


def run_scan(indices: torch.Tensor, run: int, n_keys: int):
    """:func:`run_scan_kernel` over ``indices [B, T, W]`` (int32 or int64; one program per query): the same
    ``(run_ok, scatter, keys)`` as :func:`torch_run_scan`, reading the indices once. In torch the scan was
    ~7 ms per 64k-token DSA layer on an H200 (padding copy, int64 sums, ``all``/``any`` reductions)."""
    batch, n_q, width = indices.shape
    n_runs = -(-width // run)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    run_ok = torch.empty(batch, n_q, n_runs, dtype=torch.uint8, device=indices.device)
    scatter = torch.empty(batch, n_q, dtype=torch.uint8, device=indices.device)
    keys = torch.empty(batch, n_q, n_runs, dtype=torch.int32, device=indices.device)
    if indices.numel():
        block_r, block_run, warps = run_scan_tile(n_runs, run)
        run_scan_kernel[(n_q, batch)](
            indices, run_ok, scatter, keys, indices.stride(0), indices.stride(1), n_q, width, n_runs, n_keys,
            batch * n_keys, RUN=run, BLOCK_R=block_r, BLOCK_RUN=block_run, num_warps=warps,
        )
    return run_ok, scatter, keys


def run_pairs(indices: torch.Tensor, run: int, n_keys: int):
    """The (query, run) pairs of ``indices [B, T, W]`` sorted by run start, for the key-centric ``dkv`` pass.

    The slots fall in ``R = ceil(W / run)`` groups ``[r * run, (r + 1) * run)`` (the last one shorter
    when ``run`` does not divide ``W``). A group is a *run* of length ``c >= 1`` when its slots hold
    ``s, s + 1, ..., s + c - 1`` with ``s >= 0`` and only ``-1`` after them: the indexer's expanded
    k-pools (``c = run``) and the tail of the query's own pool (its first ``c < run`` tokens). Returns
    ``run_ok [B, T, R]`` uint8 (each group's run length, 0 when it is not a run), ``scatter [B, T]`` uint8
    (1 where a query has a selected slot in no run), ``keys [B * T * R]`` int32 (``b * n_keys + s``
    ascending; ``B * n_keys`` for groups that are not runs, last), ``pairs`` int32 (``b * T + t`` of each
    sorted pair; stable, so ascending within a run), ``counts`` uint8 (each sorted pair's run length)
    and ``ends [B * n_keys]`` int32 (one past each key's last pair). The groups are scanned by
    :func:`run_scan` (Triton; :func:`torch_run_scan` is its reference).

    Raises:
        DSAInputError: when the keys or the pairs do not fit int32 offsets, or ``run`` exceeds 255.
    """
    batch, n_q, width = indices.shape
    n_runs = -(-width // run)
    if batch * n_keys >= 2**31 or batch * n_q * n_runs >= 2**31:
        raise DSAInputError(f"{batch} x {n_keys} keys or {batch} x {n_q} x {n_runs} (query, run) pairs exceed int32")
    if run > 255:
        raise DSAInputError(f"run lengths are kept as uint8: runs={run} exceeds 255")
    run_ok, scatter, keys = run_scan(indices, run, n_keys)
    keys, order = torch.sort(keys.flatten(), stable=True)
    pairs = torch.div(order, n_runs, rounding_mode="floor").to(torch.int32)
    counts = run_ok.flatten()[order]
    probes = torch.arange(batch * n_keys, dtype=torch.int32, device=indices.device)
    ends = torch.searchsorted(keys, probes, right=True).to(torch.int32)
    return run_ok, scatter, keys, pairs, counts, ends


def triton_sparse_mla_bwd(q, kv, indices, out, lse, grad_out, softmax_scale, d_v, runs=None, dkv_kernel="triton",
                          dq_kernel="auto"):
    """``dq`` (q.dtype) and ``dkv`` (kv.dtype, accumulated in float32) of ``sparse_mla_attention``.

    ``runs``: ``None`` scatters every selected key's ``dkv`` from its query's program with atomics;
    an int (the k-pool size) sums runs of up to that many consecutive tokens per run instead
    (:func:`run_pairs`, :func:`sparse_mla_bwd_runs_kernel`), the other slots as before. Runs
    shorter than 16 or not a power of two are too small for the run pass's tiles and are
    scattered per query like ``None`` (the result is the same either way).
    ``dkv_kernel="gluon"`` (``runs`` must be ``None``): every slot's ``dkv`` from
    :func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dkv` (64 heads per program, Hopper), and ``dq``
    by ``dq_kernel``: ``"gluon"`` (:func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dq`, which forms
    ``rowsum(dO * O)`` itself with ``DQ_FUSED_DELTA``, the default, or takes it from :func:`triton_sparse_mla_delta`)
    or ``"triton"`` (the ``dq`` pass, ``MODE`` 1, which also writes ``rowsum(dO * O)``). ``dq_kernel="auto"`` is
    ``"gluon"`` with the Gluon latent gradient and ``"triton"`` otherwise: one H100, ``full`` shape, 64k tokens
    (``tests/benchmarks/sparse_mla_tilings.py``, anchor 781 TF/s), the Gluon ``dq`` 74.6 ms against the ``dq``
    pass's 94.6 ms, the backward 213.0 ms against 230.6 ms.

    Raises:
        DSAInputError: ``dq_kernel`` not ``"auto"``, ``"triton"`` or ``"gluon"``, ``"gluon"`` without the Gluon
            latent gradient (only the ``dq`` pass writes the ``rowsum(dO * O)`` the Triton latent gradient reads),
            or ``runs`` with ``dkv_kernel="gluon"``.
    """
    batch, n_q, heads, dqk = q.shape
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    grad_out, lse, out = grad_out.contiguous(), lse.contiguous(), out.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    # the run pass's tiles need a power-of-two run of at least 16 rows (tl.arange, tl.dot)
    run = runs if runs and runs >= 16 and runs & (runs - 1) == 0 else 0
    n_runs = -(-indices.shape[2] // run) if run else 0
    gluon_dkv = dkv_kernel == "gluon"
    if dq_kernel not in ("auto", "triton", "gluon") or (dq_kernel == "gluon" and not gluon_dkv):
        raise DSAInputError(f"dq_kernel={dq_kernel!r}: 'auto', 'triton', or 'gluon' with dkv_kernel='gluon'")
    if dq_kernel == "auto":
        dq_kernel = "gluon" if gluon_dkv else "triton"
    if gluon_dkv and runs is not None:
        raise DSAInputError(f"dkv_kernel='gluon' sums every slot per query: runs must be None, got {runs}")
    # per query: one pass (mode 0); per run: dq and rowsum(dO O) (mode 1), then the slots outside
    # runs (mode 2), then the run pass; with the Gluon latent gradient, dq from the dq pass (mode 1) or
    # from Gluon (no pass). Each mode's autotuning zeroes dkv before anything else wrote it.
    if dq_kernel == "gluon":
        from kernels.dsa import sparse_attention_gluon as sag

        fused = sag.DQ_FUSED_DELTA and sag.DQ_SCHEDULE == "products"   # rowsum(dO O) formed by the query gradient
        delta = (torch.empty(lse.shape, dtype=torch.float32, device=q.device) if fused
                 else triton_sparse_mla_delta(out, grad_out))
        sag.gluon_sparse_mla_dq(q, kv, indices, grad_out, lse, delta, softmax_scale, dq, out=out if fused else None)
        modes = ()
    elif gluon_dkv:
        run_ok = scatter = dkv   # unused by the dq pass
        delta = torch.empty(batch, n_q, heads, dtype=torch.float32, device=q.device)
        modes = (1,)
    elif n_runs:
        run_ok, scatter, keys, pairs, counts, ends = run_pairs(indices, run, kv.shape[1])
        delta = torch.empty(batch, n_q, heads, dtype=torch.float32, device=q.device)
        modes = (1, 2)
    else:
        run, run_ok, scatter, delta = 0, dkv, dkv, dkv   # unused by the kernel without runs
        modes = (0,)
    block = dict(DQK=dqk, DV=d_v, BLOCK_D=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(d_v))
    for mode in modes:
        sparse_mla_bwd_kernel[_grid(n_q, heads, batch)](
            q, kv, indices, out, grad_out, lse, dq, dkv, run_ok, scatter, delta,
            q.stride(0), q.stride(1), q.stride(2),
            kv.stride(0), kv.stride(1),
            indices.stride(0), indices.stride(1),
            lse.stride(0), lse.stride(1),
            dkv.stride(0), dkv.stride(1),
            heads, indices.shape[2], n_runs, softmax_scale, softmax_scale * _LOG2E,
            RUN=run, MODE=mode, **block,
        )
    if gluon_dkv:
        from kernels.dsa.sparse_attention_gluon import gluon_sparse_mla_dkv

        gluon_sparse_mla_dkv(q, kv, indices, grad_out, lse, delta, softmax_scale, dkv)
    elif n_runs:
        n_pairs = keys.numel()
        sparse_mla_bwd_runs_kernel[(triton.cdiv(n_pairs, RUN_CHUNK),)](
            q, kv, grad_out, lse, delta, keys, pairs, counts, ends, dkv,
            kv.stride(0), kv.stride(1),
            dkv.stride(0), dkv.stride(1),
            n_pairs, batch * kv.shape[1], kv.shape[1], heads, softmax_scale, softmax_scale * _LOG2E,
            RUN=run, ROWS=RUN_ROWS, CHUNK=RUN_CHUNK, num_warps=RUN_WARPS, num_stages=RUN_STAGES, **block,
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
