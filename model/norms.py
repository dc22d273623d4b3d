"""RMSNorm of glm5_next, shared by the megatron model and the vLLM CPU plugin (plain torch only)."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32, cast back to the input dtype before the weight
    (transformers ``Glm5NextTextRMSNorm``). Shapes: ``[..., dim]`` -> ``[..., dim]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
