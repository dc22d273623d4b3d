"""Sparse MLA attention over indexer-selected tokens, absorbed (MQA) form, with backward.

DeepSeek-V3.2 (arXiv 2512.02556) runs the sparse attention of DSA in MLA's MQA mode:
the per-head query is absorbed through ``W_UK`` into the ``kv_lora_rank`` latent, every
head attends to the same latent ``kv`` of the selected tokens, and the output latent is
projected through ``W_UV`` afterwards (FlashMLA ``sparse`` kernels). glm5_next's DSA
layers are NoPE-MLA (``qk_rope_head_dim = 0``), so ``Dqk = d_v = kv_lora_rank`` there.

:func:`sparse_mla_attention` is the public entry (an ``autograd.Function``): Triton
kernels on CUDA (:mod:`kernels.dsa.sparse_attention_triton`; optionally the warp-specialized Gluon
forward and latent gradient of :mod:`kernels.dsa.sparse_attention_gluon`), the blockwise torch path
below elsewhere. Neither path builds a ``T x S`` matrix: the forward gathers the ``K``
selected latents of a block of queries, the backward recomputes the probabilities from
the saved log-sum-exp and scatter-adds into ``dkv``. The dense definition is
:func:`kernels.dsa.naive.naive_sparse_mla_attention`.
"""

from __future__ import annotations

import torch

from kernels.dsa.errors import DSAInputError

__all__ = ["sparse_mla_attention", "choose_kernels"]

KERNELS = ("auto", "triton", "gluon")


def choose_kernels(fwd_kernel: str, dkv_kernel: str, runs: int | None, gluon_why: str | None) -> tuple[str, str]:
    """The CUDA forward and latent-gradient kernels ``"triton"`` / ``"gluon"`` that ``"auto"`` stands for.

    ``"auto"`` is the warp-specialized Gluon kernel wherever it runs (``gluon_why is None``: Hopper, a multiple of
    64 heads, ``d_v == Dqk <= 512``, at least one index slot) and Triton elsewhere; the latent gradient stays
    Triton when ``runs`` asks for the per-pool sum, which only the Triton kernel does. One H100, ``full`` shape
    (64 heads, 512 wide), 64k tokens (``tests/benchmarks/sparse_mla_tilings.py``, matmul anchor 797 TF/s):
    forward 46.6 ms Gluon vs 70.3 ms Triton; backward 233 ms (``dq`` pass + Gluon latent gradient) vs 403 ms
    (Triton per query). The Gluon latent gradient brings the Gluon query gradient with it (213 ms for the backward,
    anchor 781: :func:`kernels.dsa.sparse_attention_triton.triton_sparse_mla_bwd`). An explicit ``"gluon"`` is
    kept as given, so an input it cannot run raises.

    Args:
        fwd_kernel, dkv_kernel: ``"auto"``, ``"triton"`` or ``"gluon"``.
        runs: the k-pool hint of :func:`sparse_mla_attention` (``None``: per query).
        gluon_why: why the Gluon kernels cannot run these inputs, ``None`` when they can
            (:func:`kernels.dsa.sparse_attention_gluon.gluon_supported`).

    Returns:
        ``(fwd, dkv)``, each ``"triton"`` or ``"gluon"``.
    """
    fwd = fwd_kernel if fwd_kernel != "auto" else ("triton" if gluon_why else "gluon")
    dkv = dkv_kernel if dkv_kernel != "auto" else ("triton" if gluon_why or runs is not None else "gluon")
    return fwd, dkv


def _gluon_why(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> str | None:
    if not q.is_cuda:   # the Gluon module (and Triton) are not imported for CPU tensors
        return "a CUDA device"
    from kernels.dsa.sparse_attention_gluon import gluon_supported

    return gluon_supported(q, kv, d_v, indices)


def _check_attention_inputs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> None:
    if q.ndim != 4 or kv.ndim != 3:
        raise DSAInputError(f"q must be [B, T, H, Dqk] and kv [B, S, Dqk], got {tuple(q.shape)} and {tuple(kv.shape)}")
    if kv.shape[0] != q.shape[0] or kv.shape[2] != q.shape[3]:
        raise DSAInputError(f"kv {tuple(kv.shape)} does not match q {tuple(q.shape)} in batch or Dqk")
    if indices.ndim != 3 or indices.shape[:2] != q.shape[:2]:
        raise DSAInputError(f"indices must be [B, T, K] = [{q.shape[0]}, {q.shape[1]}, K], got {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise DSAInputError(f"indices must be int32 or int64, got {indices.dtype}")
    if not 0 < d_v <= kv.shape[2]:
        raise DSAInputError(f"d_v must be in 1..{kv.shape[2]}, got {d_v}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gather_block(kv: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected latents ``[B, t, K, Dqk]`` (zeros where -1) and the validity mask ``[B, t, K]``."""
    valid = idx >= 0
    batch_index = torch.arange(kv.shape[0], device=kv.device)[:, None, None]
    gathered = kv[batch_index, idx.long().clamp_min(0)].to(dtype)
    return gathered * valid[..., None], valid


def _block_scores(q_blk: torch.Tensor, kv_blk: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.einsum("bthd,btkd->bthk", q_blk, kv_blk) * scale
    return scores.masked_fill(~valid[:, :, None, :], float("-inf"))


def torch_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v, block_size=64, pool_mass=None):
    """Blockwise forward: ``out [B, T, H, d_v]`` (q.dtype), ``lse [B, T, H]`` (float64 for
    float64 inputs so that gradcheck-level backwards stay exact, else float32), and with
    ``pool_mass=(kpool, n_pools)`` the pool mass ``[B, T, n_pools]`` (as ``sparse_mla_attention``)."""
    batch, n_q, heads, _ = q.shape
    dtype = _compute_dtype(q)
    out = torch.empty(batch, n_q, heads, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_q, heads, dtype=torch.promote_types(dtype, torch.float32), device=q.device)
    kpool, n_pools = pool_mass or (1, 0)
    mass = torch.empty(batch, n_q, n_pools, dtype=lse.dtype, device=q.device)
    for t0 in range(0, n_q, block_size):
        t1 = min(t0 + block_size, n_q)
        kv_blk, valid = _gather_block(kv, indices[:, t0:t1], dtype)
        scores = _block_scores(q[:, t0:t1].to(dtype), kv_blk, valid, softmax_scale)
        lse_blk = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse_blk.masked_fill(torch.isinf(lse_blk), 0.0)[..., None])
        out[:, t0:t1] = torch.einsum("bthk,btkv->bthv", probs, kv_blk[..., :d_v]).to(q.dtype)
        lse[:, t0:t1] = lse_blk
        if n_pools:
            slots = probs[..., : n_pools * kpool].sum(2)   # [B, t, n_pools * kpool], summed over heads
            mass[:, t0:t1] = slots.view(batch, t1 - t0, n_pools, kpool).sum(-1)
    return (out, lse, mass) if pool_mass else (out, lse)


def torch_sparse_mla_bwd(q, kv, indices, out, lse, grad_out, softmax_scale, d_v, block_size=64):
    """Blockwise backward: ``dq`` like q, ``dkv`` like kv (scatter-added in float32/64)."""
    dtype = _compute_dtype(q)
    batch, n_q, _, _ = q.shape
    n_keys = kv.shape[1]
    dq = torch.empty_like(q)
    dkv = torch.zeros(batch * n_keys, kv.shape[2], dtype=dtype, device=kv.device)
    delta = (grad_out.to(dtype) * out.to(dtype)).sum(-1)  # [B, T, H]
    for t0 in range(0, n_q, block_size):
        t1 = min(t0 + block_size, n_q)
        idx = indices[:, t0:t1]
        kv_blk, valid = _gather_block(kv, idx, dtype)
        q_blk = q[:, t0:t1].to(dtype)
        do_blk = grad_out[:, t0:t1].to(dtype)
        scores = _block_scores(q_blk, kv_blk, valid, softmax_scale)
        lse_blk = lse[:, t0:t1].to(dtype)
        probs = torch.exp(scores - lse_blk.masked_fill(torch.isinf(lse_blk), 0.0)[..., None])
        dprobs = torch.einsum("bthv,btkv->bthk", do_blk, kv_blk[..., :d_v])
        dscores = probs * (dprobs - delta[:, t0:t1, :, None].to(dtype)) * softmax_scale
        dq[:, t0:t1] = torch.einsum("bthk,btkd->bthd", dscores, kv_blk).to(q.dtype)
        dkv_blk = torch.einsum("bthk,bthd->btkd", dscores, q_blk)
        dkv_blk[..., :d_v] += torch.einsum("bthk,bthv->btkv", probs, do_blk)
        rows = idx.long().clamp_min(0) + n_keys * torch.arange(batch, device=kv.device)[:, None, None]
        dkv.index_add_(0, rows[valid], dkv_blk[valid])
    return dq, dkv.view(batch, n_keys, -1).to(kv.dtype)


class _SparseMLAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, runs, precomputed=None, fwd_kernel="triton",
                dkv_kernel="triton", pool_mass=None):
        if precomputed is not None:   # (out, lse) of an earlier forward on the same inputs
            result = precomputed
        elif q.is_cuda and fwd_kernel == "gluon":
            from kernels.dsa.sparse_attention_gluon import gluon_sparse_mla_fwd

            result = gluon_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v)
        elif q.is_cuda:
            from kernels.dsa.sparse_attention_triton import triton_sparse_mla_fwd

            result = triton_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v, pool_mass=pool_mass)
        else:
            result = torch_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v, pool_mass=pool_mass)
        out, lse, mass = (*result, None)[:3]   # the mass where the forward folded it in
        if pool_mass and mass is None:   # a forward that does not fold it in (Gluon, precomputed): one more pass
            if q.is_cuda:
                from kernels.dsa.sparse_attention_triton import triton_sparse_mla_pool_mass

                mass = triton_sparse_mla_pool_mass(q, kv, indices, lse, softmax_scale, *pool_mass)
            else:
                mass = torch_sparse_mla_fwd(q, kv, indices, softmax_scale, d_v, pool_mass=pool_mass)[2]
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.softmax_scale, ctx.d_v, ctx.runs, ctx.dkv_kernel = softmax_scale, d_v, runs, dkv_kernel
        lse = lse.float()
        ctx.mark_non_differentiable(lse)
        if mass is None:
            return out, lse
        mass = mass.float()
        ctx.mark_non_differentiable(mass)
        return out, lse, mass

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_mass=None):
        q, kv, indices, out, lse = ctx.saved_tensors
        if q.is_cuda:
            from kernels.dsa.sparse_attention_triton import triton_sparse_mla_bwd

            dq, dkv = triton_sparse_mla_bwd(q, kv, indices, out, lse, grad_out.contiguous(), ctx.softmax_scale, ctx.d_v,
                                            ctx.runs, ctx.dkv_kernel)
        else:
            dq, dkv = torch_sparse_mla_bwd(q, kv, indices, out, lse, grad_out, ctx.softmax_scale, ctx.d_v)
        return dq, dkv, None, None, None, None, None, None, None, None


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int,
    runs: int | None = None, precomputed: tuple[torch.Tensor, torch.Tensor] | None = None,
    fwd_kernel: str = "auto", dkv_kernel: str = "auto", pool_mass: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Attention of every head over the selected tokens of one shared MLA latent.

    ``out[b, t, h] = sum_{s in sel(b, t)} softmax_s(softmax_scale * q[b, t, h] . kv[b, s]) * kv[b, s, :d_v]``

    Args:
        q: absorbed queries ``[B, T, H, Dqk]`` (``q_nope @ W_UK`` per head).
        kv: latent ``[B, S, Dqk]`` (``kv_a_layernorm`` output), shared by all heads.
        indices: ``[B, T, K]`` int32/int64 token indices into ``S``, ``-1`` skipped, each
            valid index at most once per row (the indexer's output satisfies this).
        softmax_scale: usually ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` of the
            un-absorbed head (the absorption does not change the logits).
        d_v: value width, the value of token ``s`` is ``kv[b, s, :d_v]``.
        runs: the k-pool size when ``indices`` has the indexer's layout (slots ``[r * runs,
            (r + 1) * runs)`` one pool's consecutive tokens or ``-1``, then the tail): the CUDA
            backward then sums each pool's ``dkv`` over the queries that selected it instead of
            scatter-adding per query (:mod:`kernels.dsa.sparse_attention_triton`). Only a hint:
            slots that do not form such runs are handled per query, so the result is the same
            for any indices. ``None``: per query. The values and the CPU path do not depend on it.
        precomputed: ``(out, lse)`` this function returned earlier for the same inputs (a full-layer
            recompute that kept them): returned again, with the backward of these inputs, and the
            forward not run. The caller guarantees the inputs are the same (a deterministic recompute).
        fwd_kernel: the CUDA forward, ``"triton"`` (:mod:`kernels.dsa.sparse_attention_triton`), ``"gluon"``
            (:mod:`kernels.dsa.sparse_attention_gluon`, warp-specialized; Hopper, a multiple of 64 heads,
            ``d_v == Dqk <= 512``, else :class:`DSAInputError`) or ``"auto"`` (Gluon where it runs, else
            Triton: :func:`choose_kernels`). The CPU path does not depend on it.
        dkv_kernel: the CUDA backward's latent gradient, ``"triton"`` (per query or per ``runs``), ``"gluon"``
            (every slot per query, 64 heads per program: :func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dkv`,
            with ``dq`` from :func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dq`;
            ``runs`` must be ``None``; same conditions as ``fwd_kernel="gluon"``) or ``"auto"`` (Gluon where it
            runs and ``runs`` is ``None``, else Triton).
        pool_mass: ``(kpool, n_pools)``: also return each query's attention mass per pool of slots,
            ``mass[b, t, j] = sum_h sum_{r < kpool} P[b, t, h, j * kpool + r]`` (the DSA indexer KL's target
            before its normalization, :func:`kernels.dsa.indexer_kl_loss`). The Triton and CPU forwards fold it
            into their softmax; after the Gluon forward or with ``precomputed`` it is one pass of
            :func:`kernels.dsa.sparse_attention_triton.triton_sparse_mla_mass`. ``None``: not computed.

    Returns:
        ``out [B, T, H, d_v]`` in ``q.dtype`` and ``lse [B, T, H]`` float32 (natural log;
        ``-inf`` for a row without a valid index, whose ``out`` is 0), and with ``pool_mass`` the mass
        ``[B, T, n_pools]`` float32. ``lse`` and the mass carry no gradient. Differentiable in ``q`` and ``kv``.

    Raises:
        DSAInputError: on inconsistent shapes or dtypes, an unknown ``fwd_kernel`` or ``dkv_kernel``, ``runs``
            with ``dkv_kernel="gluon"``, or ``pool_mass`` pools past the index width.
    """
    _check_attention_inputs(q, kv, indices, d_v)
    for name, kernel in (("fwd_kernel", fwd_kernel), ("dkv_kernel", dkv_kernel)):
        if kernel not in KERNELS:
            raise DSAInputError(f"{name}={kernel!r}; valid: {', '.join(map(repr, KERNELS))}")
    if dkv_kernel == "gluon" and runs is not None:
        raise DSAInputError(f"dkv_kernel='gluon' sums every slot per query: runs must be None, got {runs}")
    if runs is not None and not 0 < runs <= indices.shape[2]:
        raise DSAInputError(f"runs must be in 1..{indices.shape[2]} (the index width) or None, got {runs}")
    if pool_mass is not None and not (pool_mass[0] >= 1 and pool_mass[1] >= 1
                                      and pool_mass[0] * pool_mass[1] <= indices.shape[2]):
        raise DSAInputError(f"pool_mass (kpool, n_pools) = {pool_mass} must be positive and cover at most "
                            f"{indices.shape[2]} slots (the index width)")
    if precomputed is not None:
        out, lse = precomputed
        if out.shape != (*q.shape[:3], d_v) or lse.shape != q.shape[:3]:
            raise DSAInputError(f"precomputed out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match "
                                f"q {tuple(q.shape)} and d_v={d_v}")
    if "auto" in (fwd_kernel, dkv_kernel):
        fwd_kernel, dkv_kernel = choose_kernels(fwd_kernel, dkv_kernel, runs, _gluon_why(q, kv, indices, d_v))
    return _SparseMLAAttention.apply(q, kv, indices, softmax_scale, d_v, runs, precomputed, fwd_kernel, dkv_kernel,
                                     pool_mass)
