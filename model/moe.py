"""MoE routed experts as two grouped GEMMs (``torch._grouped_mm``) instead of one MLP per expert.

megatron's :class:`SequentialMLP` runs each local expert as its own MLP: per expert and layer a
``fc1`` GEMM, the SwiGLU and probability glue, a ``fc2`` GEMM, and as many again in backward (16
experts x 7 layers of the ``small`` preset: over 2,000 launches per step, each on a slice of the
tokens). :class:`GroupedMLP` keeps SequentialMLP's parameters (``local_experts.<i>.linear_fc1/2``:
state dicts, distributed checkpoints, the HF conversion and EP sharding are unchanged) and runs all
local experts in one ``fc1`` grouped GEMM, one pass of the glue over every routed token, and one
``fc2`` grouped GEMM. Numerics are SequentialMLP's (:func:`grouped_swiglu_experts` repeats its
clamped SwiGLU and its float32 probability product); autograd differentiates ``torch._grouped_mm``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from model.fused import glue, swiglu_probs

__all__ = ["GroupedMLP", "grouped_swiglu_experts"]


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weights[e]^T`` for every expert ``e`` in one grouped GEMM.

    The per-expert weights ``[out, in]`` are stacked inside forward and again in backward instead of
    saving the stack: autograd would keep a copy of every expert's weights per MoE layer and MLP
    chunk (48 MiB per layer call for ``small``, 5 GiB at 1M tokens in 64k chunks without recompute),
    where saving the parameters themselves costs nothing. Backward forms the products torch's own
    ``_grouped_mm`` derivative forms: ``dx = dy @ W_e`` and ``dW_e = dy_e^T @ x_e``, the latter with a
    column-major first operand (no alignment constraint on the per-expert token counts).
    """

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()   # _grouped_mm takes row- or column-major operands; a grad may arrive expanded
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(grad.transpose(-2, -1), x, offs=offs).unbind(0)
        return grad_x, None, *grad_w


def grouped_swiglu_experts(x: torch.Tensor, tokens_per_expert: torch.Tensor, fc1: list[torch.Tensor],
                           fc2: list[torch.Tensor], probs: torch.Tensor, clamp: float | None,
                           activation=torch.nn.functional.silu, linear_offset: float = 0.0,
                           compile_glue: bool = False) -> torch.Tensor:
    """Every expert's gated MLP on its contiguous block of tokens, scaled by the routing probabilities.

    Args:
        x: ``[T, h]`` tokens sorted by expert (expert ``e`` holds rows ``offs[e-1]:offs[e]``).
        tokens_per_expert: ``[E]`` integer rows per expert (any device), summing to ``T``; zeros allowed.
        fc1: ``E`` weights ``[2f, h]``, gate rows ``[:f]`` then up rows ``[f:]`` (``ColumnParallelLinear``'s).
        fc2: ``E`` weights ``[h, f]`` (``RowParallelLinear``'s).
        probs: ``[T]`` routing probability of each row (float32 from the router).
        clamp: megatron's ``activation_func_clamp_value`` (gate clamped above, up on both sides), or None.
        activation: the gate's activation (SiLU for SwiGLU); linear_offset: added to the up half.
        compile_glue: the activation glue between the GEMMs through ``torch.compile`` on CUDA
            (:func:`model.fused.swiglu_probs`).

    Returns:
        ``[T, h]`` in ``x.dtype``: ``fc2_e(act(gate) * (up + offset) * p)`` per row, the product with
        ``p`` formed in ``probs``' dtype and cast back, as megatron's MLP does.
    """
    offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0, dtype=torch.int32)
    hidden = _GroupedLinear.apply(x, offs, *fc1)
    inner = glue(swiglu_probs, compile_glue, hidden, probs, clamp, linear_offset, activation)
    return _GroupedLinear.apply(inner, offs, *fc2)


class GroupedMLP(SequentialMLP):
    """SequentialMLP's experts and parameters, computed by :func:`grouped_swiglu_experts`.

    ``forward(permuted_local_hidden_states [T, h], tokens_per_expert [E_local], permuted_probs [T])
    -> (out [T, h], None)``, as SequentialMLP; gradients reach the same parameters SequentialMLP trains.

    Raises:
        ValueError: a configuration SequentialMLP supports but the grouped path does not (expert
            biases, expert tensor parallelism, non-gated MLP, fp8/fp4, probabilities on the input).
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        c = self.config
        unsupported = {"add_bias_linear": c.add_bias_linear, "gated_linear_unit=False": not c.gated_linear_unit,
                       "fp8": bool(c.fp8), "fp4": bool(getattr(c, "fp4", None)),
                       "moe_apply_probs_on_input": c.moe_apply_probs_on_input,
                       "expert tensor parallelism": self.tp_group is not None and self.tp_group.size() > 1}
        if bad := [k for k, v in unsupported.items() if v]:
            raise ValueError(f"moe_experts='grouped' does not support {bad}; use moe_experts='sequential'")

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        c = self.config
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        out = grouped_swiglu_experts(permuted_local_hidden_states, tokens_per_expert, fc1, fc2, permuted_probs,
                                     c.activation_func_clamp_value, c.activation_func, c.glu_linear_offset,
                                     c.compile_glue)
        return out, None
