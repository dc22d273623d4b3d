"""MoE routed experts as two grouped GEMMs (``torch._grouped_mm``) instead of one MLP per expert, and
the token permutation around them as row gathers.

megatron's :class:`SequentialMLP` runs each local expert as its own MLP: per expert and layer a
``fc1`` GEMM, the SwiGLU and probability glue, a ``fc2`` GEMM, and as many again in backward (16
experts x 7 layers of the ``small`` preset: over 2,000 launches per step, each on a slice of the
tokens). :class:`GroupedMLP` keeps SequentialMLP's parameters (``local_experts.<i>.linear_fc1/2``:
state dicts, distributed checkpoints, the HF conversion and EP sharding are unchanged) and runs all
local experts in one ``fc1`` grouped GEMM, one pass of the glue over every routed token, and one
``fc2`` grouped GEMM. Numerics are SequentialMLP's (:func:`grouped_swiglu_experts` repeats its
clamped SwiGLU and its float32 probability product); autograd differentiates ``torch._grouped_mm``.

:class:`GatherTokenDispatcher` is megatron's allgather dispatcher with the permutation done by
gathers in both directions. megatron's unfused path scatters with ``scatter_add_`` (combine) and
``index_add_`` (the permutation's backward): bf16 atomics, four colliding rows per token, 2.3 ms
and 1.0 ms per ``small`` MoE layer at 64k on an H200, against ~0.3 ms for a gather; and it reads
the per-expert counts back to the host (a device sync per MoE layer) to size its output. With every
expert local, each token is routed to exactly ``topk`` rows, so the output size is known on the
host and the reverse map is a ``[tokens, topk]`` table of row positions.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from model.fused import glue, swiglu, swiglu_probs

__all__ = ["SwiGLUActivation", "GroupedMLP", "grouped_swiglu_experts", "GatherTokenDispatcher", "GatherMoELayer",
           "permutation_maps"]


class SwiGLUActivation(torch.nn.Module):
    """The clamped SwiGLU of megatron's ``MLP`` as the module in its activation slot
    (``MLPSubmodules.activation_func``, called by ``MLP.forward`` when ``config.use_te_activation_func``).

    ``forward(hidden [..., 2f]) -> [..., f]`` in ``hidden``'s dtype: :func:`model.fused.swiglu` with the
    config's ``activation_func``, ``activation_func_clamp_value`` and ``glu_linear_offset``, through
    ``torch.compile`` on CUDA when ``config.compile_glue`` (:func:`model.fused.glue`). megatron's own
    gated path runs the two clamps, the activation, the offset add and the product as separate eager
    kernels, and its backward another five (``where``/``le``/``ge`` per clamp): 10 ms of a 64k ``small``
    step on an H200 for the dense MLP and the seven shared experts (``docs/measurements.md``).
    The dense MLP, the shared experts and megatron's SequentialMLP experts all take it
    (:func:`model.glm5_next.layer_spec`), so every MLP of the model runs this one definition.
    """

    def __init__(self, config):
        super().__init__()
        self.activation = config.activation_func
        self.clamp = config.activation_func_clamp_value
        self.offset = config.glu_linear_offset
        self.compile = config.compile_glue

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return glue(swiglu, self.compile, hidden, self.clamp, self.offset, self.activation)


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


def permutation_maps(routing_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-major order of the routed (token, expert) pairs and its inverse.

    Args:
        routing_map: ``[N, E]`` bool, exactly ``topk`` True per row (top-k routing, no capacity drop).
        topk: experts per token.

    Returns:
        ``(order [N*topk], rows [N*topk], inverse [N, topk])`` int64: ``order`` the flat positions
        ``e * N + t`` of the pairs sorted by expert then token (megatron's ``permute`` order);
        ``rows = order % N`` the token of each permuted row; ``inverse[t]`` the permuted rows of
        token ``t`` in expert order, so ``rows[inverse[t, j]] == t``.
    """
    n = routing_map.shape[0]
    order = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[: n * topk]
    rows = order % n
    return order, rows, rows.argsort(stable=True).view(n, topk)


def _gather_sum(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j x[inverse[t, j]]``: ``x [N*k, h]``, ``inverse [N, k]`` -> ``[N, h]`` in ``x.dtype``
    (summed in float32 by torch's reduction)."""
    n, k = inverse.shape
    return x.index_select(0, inverse.reshape(-1)).view(n, k, x.shape[-1]).sum(1)


class _Permute(torch.autograd.Function):
    """``tokens [N, h] -> tokens[rows] [N*k, h]``; backward sums each token's ``k`` row gradients
    by a gather (:func:`_gather_sum`), not atomics."""

    @staticmethod
    def forward(ctx, tokens, rows, inverse):
        ctx.save_for_backward(inverse)
        return tokens.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _gather_sum(grad.contiguous(), inverse), None, None


class _Unpermute(torch.autograd.Function):
    """``permuted [N*k, h] -> [N, h]``, each token the sum of its ``k`` expert rows (a gather, not
    ``scatter_add_``); backward gathers ``grad[rows]``."""

    @staticmethod
    def forward(ctx, permuted, rows, inverse):
        ctx.save_for_backward(rows)
        return _gather_sum(permuted, inverse)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, rows), None, None


class GatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's allgather dispatcher with the local permutation and its reverse done by gathers.

    ``dispatch_postprocess(hidden [N, h], probs [N, E]) -> (permuted [N*topk, h], tokens_per_expert
    [E] int64 on the device, permuted_probs [N*topk])`` and ``combine_preprocess(expert_out [N*topk, h])
    -> [N, h]``, in megatron's order and with its values; the sums over a token's experts are formed
    in float32 and rounded once (megatron's ``scatter_add_`` rounds after every bf16 add). The
    communication (``token_dispatch`` / ``token_combine`` over TP x EP) is megatron's.

    Raises:
        ValueError: not every expert is local (expert parallelism: a token's rows are split
            across ranks), or a capacity factor may drop tokens.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        if not self.applies(num_local_experts, config):
            raise ValueError(f"moe_permute='gather' needs every expert local ({num_local_experts} of "
                             f"{config.num_moe_experts} here) and no capacity factor (moe_expert_capacity_factor="
                             f"{config.moe_expert_capacity_factor} can drop tokens); use moe_permute='megatron'")

    @staticmethod
    def applies(num_local_experts: int, config) -> bool:
        """Whether each token has exactly ``topk`` local rows: every expert local, no capacity drop."""
        return num_local_experts == config.num_moe_experts and config.moe_expert_capacity_factor is None

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        routing_map = self.routing_map
        order, rows, self._inverse = permutation_maps(routing_map, self.router_topk)
        self._rows = rows
        tokens_per_expert = routing_map.sum(dim=0)
        permuted = _Permute.apply(hidden_states, rows, self._inverse)
        self.local_probs = probs.T.reshape(-1).index_select(0, order)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        out = _Unpermute.apply(hidden_states, self._rows, self._inverse)
        self._rows = self._inverse = None
        return out

    def combine_postprocess(self, hidden_states):
        # token_combine read local_probs (its dtype); kept past the layer it would hold the step's autograd
        # graph, and through the gradient hooks on that graph the whole model, after the step and the run
        self.local_probs = None
        return super().combine_postprocess(hidden_states)


class GatherMoELayer(MoELayer):
    """megatron's MoELayer whose allgather dispatcher is a :class:`GatherTokenDispatcher` when
    ``config.moe_permute == "gather"`` and the gathers apply: every expert local (no expert
    parallelism) and no capacity factor. Other layouts keep megatron's dispatcher (the alltoall one
    under expert parallelism, or the allgather one with its ``permute``), which computes the same."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        pg_collection = pg_collection or get_default_pg_collection()   # as MoELayer resolves it
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         **kwargs)
        if (config.moe_permute == "gather" and type(self.token_dispatcher) is MoEAllGatherTokenDispatcher
                and GatherTokenDispatcher.applies(self.num_local_experts, config)):
            self.token_dispatcher = GatherTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                          config=config, pg_collection=pg_collection)
