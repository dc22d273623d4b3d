"""The mHC maps of the projected logits in one Triton kernel each way: sigmoid gates and the Sinkhorn-Knopp ``comb``.

:func:`model.fused.hc_maps_of_logits` is the definition (and the CPU path): from ``mixed [T, (2+n)n]`` float32,
``pre = sigmoid(mixed_pre * s0 + b_pre) + eps``, ``post = 2 sigmoid(mixed_post * s1 + b_post)`` and ``comb`` = the
row softmax of ``mixed_comb * s2 + b_comb`` plus ``eps``, normalised over its columns once and then ``iters - 1``
times over rows and columns (Sinkhorn-Knopp; Xie et al. 2026, mHC). Each token's ``n x n`` matrix is tiny (16
values at ``n = 4``), and the chain is ``2 iters - 1 = 39`` dependent normalisations: under ``torch.compile``
inductor emitted one kernel per normalisation, 3,088 launches of 2-5 us per 64k ``small`` step (8.6 ms of
GPU time and launch-bound gaps between them, H200 trace). Here one program keeps ``BLOCK_T`` tokens' matrices in
registers for the whole chain.

The backward recomputes the chain instead of storing its 39 intermediate matrices: for step ``k`` from the last
down, the forward is rerun from the softmax to step ``k - 1`` and the gradient passed back through step ``k``
(``(2 iters - 1)^2 / 2`` normalisations per token, about 760 at 20 iterations: a few hundred float32 operations
per value, no scratch memory, the same values as the forward). A column normalisation ``out = c / (colsum(c) +
eps)`` passes ``g`` back as ``(g - colsum(g * out)) / (colsum(c) + eps)``; a row one likewise over rows; the
softmax as ``s * (g - rowsum(g * s))``.

The kernels take ``n`` up to ``NP`` (``n`` rounded up to a power of two; padded entries are held at zero) and
produce the gradient with respect to the affine logits ``z = mixed * scale + base``; :func:`triton_hc_maps_bwd`
turns it into the gradients of ``mixed``, ``base`` and ``scale``. Checked under Triton's CPU interpreter
(float32 throughout, so exactly what runs on a GPU) against autograd of the definition in float64 by
``tests/test_hc_kernels_interpreter.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 64


@triton.jit
def _tokens(T, n, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's token rows ``[BLOCK_T]`` (int64), their mask, the stream index ``[NP]`` and the ``[BLOCK_T,
    NP]`` mask of real tokens and streams."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok = rows < T
    i = tl.arange(0, NP)
    return rows, tok, i, tok[:, None] & (i[None, :] < n)


@triton.jit
def _gate(MIXED, BASE, SCALE, rows, i, ok, n, stride_m, PART: tl.constexpr):
    """``sigmoid(z)`` of the pre (``PART`` 0) or post (1) logits ``z`` ``[BLOCK_T, NP]``, ``z`` zero past ``n``."""
    z = tl.load(MIXED + rows[:, None] * stride_m + PART * n + i[None, :], mask=ok, other=0.0)
    return tl.sigmoid(z * tl.load(SCALE + PART) + tl.load(BASE + PART * n + i, mask=i < n, other=0.0)[None, :])


@triton.jit
def _comb_softmax(MIXED, BASE, SCALE, rows, tok, n, stride_m, NP: tl.constexpr):
    """The row softmax ``[BLOCK_T, NP, NP]`` of the comb logits (zero outside ``n x n``) and its validity mask."""
    ii = tl.arange(0, NP)[None, :, None]
    jj = tl.arange(0, NP)[None, None, :]
    valid = (ii < n) & (jj < n)
    off = 2 * n + ii * n + jj
    z = tl.load(MIXED + rows[:, None, None] * stride_m + off, mask=tok[:, None, None] & valid, other=0.0)
    z = z * tl.load(SCALE + 2) + tl.load(BASE + off, mask=valid, other=0.0)
    # padded columns take no mass; padded rows get a finite row (ignored) so that no row is all -inf
    z = tl.where(valid, z, tl.where(jj < n, 0.0, float("-inf")))
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    s = tl.where(valid, e / tl.sum(e, axis=2)[:, :, None], 0.0)
    return s, valid


@triton.jit
def _denominator(c, eps, AXIS: tl.constexpr):
    """The sums of ``c [BLOCK_T, NP, NP]`` along ``AXIS`` (1: each column over its rows, 2: each row over its
    columns) plus ``eps``, broadcastable against ``c``."""
    if AXIS == 1:
        d = (tl.sum(c, axis=1) + eps)[:, None, :]
    else:
        d = (tl.sum(c, axis=2) + eps)[:, :, None]
    return d


@triton.jit
def _normalize(c, eps, AXIS: tl.constexpr):
    """``c`` over :func:`_denominator` along ``AXIS``."""
    return c / _denominator(c, eps, AXIS)


@triton.jit
def _normalize_grad(c, g, eps, AXIS: tl.constexpr):
    """The gradient at ``c`` of :func:`_normalize` along ``AXIS`` for the output gradient ``g``: ``(g - sum(g *
    out)) / d`` with the sum along ``AXIS``, ``out = c / d``."""
    d = _denominator(c, eps, AXIS)
    if AXIS == 1:
        r = (g - tl.sum(g * (c / d), axis=1)[:, None, :]) / d
    else:
        r = (g - tl.sum(g * (c / d), axis=2)[:, :, None]) / d
    return r


@triton.jit
def hc_maps_fwd_kernel(MIXED, BASE, SCALE, PRE, POST, COMB, T, n, iters, eps, stride_m,
                       NP: tl.constexpr, BLOCK_T: tl.constexpr):
    rows, tok, i, ok = _tokens(T, n, NP, BLOCK_T)
    tl.store(PRE + rows[:, None] * n + i[None, :], _gate(MIXED, BASE, SCALE, rows, i, ok, n, stride_m, 0) + eps,
             mask=ok)
    tl.store(POST + rows[:, None] * n + i[None, :], 2 * _gate(MIXED, BASE, SCALE, rows, i, ok, n, stride_m, 1),
             mask=ok)
    s, valid = _comb_softmax(MIXED, BASE, SCALE, rows, tok, n, stride_m, NP)
    c = _normalize(tl.where(valid, s + eps, 0.0), eps, 1)
    for _ in range(iters - 1):
        c = _normalize(c, eps, 2)
        c = _normalize(c, eps, 1)
    ii = tl.arange(0, NP)[None, :, None]
    jj = tl.arange(0, NP)[None, None, :]
    tl.store(COMB + rows[:, None, None] * (n * n) + ii * n + jj, c, mask=tok[:, None, None] & valid)


@triton.jit
def hc_maps_bwd_kernel(MIXED, BASE, SCALE, DPRE, DPOST, DCOMB, DZ, PRE, T, n, steps, eps, stride_m, stride_dz,
                       NP: tl.constexpr, BLOCK_T: tl.constexpr):
    rows, tok, i, ok = _tokens(T, n, NP, BLOCK_T)
    sig = _gate(MIXED, BASE, SCALE, rows, i, ok, n, stride_m, 0)
    tl.store(PRE + rows[:, None] * n + i[None, :], sig + eps, mask=ok)   # the caller's collapse weights
    g = tl.load(DPRE + rows[:, None] * n + i[None, :], mask=ok, other=0.0)
    tl.store(DZ + rows[:, None] * stride_dz + i[None, :], g * sig * (1 - sig), mask=ok)
    sig = _gate(MIXED, BASE, SCALE, rows, i, ok, n, stride_m, 1)
    g = tl.load(DPOST + rows[:, None] * n + i[None, :], mask=ok, other=0.0)
    tl.store(DZ + rows[:, None] * stride_dz + n + i[None, :], 2 * g * sig * (1 - sig), mask=ok)

    s, valid = _comb_softmax(MIXED, BASE, SCALE, rows, tok, n, stride_m, NP)
    c0 = tl.where(valid, s + eps, 0.0)
    ii = tl.arange(0, NP)[None, :, None]
    jj = tl.arange(0, NP)[None, None, :]
    mask = tok[:, None, None] & valid
    g = tl.load(DCOMB + rows[:, None, None] * (n * n) + ii * n + jj, mask=mask, other=0.0)
    # steps 1..K (K = steps): step 1 and every odd step normalise columns, even steps rows
    for back in range(steps):
        k = steps - back
        c = c0
        for m in range(1, k):   # the input of step k
            if m % 2 == 1:
                c = _normalize(c, eps, 1)
            else:
                c = _normalize(c, eps, 2)
        if k % 2 == 1:
            g = _normalize_grad(c, g, eps, 1)
        else:
            g = _normalize_grad(c, g, eps, 2)
        g = tl.where(valid, g, 0.0)   # padded entries divide by eps alone: keep them from growing to inf * 0
    dz = tl.where(valid, s * (g - tl.sum(g * s, axis=2)[:, :, None]), 0.0)
    tl.store(DZ + rows[:, None, None] * stride_dz + 2 * n + ii * n + jj, dz, mask=mask)


def _check(mixed: torch.Tensor, n: int):
    if mixed.dtype != torch.float32 or mixed.shape[-1] != (2 + n) * n:
        raise ValueError(f"the mHC maps take float32 logits [..., (2+n)n] = [..., {(2 + n) * n}], "
                         f"got {mixed.dtype} {tuple(mixed.shape)}")


def triton_hc_maps_fwd(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                       hc_eps: float):
    """``(pre [..., n], post [..., n], comb [..., n, n])`` float32 of ``mixed [..., (2+n)n]`` float32, with ``base
    [(2+n)n]`` and ``scale [3]``: :func:`model.fused.hc_maps_of_logits` in one kernel.

    Raises:
        ValueError: ``mixed`` is not float32 or its last dimension is not ``(2 + n) n``.
    """
    _check(mixed, n)
    lead = mixed.shape[:-1]
    flat = mixed.reshape(-1, mixed.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    t = flat.shape[0]
    pre = torch.empty(t, n, dtype=torch.float32, device=mixed.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=mixed.device)
    if t:
        hc_maps_fwd_kernel[(triton.cdiv(t, BLOCK_T),)](
            flat, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, t, n, iters, hc_eps,
            flat.stride(0), NP=triton.next_power_of_2(n), BLOCK_T=BLOCK_T, num_warps=4)
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


def triton_hc_maps_bwd(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                       hc_eps: float, d_pre: torch.Tensor, d_post: torch.Tensor, d_comb: torch.Tensor):
    """Gradients ``(d_mixed [..., (2+n)n], d_base [(2+n)n], d_scale [3])``, float32, of
    :func:`triton_hc_maps_fwd` for the output gradients ``d_pre``, ``d_post`` (``[..., n]``) and ``d_comb`` (``[...,
    n, n]``); ``None`` for an unused output; and ``pre [..., n]`` (float32, as the forward gives it), which the
    kernel computes on the way and an mHC block's backward needs. The kernel gives the gradient of the affine
    logits ``z``; ``d_mixed = dz * scale``, ``d_base = sum_t dz`` and ``d_scale`` (per group) ``= sum_t dz *
    mixed`` follow in torch.

    Raises:
        ValueError: as :func:`triton_hc_maps_fwd`.
    """
    _check(mixed, n)
    flat = mixed.reshape(-1, mixed.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    t, p = flat.shape

    def grad(g, width):
        if g is None:
            return torch.zeros(t, width, dtype=torch.float32, device=mixed.device)
        return g.reshape(t, width).float().contiguous()

    dz = torch.empty(t, p, dtype=torch.float32, device=mixed.device)
    pre = torch.empty(t, n, dtype=torch.float32, device=mixed.device)
    if t:
        hc_maps_bwd_kernel[(triton.cdiv(t, BLOCK_T),)](
            flat, base.float().contiguous(), scale.float().contiguous(), grad(d_pre, n), grad(d_post, n),
            grad(d_comb, n * n), dz, pre, t, n, 1 + 2 * max(iters - 1, 0), hc_eps, flat.stride(0), dz.stride(0),
            NP=triton.next_power_of_2(n), BLOCK_T=BLOCK_T, num_warps=4)
    s = scale.float()
    col_scale = torch.cat([s[0].expand(n), s[1].expand(n), s[2].expand(n * n)])   # no host-built index tensor
    d_scale = torch.stack([part.sum() for part in (dz * flat).split([n, n, n * n], dim=-1)])
    return ((dz * col_scale).view(mixed.shape), dz.sum(0).to(base.dtype), d_scale.to(scale.dtype),
            pre.view(*mixed.shape[:-1], n))
