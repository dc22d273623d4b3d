"""The mHC projection ``rsqrt(mean(x^2) + eps) * (x @ w^T)`` of bf16 streams with float32 accuracy.

glm5_next's hyper-connections (``Glm5NextTextHyperConnection``) project the RMS-normalised,
flattened residual streams ``x [m, k]`` (``k = n * h``) onto ``p = (2 + n) n`` mixing logits. The
float32 definition runs on float32 copies of bf16 streams: FFMA GEMMs on a GPU. Here the GEMMs run on
bf16 tensor cores with float32 accumulation; a float32 operand enters as bf16 parts (:func:`bf16_parts`:
three parts are exact, two keep about 16 bits), so the forward is the float32 GEMM up to summation order
and the gradients are within bf16 rounding of ``dx`` and float32 accumulation of ``dw``.

Both directions are custom ops (``torch.library``): ``torch.compile`` calls them as they are. Traced
into a graph, inductor fuses ``part.float()`` of ``rest.to(bf16)`` without the rounding (its default,
``emulate_precision_casts=False``), so the low parts of a split come out zero and the gradients bf16-level
(``tests/test_model_fused.py::test_hc_projection_compiled_by_inductor_keeps_its_low_parts``). On CUDA the
ops run the Triton kernels of :mod:`kernels.hc.projection_triton` (one pass over ``x`` each way, the RMS
fused in); elsewhere the torch code below, which is also their reference.
"""

from __future__ import annotations

import torch

__all__ = ["bf16_parts", "hc_projection", "hc_projection_parts", "hc_projection_streams_grad",
           "torch_hc_projection_fwd", "torch_hc_projection_bwd"]


def bf16_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x`` (float32) as ``parts`` bf16 tensors stacked ``[parts, *x.shape]`` whose float32 sum approximates it.

    Each part is the bf16 rounding of what the previous ones leave: 2 parts keep about 16 of float32's
    24 mantissa bits, 3 parts all of them for normal values (so ``sum`` is ``x`` exactly). The split of
    float32 operands into bf16 pieces for tensor-core GEMMs (Henry, Tang, Heinecke, "Leveraging the bfloat16
    Artificial Intelligence Datatype For Higher-Precision Computations", ARITH 2019).
    """
    out, rest = [], x.float()
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return torch.stack(out)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 ``a [m, k]`` and ``b [k, n]`` as float32 ``[m, n]``: the products in float32 (exact for
    bf16 x bf16) with float32 sums."""
    return a.float() @ b.float()


def _weight_parts(w: torch.Tensor, parts: int) -> torch.Tensor:
    """``w`` as stacked bf16 parts ``[r, *w.shape]``: itself when already bf16, else :func:`bf16_parts`."""
    return w[None] if w.dtype == torch.bfloat16 else bf16_parts(w, parts)


def torch_hc_projection_fwd(x: torch.Tensor, w: torch.Tensor, eps: float):
    """Reference forward: ``(out, y, rstd)`` for bf16 ``x [m, k]`` and ``w [p, k]`` (bf16 or float32):
    ``y = x @ w^T`` float32 ``[m, p]`` (against three bf16 parts of a float32 ``w``), ``rstd`` float32
    ``[m, 1]``, ``out = y * rstd``."""
    p = w.shape[0]
    parts = _weight_parts(w, 3)
    y = _mm_f32(x, parts.flatten(0, 1).t()).unflatten(-1, (len(parts), p)).sum(-2)    # [m, p]
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)                  # [m, 1]
    return y * rstd, y, rstd


def torch_hc_projection_bwd(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                            rstd: torch.Tensor, pre: torch.Tensor | None = None,
                            block_grad: torch.Tensor | None = None, streams_grad: torch.Tensor | None = None):
    """Reference backward: ``(dx, dw)`` (``x``'s and ``w``'s dtypes) from the float32 gradient ``grad [m, p]``
    of ``out``. ``dy = grad * rstd`` in two bf16 parts (and a float32 ``w`` in two), the three larger products
    of the split summed on tensor cores; the RMS term's gradient added in float32 before ``dx``'s one rounding.

    With ``pre [m, n]`` float32, ``block_grad [m, h]`` and ``streams_grad [m, n * h]`` (all three or none; ``k = n
    * h``), ``dx`` also holds ``pre[:, i] * block_grad`` in its ``i``-th ``h`` columns plus ``streams_grad``, summed
    in float32 before the rounding: the streams' gradient of an mHC block (:class:`model.layers.HyperConnection`)."""
    p, k = w.shape
    dy = grad * rstd                                              # [m, p]
    d_rstd = (grad * y).sum(-1, keepdim=True)                     # [m, 1]
    hi, lo = bf16_parts(dy, 2)
    # dy @ w to ~16 bits of each operand in one GEMM: hi.w + lo.w for a bf16 w, else
    # hi.w_hi + hi.w_lo + lo.w_hi.
    if w.dtype == torch.bfloat16:
        a, b = torch.cat([hi, lo], dim=-1), torch.cat([w, w], dim=0)
    else:
        w_hi, w_lo = bf16_parts(w, 2)
        a, b = torch.cat([hi, hi, lo], dim=-1), torch.cat([w_hi, w_lo, w_hi], dim=0)
    dx = _mm_f32(a, b) - (d_rstd * rstd.pow(3) / k) * x.float()   # d rstd / dx = -rstd^3 x / k
    if pre is not None:
        dx = dx + streams_grad.float() + (pre[:, :, None] * block_grad.float()[:, None, :]).flatten(1)
    dw = _mm_f32(torch.cat([hi, lo], dim=-1).t(), x).unflatten(0, (2, p)).sum(0)   # [p, k]
    return dx.to(x.dtype), dw.to(w.dtype)


@torch.library.custom_op("megabase::hc_projection_fwd", mutates_args=())
def _fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from kernels.hc.projection_triton import triton_hc_projection_fwd

        return triton_hc_projection_fwd(x, w, eps)
    return torch_hc_projection_fwd(x, w, eps)


@_fwd.register_fake
def _(x, w, eps):
    m, p = x.shape[0], w.shape[0]
    return (x.new_empty(m, p, dtype=torch.float32), x.new_empty(m, p, dtype=torch.float32),
            x.new_empty(m, 1, dtype=torch.float32))


@torch.library.custom_op("megabase::hc_projection_bwd", mutates_args=())
def _bwd(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from kernels.hc.projection_triton import triton_hc_projection_bwd

        return triton_hc_projection_bwd(grad, x, w, y, rstd)
    return torch_hc_projection_bwd(grad, x, w, y, rstd)


@_bwd.register_fake
def _(grad, x, w, y, rstd):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, _ = inputs
    _, y, rstd = output
    ctx.save_for_backward(x, w, y, rstd)


def _backward(ctx, grad, _grad_y, _grad_rstd):
    # y and rstd are saved for the backward, never used outside hc_projection: only out's gradient flows.
    x, w, y, rstd = ctx.saved_tensors
    dx, dw = _bwd(grad.float().contiguous(), x, w, y, rstd)
    return dx, dw, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def hc_projection(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The mHC projection of RMS-normalised streams, ``rsqrt(mean(x^2) + eps) * (x @ w^T)``, from bf16 streams
    on bf16 tensor cores.

    Args:
        x: ``[..., k]`` bf16, the flattened streams (``k = n * h``).
        w: ``[p, k]`` bf16 or float32, the projection ``fn`` (``p = (2 + n) n <= 64``).
        eps: RMS epsilon.

    Returns:
        float32 ``[..., p]``. Forward: float32 accumulation against ``w`` itself (bf16) or its three bf16
        parts (float32 ``w``, exact): the float32 GEMM's result up to summation order. Backward: ``dx``
        (bf16) and ``dw`` (``w``'s dtype) from two-part splits of the gradient (and of a float32 ``w``):
        relative error about 2^-16 per product, below ``dx``'s bf16 rounding and ``dw``'s float32
        accumulation over ``m`` rows; the RMS term's gradient is added in float32 before ``dx``'s one rounding.

    Raises:
        ValueError: ``x`` is not bf16, ``w`` neither bf16 nor float32, or ``p > 64``.
    """
    if x.dtype != torch.bfloat16 or w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"hc_projection takes bf16 streams and a bf16 or float32 weight, got {x.dtype} and {w.dtype}")
    if w.shape[0] > 64:
        raise ValueError(f"hc_projection takes at most 64 outputs (p = (2 + n) n), got {w.shape[0]}")
    lead = x.shape[:-1]
    out, _, _ = _fwd(x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous(), eps)
    return out.reshape(*lead, w.shape[0])


def hc_projection_parts(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [m, p], rstd [m, 1])``, float32, of :func:`hc_projection`'s forward on ``x [m, k]`` bf16 (``out = y *
    rstd``), without autograd: for a caller that differentiates with :func:`hc_projection_streams_grad`."""
    _, y, rstd = _fwd(x, w, eps)
    return y, rstd


def hc_projection_streams_grad(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                               rstd: torch.Tensor, pre: torch.Tensor, block_grad: torch.Tensor,
                               streams_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole gradient of an mHC block's streams in one pass over them, and the projection's weight gradient.

    Args:
        grad: ``[m, p]`` float32, the gradient of ``out = y * rstd`` (the mixing logits).
        x: ``[m, n * h]`` bf16, the flattened streams; w: ``[p, n * h]`` bf16 or float32.
        y, rstd: :func:`hc_projection_parts` of ``x`` and ``w``.
        pre: ``[m, n]`` float32, the collapse weights; block_grad: ``[m, h]``, the gradient of the collapsed block
            input ``sum_i pre[:, i] * x_i``; streams_grad: ``[m, n * h]``, the streams' gradient from their other
            consumers (the merge after the block).

    Returns:
        ``(dx [m, n * h]`` in ``x``'s dtype, ``dw`` in ``w``'s): the projection's ``dx`` plus ``pre[:, i] *
        block_grad`` in stream ``i``'s columns plus ``streams_grad``, summed in float32 and rounded once
        (:func:`torch_hc_projection_bwd` is the definition; on CUDA the Triton ``dx`` kernel adds the two terms
        where it writes ``dx``: the three bf16 gradients are never summed by separate kernels).
    """
    args = (grad.float().contiguous(), x, w, y, rstd, pre.contiguous(), block_grad.contiguous(),
            streams_grad.contiguous())
    if x.is_cuda:
        from kernels.hc.projection_triton import triton_hc_projection_bwd

        return triton_hc_projection_bwd(*args)
    return torch_hc_projection_bwd(*args)
