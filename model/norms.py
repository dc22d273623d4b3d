"""RMSNorm of glm5_next, shared by the megatron model and the vLLM CPU plugin (plain torch only)."""

from __future__ import annotations

import torch

from model.fused import glue, rms_norm, rms_norm_backward


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in float32, saving only ``x`` and ``rstd``.

    Plain autograd would keep a float32 copy of ``x`` and of the normalised ``x`` (8 bytes per
    element on top of the input); this saves the input in its own dtype and one float32 ``rstd``
    per row (as Apex/megatron's fused RMSNorm), and recomputes the rest in backward
    (:func:`model.fused.rms_norm_backward`; both directions fused on GPUs when ``compile``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, compile: bool) -> torch.Tensor:
        out, rstd = glue(rms_norm, compile, x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.compile = compile
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = glue(rms_norm_backward, ctx.compile, grad, x, weight, rstd)
        return (grad_x if ctx.needs_input_grad[0] else None), (grad_weight if ctx.needs_input_grad[1] else None), None, None


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32, cast back to the input dtype before the weight
    (transformers ``Glm5NextTextRMSNorm``). Shapes: ``[..., dim]`` -> ``[..., dim]``.

    Under autograd it saves the input (its dtype) and a float32 ``rstd`` per row only
    (:class:`_RMSNormFunction`); without grad it is the plain expression. ``compile_glue``: fuse
    forward and backward with ``torch.compile`` on CUDA tensors (:func:`model.fused.glue`).
    """

    def __init__(self, dim: int, eps: float, compile_glue: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.compile_glue = compile_glue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps, self.compile_glue)
        return glue(rms_norm, self.compile_glue, x, self.weight, self.eps)[0]
