"""Triton kernels of the mHC projection (:mod:`kernels.hc.projection`): one pass over the streams each way.

``x [m, k]`` bf16 streams (``k = n * h``: 4096 for ``small``, 16384 for ``full``) against ``w [p, k]``,
``p = (2 + n) n = 24``: a skinny GEMM whose cost is reading ``x`` (and, backward, writing ``dx``). So each
kernel reads each ``x`` tile once and does everything that needs it there:

* forward (:func:`hc_projection_fwd_kernel`, one program per ``BLOCK_M`` rows): ``y = x @ w^T`` on tensor
  cores with float32 accumulation (a float32 ``w`` split into three bf16 parts in registers, exact; the two
  small parts' products in an accumulator of their own, so that their sums round at their own small
  magnitude, not at ``y``'s) and the row's sum of squares from the same tile; writes ``y``, ``rstd`` and
  ``out = y * rstd``.
* ``dx`` (:func:`hc_projection_dx_kernel`, one program per ``BLOCK_M`` rows and ``DX_COLUMNS`` columns, a loop
  over ``DX_BLOCK_K``-wide tiles): ``dy = grad * rstd`` and the RMS term's coefficient from the row's ``grad``
  and ``y``, once; per tile ``dy @ w`` from
  two-part splits (``hi.w + lo.w``; ``hi.w_hi + hi.w_lo + lo.w_hi`` for a float32 ``w``; the low parts'
  products in their own accumulator); minus the RMS term in float32; with ``EXTRA``, plus the streams'
  other gradients of an mHC block (the collapse's and the merge's, :class:`model.layers.HyperConnection`);
  one bf16 rounding.
* ``dw`` (:func:`hc_projection_dw_kernel`, one program per ``BLOCK_K`` columns and slice of the rows):
  ``dy^T @ x`` with ``dy`` in two parts (each part's products in its own accumulator), float32 partial sums
  per slice, summed in a fixed order by torch (deterministic: no atomics).

The tiles are fixed (no autotuning, nothing to tune at a cold start): ``BLOCK_M = 64`` rows, ``BLOCK_K = 128``
columns (32 in the ``dx`` kernel, 1024 per ``dx`` program), ``p`` padded to a power of two >= 16 (the weight as
float32 with zero rows: its tiles load unmasked and are split into bf16 in registers, :func:`_padded_weight` says
why). Triton's casts round (``x.to(bf16)`` is round-to-nearest-even), unlike inductor's fused ones, which is why
these kernels and not a compiled graph split the operands.
Checked against float64 on an H200 by ``tests/gpu/hc_projection_check.py``. Triton's CPU interpreter has
no bfloat16, so ``tests/test_hc_projection_interpreter.py`` runs a float32 copy of this source there: the
indexing, masks and arithmetic, not the bf16 splits (the torch reference has those).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_K, WARPS, STAGES = 64, 128, 4, 3
# The dx kernel's tiles: 64 rows x 32 columns, a loop over DX_COLUMNS columns per program. dy's split and the RMS
# coefficient are formed once per 64 rows instead of once per tile, and the loop lets the compiler load the next
# tile while this one's products run. One 64 x 64 tile per program (65,536 programs at 64k x 4096) ran at a third
# of the copy rate: 1.39 ms per call on an H100 for the 1.66 GB it moves (docs/measurements.md). In the loop,
# 64-column tiles with a float32 weight and the mHC block's added gradients take 232 registers per thread (2
# CTAs per SM, ptxas for sm_90, kernels.dsa.sm90); 32-column tiles take 126 (4 CTAs per SM), no spill either way.
DX_BLOCK_K = 32
DX_COLUMNS = 1024
DW_PROGRAMS_PER_SM = 4


@triton.jit
def _split_dy(GRAD, Y, RSTD, rows, cols, m, p, stride_g, stride_y):
    """``dy`` of the rows ``[BLOCK_M, BLOCK_P]`` as bf16 ``(hi, lo)``, and the RMS term's coefficient
    ``sum(grad * y) * rstd^3`` ``[BLOCK_M]`` (float32)."""
    ok = (rows[:, None] < m) & (cols[None, :] < p)
    g = tl.load(GRAD + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0)
    y = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rows < m, other=0.0)
    dy = g * rstd[:, None]
    hi = dy.to(tl.bfloat16)
    lo = (dy - hi.to(tl.float32)).to(tl.bfloat16)
    coef = tl.sum(g * y, axis=1) * rstd * rstd * rstd
    return hi, lo, coef


@triton.jit
def hc_projection_fwd_kernel(
    X, W, OUT, Y, RSTD, m, k, p, eps, stride_x, stride_w, stride_o, stride_y,
    W_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)   # the small parts' products: their own, small roundings
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0)
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
        # [BLOCK_K, BLOCK_P] float32 w^T (W has BLOCK_P rows, zeros past p), split into bf16 in registers
        w = tl.load(W + cols[None, :] * stride_w + ks[:, None], mask=ks[:, None] < k, other=0.0)
        hi = w.to(tl.bfloat16)
        acc = tl.dot(x, hi, acc)
        if W_PARTS == 3:   # a float32 weight: three bf16 parts are exact for normal values
            rest = w - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc_lo = tl.dot(x, mid, acc_lo)
            acc_lo = tl.dot(x, lo, acc_lo)
    acc += acc_lo
    rstd = tl.rsqrt(squares / k + eps)
    ok = (rows[:, None] < m) & (cols[None, :] < p)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], acc, mask=ok)
    tl.store(OUT + rows[:, None] * stride_o + cols[None, :], acc * rstd[:, None], mask=ok)
    tl.store(RSTD + rows, rstd, mask=rows < m)


@triton.jit
def hc_projection_dx_kernel(
    GRAD, Y, RSTD, X, W, DX, PRE, DB, DS, m, k, p, h, k_per_program, stride_g, stride_y, stride_x, stride_w,
    stride_dx, stride_pre, stride_db, stride_ds,
    W_PARTS: tl.constexpr, EXTRA: tl.constexpr, STREAM_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_P)
    # dy's two parts and the RMS coefficient once per row block, then a loop over this program's columns
    hi, lo, coef = _split_dy(GRAD, Y, RSTD, rows, cols, m, p, stride_g, stride_y)
    coef = coef / k                                                            # d rstd / dx = -rstd^3 x / k
    k_start = tl.program_id(1) * k_per_program
    k_end = tl.minimum(k_start + k_per_program, k)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ok = (rows[:, None] < m) & (ks[None, :] < k_end)
        # the streams' tiles first: their loads are in flight while the products below run
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=ok, other=0.0).to(tl.float32)
        if EXTRA:   # the streams' other two gradients: the collapse's pre[i] * d(block input), and the merge's
            if STREAM_TILES:   # BLOCK_K divides h: the tile lies in one stream, pre is one value per row
                stream = k0 // h
                pre = tl.load(PRE + rows * stride_pre + stream, mask=rows < m, other=0.0)[:, None]
                db = tl.load(DB + rows[:, None] * stride_db + (ks - stream * h)[None, :], mask=ok, other=0.0)
            else:
                streams = ks // h
                pre = tl.load(PRE + rows[:, None] * stride_pre + streams[None, :], mask=ok, other=0.0)
                db = tl.load(DB + rows[:, None] * stride_db + (ks - streams * h)[None, :], mask=ok, other=0.0)
            ds = tl.load(DS + rows[:, None] * stride_ds + ks[None, :], mask=ok, other=0.0)
        # [BLOCK_P, BLOCK_K]
        w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=ks[None, :] < k_end, other=0.0)
        w_hi = w.to(tl.bfloat16)
        acc = tl.dot(hi, w_hi)
        acc_lo = tl.dot(lo, w_hi)
        if W_PARTS == 3:
            acc_lo = tl.dot(hi, (w - w_hi.to(tl.float32)).to(tl.bfloat16), acc_lo)
        dx = (acc + acc_lo) - coef[:, None] * x
        if EXTRA:
            dx += pre * db.to(tl.float32) + ds.to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + ks[None, :], dx.to(DX.dtype.element_ty), mask=ok)


@triton.jit
def hc_projection_dw_kernel(
    GRAD, Y, RSTD, X, PART, m, k, p, rows_per_slice, stride_g, stride_y, stride_x, stride_ps, stride_pp,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_K], tl.float32)
    acc_lo = tl.zeros([BLOCK_P, BLOCK_K], tl.float32)
    first = part.to(tl.int64) * rows_per_slice
    for r0 in range(0, rows_per_slice, BLOCK_M):
        rows = first + r0 + tl.arange(0, BLOCK_M)
        hi, lo, _ = _split_dy(GRAD, Y, RSTD, rows, cols, m, p, stride_g, stride_y)
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0)
        acc = tl.dot(tl.trans(hi), x, acc)
        acc_lo = tl.dot(tl.trans(lo), x, acc_lo)
    tl.store(PART + part * stride_ps + cols[:, None] * stride_pp + ks[None, :], acc + acc_lo,
             mask=(cols[:, None] < p) & (ks[None, :] < k))


def _block_p(p: int) -> int:
    return max(16, triton.next_power_of_2(p))


def _padded_weight(w: torch.Tensor, block_p: int) -> torch.Tensor:
    """``w [p, k]`` as float32 ``[block_p, k]``, zero rows past ``p``: the kernels load whole ``[block_p, BLOCK_K]``
    float32 tiles and split them into bf16 in registers.

    A bf16 weight is widened too, not loaded straight into ``tl.dot``: measured on an H200, that pipelined
    load (``num_stages`` 3) gave wrong ``y`` (errors up to 0.5 on values of 14) that differed from run to run at
    65,536 rows, while ``num_stages`` 1 and the widened weight gave the same correct bits
    (``tests/gpu/hc_projection_diag.py``, ``docs/measurements.md``). Widening is exact, and the weight is
    ``p x k``: a few hundred KB."""
    padded = w.new_zeros(block_p, w.shape[1], dtype=torch.float32)
    padded[: w.shape[0]] = w
    return padded


def triton_hc_projection_fwd(x: torch.Tensor, w: torch.Tensor, eps: float):
    """``(out, y, rstd)`` of :func:`kernels.hc.projection.torch_hc_projection_fwd` for contiguous CUDA ``x [m, k]``
    bf16 and ``w [p, k]`` (bf16 or float32)."""
    m, k = x.shape
    p = w.shape[0]
    out = torch.empty(m, p, device=x.device, dtype=torch.float32)
    y = torch.empty_like(out)
    rstd = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    bp = _block_p(p)
    wp = _padded_weight(w, bp)
    hc_projection_fwd_kernel[(triton.cdiv(m, BLOCK_M),)](
        x, wp, out, y, rstd, m, k, p, eps, x.stride(0), wp.stride(0), out.stride(0), y.stride(0),
        W_PARTS=3 if w.dtype == torch.float32 else 1, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_P=bp,
        num_warps=WARPS, num_stages=STAGES)
    return out, y, rstd


def launch_dx(grad, y, rstd, x, wp, dx, pre, block_grad, streams_grad, h: int, w_parts: int, extra: bool,
              columns: int = DX_COLUMNS) -> None:
    """Write ``dx [m, k]`` with :func:`hc_projection_dx_kernel`: one program per ``BLOCK_M`` rows and ``columns``
    columns (a multiple of ``DX_BLOCK_K``), the arguments as :func:`triton_hc_projection_bwd` prepares them
    (``wp`` the padded float32 weight; ``pre``, ``block_grad``, ``streams_grad`` unread without ``extra``).

    Raises:
        ValueError: ``columns`` is not a multiple of ``DX_BLOCK_K``.
    """
    if columns % DX_BLOCK_K:
        raise ValueError(f"launch_dx: columns per program must be a multiple of {DX_BLOCK_K}, got {columns}")
    m, k = x.shape
    hc_projection_dx_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(k, columns))](
        grad, y, rstd, x, wp, dx, pre, block_grad, streams_grad, m, k, grad.shape[1], h, columns, grad.stride(0),
        y.stride(0), x.stride(0), wp.stride(0), dx.stride(0), pre.stride(0), block_grad.stride(0),
        streams_grad.stride(0), W_PARTS=w_parts, EXTRA=extra, STREAM_TILES=extra and h % DX_BLOCK_K == 0,
        BLOCK_M=BLOCK_M, BLOCK_K=DX_BLOCK_K, BLOCK_P=wp.shape[0], num_warps=WARPS, num_stages=STAGES)


def triton_hc_projection_bwd(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                             rstd: torch.Tensor, pre: torch.Tensor | None = None,
                             block_grad: torch.Tensor | None = None, streams_grad: torch.Tensor | None = None):
    """``(dx, dw)`` of :func:`kernels.hc.projection.torch_hc_projection_bwd` for contiguous CUDA tensors, with its
    optional terms (``pre``, ``block_grad``, ``streams_grad``: all three or none) added in the ``dx`` kernel."""
    m, k = x.shape
    p = w.shape[0]
    bp = _block_p(p)
    dx = torch.empty_like(x)
    wp = _padded_weight(w, bp)
    extra = pre is not None
    h = block_grad.shape[1] if extra else k
    pre, block_grad, streams_grad = (pre, block_grad, streams_grad) if extra else (x, x, x)   # unread without EXTRA
    launch_dx(grad, y, rstd, x, wp, dx, pre, block_grad, streams_grad, h, 3 if w.dtype == torch.float32 else 1, extra)
    # enough row slices for a few programs per SM, each a whole number of row blocks
    col_blocks = triton.cdiv(k, BLOCK_K)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    slices = max(1, min(triton.cdiv(m, BLOCK_M), triton.cdiv(DW_PROGRAMS_PER_SM * sms, col_blocks)))
    rows_per_slice = triton.cdiv(triton.cdiv(m, slices), BLOCK_M) * BLOCK_M
    slices = triton.cdiv(m, rows_per_slice)
    part = torch.empty(slices, p, k, device=x.device, dtype=torch.float32)
    hc_projection_dw_kernel[(col_blocks, slices)](
        grad, y, rstd, x, part, m, k, p, rows_per_slice, grad.stride(0), y.stride(0), x.stride(0),
        part.stride(0), part.stride(1), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_P=bp,
        num_warps=WARPS, num_stages=STAGES)
    return dx, part.sum(0).to(w.dtype)
