"""RMSNorm of glm5_next, shared by the megatron model and the vLLM CPU plugin (plain torch only)."""

from __future__ import annotations

import torch


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in float32, saving only ``x`` and ``rstd``.

    Plain autograd would keep a float32 copy of ``x`` and of the normalised ``x`` (8 bytes per
    element on top of the input); this saves the input in its own dtype and one float32 ``rstd``
    per row (as Apex/megatron's fused RMSNorm), and recomputes the rest in backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # the forward's product saw xhat rounded to x's dtype
            grad_weight = (g * xhat.to(x.dtype).float()).flatten(0, -2).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gxhat = (g * weight.float()).to(x.dtype).float()  # autograd rounds this grad to x's dtype
            grad_x = (rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32, cast back to the input dtype before the weight
    (transformers ``Glm5NextTextRMSNorm``). Shapes: ``[..., dim]`` -> ``[..., dim]``.

    Under autograd it saves the input (its dtype) and a float32 ``rstd`` per row only
    (:class:`_RMSNormFunction`); without grad it is the plain expression.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
