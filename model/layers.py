"""glm5_next building blocks on megatron-core: norms, mHC, the KDA mixer and the DSA mixer.

Every module takes megatron's ``[s, b, h]`` layout (sequence first) and tensor-parallel linears
(``ColumnParallelLinear`` / ``RowParallelLinear``): heads are split over TP ranks, the small
low-rank/gate projections and the DSA indexer are replicated. The mixers receive the parallel
layout (:class:`model.parallel.ParallelLayout`) as an argument and read no parallel globals. Numerics follow transformers'
``modeling_glm5_next.py`` (the reference of the parity tests), module by module as named below.
"""

from __future__ import annotations

import collections
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule

from kernels.hc.projection import hc_projection_parts, hc_projection_streams_grad
from model.config import Glm5NextConfig
from model.fused import (gated_rms_norm, glue, hc_collapse, hc_collapse_weight_grad, hc_maps_of_logits, hc_merge,
                         hc_merge_backward, hc_streams_grad_float32, kda_gate, tensor_core_projection)
from model.norms import RMSNorm
from model.ops.kda import chunk_kda_torch
from model.parallel import CPContext, ParallelLayout, all_gather_seq

__all__ = ["RMSNorm", "HyperConnection", "merge_streams", "KDAMixer", "DSAMixer", "fold_cp_states", "recompute",
           "init_normal"]


def init_normal(std: float):
    """Initialiser drawing weights from ``N(0, std^2)`` (megatron's ``init_method``)."""
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def _bmm_token_major(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = a[t, h] @ b[h]`` for ``a [T, H, i]``, ``b [H, i, j]`` -> contiguous ``[T, H, j]``.

    One batched GEMM over heads whose output is a strided view of the token-major result (row stride
    ``H * j``, batch stride ``j``): cuBLAS writes it in place, where ``einsum`` leaves a head-major
    ``[H, T, j]`` result that the next consumer copies.
    """
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[-1])
    torch.bmm(a.transpose(0, 1), b, out=out.transpose(0, 1))
    return out


class _PerHeadMatmul(torch.autograd.Function):
    """``y [b, s, H, j] = x [b, s, H, i] @ w [H, i, j]`` per head, ``y`` and ``dx`` contiguous token-major.

    The MLA absorbed forms (DeepSeek-V2, arXiv:2405.04434, section 2.1.3): the query times ``W_UK`` and the
    latent output times ``W_UV``. Their consumers (the sparse MLA kernels, ``o_proj``, ``q_b_proj``'s
    backward) read ``[tokens, H * width]`` rows; ``einsum`` gave them head-major tensors and each took a copy
    (six of ``q W_UK``'s 512 MiB per 64k ``small`` step on an H200, ~4 ms). ``dw [H, i, j]`` is one batched
    GEMM over heads of strided views, no copy.
    """

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _bmm_token_major(x.flatten(0, 1), w).view(*x.shape[:3], w.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.flatten(0, 1)
        dx = _bmm_token_major(g, w.transpose(1, 2)).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(x.flatten(0, 1).permute(1, 2, 0), g.transpose(0, 1)) if ctx.needs_input_grad[1] else None
        return dx, dw


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [b, s, H, i] @ w [H, i, j]`` per head -> contiguous ``[b, s, H, j]`` in ``x``'s dtype
    (``einsum("bshi,hij->bshj")`` without its head-major output; :class:`_PerHeadMatmul`).

    Raises:
        ValueError: ``x`` and ``w`` disagree on the head count or the inner width.
    """
    if x.dim() != 4 or w.dim() != 3 or x.shape[2] != w.shape[0] or x.shape[3] != w.shape[1]:
        raise ValueError(f"per_head_matmul: x [b, s, H, i] and w [H, i, j], got {tuple(x.shape)} and {tuple(w.shape)}")
    return _PerHeadMatmul.apply(x.contiguous(), w)


class _Recompute(torch.autograd.Function):
    """``fn(*tensors)`` that saves only ``tensors`` (via ``ctx.save_for_backward``) and reruns ``fn`` in backward.

    For cheap elementwise/float32 sections whose intermediates cost more memory than their
    recompute (the KDA gate and gated norm): plain autograd keeps float32 copies of
    ``[s, b, width]`` tensors at every step. Parameters used by ``fn`` must be among ``tensors``
    so their gradients flow. Saved tensors go through the saved-tensor hooks, so activation
    offload (:class:`model.offload.OffloadActivations`) still moves them.
    """

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
            outs = ctx.fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return (None, *(next(got) if need else None for need in needs))


def recompute(fn, *tensors):
    """``fn(*tensors)``, recomputed in backward instead of saving its intermediates (:class:`_Recompute`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Recompute.apply(fn, *tensors)
    return fn(*tensors)


def _triton_mhc(t: torch.Tensor) -> bool:
    """Whether the mHC maps and the merge's backward on ``t`` run as the Triton kernels of :mod:`kernels.hc` (CUDA
    tensors; a test of their wiring forces it under Triton's CPU interpreter)."""
    return t.is_cuda


class _MergeFn(torch.autograd.Function):
    """:func:`model.fused.hc_merge` with its backward in one pass (:mod:`kernels.hc.merge_triton` on CUDA,
    :func:`model.fused.hc_merge_backward` elsewhere); the forward is the glue function (compiled on GPUs). Saves
    the same tensors as autograd of the merge would: ``post``, ``comb``, the block output and the streams."""

    @staticmethod
    def forward(ctx, post, comb, out, streams, compile_glue):
        ctx.save_for_backward(post, comb, out, streams)
        ctx.compile_glue = compile_glue
        return glue(hc_merge, compile_glue, post, comb, out, streams)

    @staticmethod
    def backward(ctx, grad):
        post, comb, out, streams = ctx.saved_tensors
        if _triton_mhc(streams):
            from kernels.hc.merge_triton import triton_hc_merge_bwd

            return (*triton_hc_merge_bwd(grad, post, comb, out, streams), None)
        return (*glue(hc_merge_backward, ctx.compile_glue, grad, post, comb, out, streams), None)


def merge_streams(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
                  compile_glue: bool) -> torch.Tensor:
    """The next residual streams ``[s, b, n, h]`` of an mHC block (:func:`model.fused.hc_merge`; ``post [s, b, n]``,
    ``comb [s, b, n, n]`` float32, the block output ``out [s, b, h]``), differentiable through :class:`_MergeFn`."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (post, comb, out, streams)):
        return _MergeFn.apply(post, comb, out, streams, compile_glue)
    return glue(hc_merge, compile_glue, post, comb, out, streams)


class _HyperConnectionFn(torch.autograd.Function):
    """One mHC block's maps and collapse, differentiated as a whole (:class:`HyperConnection`).

    ``forward(streams [s, b, n, h], fn, base, scale, hc) -> (post, comb, collapsed, streams)``: the last output is
    the input itself, returned so that the merge after the block (its only other consumer) reads it through this
    node. The streams then have one consumer, and ``backward`` receives their three gradients at once (the
    maps', the collapse's and the merge's) and sums them where it writes the streams' gradient: on CUDA with
    bf16 streams inside the projection's ``dx`` kernel (:func:`kernels.hc.projection.hc_projection_streams_grad`),
    elsewhere in :func:`model.fused.hc_streams_grad_float32`. Autograd would otherwise add the three bf16
    ``[s, b, n, h]`` gradients with two separate kernels (32 adds, ~13 ms of a 64k ``small`` step on an
    H200). Saved: the streams and the projection's ``y [s, b, p]``, ``rstd [s, b, 1]`` (float32); the maps are
    recomputed from them in backward (``p = (2+n)n`` values per token). On CUDA the maps and their gradient are
    one Triton kernel each (:mod:`kernels.hc.maps_triton`: the Sinkhorn-Knopp chain in registers).
    """

    @staticmethod
    def run(streams, fn, base, scale, hc):
        """The forward's values without autograd: ``(post, comb, collapsed, y, rstd)``."""
        flat = streams.flatten(-2)
        if tensor_core_projection(streams, hc.gemm):
            y, rstd = hc_projection_parts(flat.reshape(-1, flat.shape[-1]).contiguous(), fn.contiguous(), hc.norm_eps)
            y, rstd = y.view(*flat.shape[:-1], -1), rstd.view(*flat.shape[:-1], 1)
        else:
            f32 = flat.float()
            rstd = torch.rsqrt(f32.square().mean(-1, keepdim=True) + hc.norm_eps)
            y = F.linear(f32, fn.float())
        pre, post, comb = _HyperConnectionFn.maps(y * rstd, base, scale, hc)
        return post, comb, glue(hc_collapse, hc.compile_glue, pre, streams), y, rstd

    @staticmethod
    def maps(mixed, base, scale, hc):
        """``(pre, post, comb)`` of the logits ``mixed``: one Triton kernel on CUDA (:mod:`kernels.hc.maps_triton`),
        else the torch definition."""
        if _triton_mhc(mixed):
            from kernels.hc.maps_triton import triton_hc_maps_fwd

            return triton_hc_maps_fwd(mixed, base, scale, hc.n, hc.iters, hc.hc_eps)
        return glue(hc_maps_of_logits, hc.compile_glue, mixed, base, scale, hc.n, hc.iters, hc.hc_eps)

    @staticmethod
    def forward(ctx, streams, fn, base, scale, hc):
        post, comb, collapsed, y, rstd = _HyperConnectionFn.run(streams, fn, base, scale, hc)
        ctx.hc = hc
        ctx.save_for_backward(streams, fn, base, scale, y, rstd)
        return post, comb, collapsed, streams

    @staticmethod
    def backward(ctx, d_post, d_comb, d_collapsed, d_streams):
        streams, fn, base, scale, y, rstd = ctx.saved_tensors
        hc = ctx.hc
        mixed = y * rstd
        if d_collapsed is None:
            d_collapsed = streams.new_zeros(*streams.shape[:-2], streams.shape[-1])
        d_streams = torch.zeros_like(streams) if d_streams is None else d_streams
        d_pre = glue(hc_collapse_weight_grad, hc.compile_glue, d_collapsed, streams)
        if _triton_mhc(mixed):
            from kernels.hc.maps_triton import triton_hc_maps_bwd

            d_mixed, d_base, d_scale, pre = triton_hc_maps_bwd(mixed, base, scale, hc.n, hc.iters, hc.hc_eps,
                                                               d_pre, d_post, d_comb)
        else:
            with torch.enable_grad():
                leaves = (mixed.requires_grad_(), base.detach().requires_grad_(), scale.detach().requires_grad_())
                pre, post, comb = glue(hc_maps_of_logits, hc.compile_glue, *leaves, hc.n, hc.iters, hc.hc_eps)
            outs = [(o, g) for o, g in ((pre, d_pre), (post, d_post), (comb, d_comb)) if g is not None]
            d_mixed, d_base, d_scale = torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs])
            pre = pre.detach()
        if tensor_core_projection(streams, hc.gemm):
            m, n, h = streams.shape[:-2].numel(), streams.shape[-2], streams.shape[-1]
            d_flat, d_fn = hc_projection_streams_grad(
                d_mixed.reshape(m, -1), streams.reshape(m, n * h), fn, y.reshape(m, -1), rstd.reshape(m, 1),
                pre.reshape(m, n), d_collapsed.reshape(m, h), d_streams.reshape(m, n * h))
            d_in = d_flat.view_as(streams)
        else:
            d_in, d_fn = glue(hc_streams_grad_float32, hc.compile_glue, d_mixed, y, rstd, streams, fn, pre,
                              d_collapsed, d_streams)
        return d_in, d_fn, d_base, d_scale, None


class HyperConnection(torch.nn.Module):
    """Manifold-constrained hyper-connection weights (mHC, Xie et al. 2026; ``Glm5NextTextHyperConnection``).

    From the ``n = hc_mult`` residual streams ``[s, b, n, h]`` it computes ``pre`` (collapse the
    streams into the block input), ``post`` (expand the block output back into streams) and a
    doubly-stochastic ``comb`` (mix the residual streams; ``hc_sinkhorn_iters`` Sinkhorn-Knopp
    normalisations). Parameters ``fn [(2+n)n, n*h]``, ``base [(2+n)n]``, ``scale [3]``; float32.

    ``forward(streams)`` returns ``(post [s, b, n], comb [s, b, n, n], collapsed [s, b, h], streams)``, float32
    maps; the layer output is ``post[..., None] * block_out[..., None, :] + comb^T @ streams`` with the returned
    ``streams`` (the same values, through this block's autograd node: :class:`_HyperConnectionFn` sums all of
    the streams' gradients in one pass).
    """

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.n, self.iters = n, config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = config.hc_eps, config.layernorm_epsilon
        self.compile_glue, self.gemm = config.compile_glue, config.hc_gemm
        self.fn = torch.nn.Parameter(torch.empty((2 + n) * n, n * h))
        self.base = torch.nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = torch.nn.Parameter(torch.ones(3))
        torch.nn.init.normal_(self.fn, std=0.02)

    def forward(self, streams: torch.Tensor):
        if torch.is_grad_enabled():
            return _HyperConnectionFn.apply(streams, self.fn, self.base, self.scale, self)
        return (*_HyperConnectionFn.run(streams, self.fn, self.base, self.scale, self)[:3], streams)


def _depthwise_causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None,
                           backend: str = "auto") -> torch.Tensor:
    """SiLU(causal depthwise conv) of ``x [b, s, c]`` with ``weight [c, K]``; ``history [b, K-1, c]``
    holds the inputs before token 0 (zeros if None), as ``causal_conv1d_fn`` with its state.

    ``y[t, c] = silu(sum_j weight[c, j] * x[t - K + 1 + j, c])``, returned ``[b, s, c]`` contiguous in
    ``x.dtype``. On CUDA with ``backend="auto"``: fla's Triton ``causal_conv1d`` (fla 0.6.0,
    ``fla/modules/causal_conv1d``) on the ``[b, s, c]`` layout with the SiLU fused and summed in float32;
    its backward returns the history's gradient too (context parallelism). Otherwise
    (CPU, or ``backend="torch"``): ``torch.nn.functional.conv1d`` with ``groups=c`` on a transposed copy.
    """
    K = weight.shape[-1]
    if x.is_cuda and backend == "auto":
        from fla.modules.causal_conv1d import causal_conv1d

        # fla's state is the last K inputs before token 0, [b, c, K]; its column 0 is never read.
        state = None if history is None else F.pad(history.to(x.dtype).transpose(1, 2), (1, 0))
        return causal_conv1d(x, weight, initial_state=state, activation="silu")[0]
    if history is None:
        history = x.new_zeros(x.shape[0], K - 1, x.shape[-1])
    xp = torch.cat([history.to(x.dtype), x], dim=1).transpose(1, 2)
    return F.silu(F.conv1d(xp, weight.unsqueeze(1).to(x.dtype), groups=x.shape[-1]).transpose(1, 2))


def fold_cp_states(gathered: torch.Tensor, rank: int, v_dim: int) -> torch.Tensor:
    """Incoming KDA state of CP rank ``rank`` from every rank's ``[S_loc | M]`` (parallel state passing).

    ``gathered [B, R, H, K, V + K]`` float32 holds, per CP rank ``j``, its final state from zero
    ``S_loc_j [.., K, V]`` (the first ``v_dim`` columns) and its chunk's transition ``M_j [.., K, K]``.
    Returns ``S_in [B, H, K, V]`` = ``M_{r-1} (... (M_1 S_loc_0 + S_loc_1) ...) + S_loc_{r-1}``
    (zeros for rank 0). The same fold as fla's ``FLACPContext`` (fla 0.6.0) state passing.

    The gathered tensor is split and unbound once: indexing it per rank instead costs, in backward,
    one zero-filled full ``[B, R, ...]`` gradient per slice and its accumulation, ``O(R^2)`` bytes
    (CP = 64, the ``full`` preset's 64 heads, one H200: 72 ms fwd+bwd against 11.8 ms,
    ``tests/benchmarks/kda_cp_fold_bench.py``). Split and unbind
    each have one ``cat``/``stack`` backward. The result starts from zeros that keep the gather in
    every rank's graph (rank 0 uses none of it): the gather's backward is an all-reduce that all
    ranks must join.
    """
    local, transition = gathered.split([v_dim, gathered.shape[-1] - v_dim], dim=-1)
    locals_, transitions = local.unbind(1), transition.unbind(1)
    state = locals_[0] * 0
    for j in range(rank):
        state = transitions[j] @ state + locals_[j]
    return state


class KDAMixer(MegatronModule):
    """Kimi Delta Attention token mixer (``Glm5NextTextLinearAttention``; Kimi Linear, arXiv:2510.26692).

    ``q, k, v = SiLU(causal_conv(W x))`` per channel, ``g = lower_bound * sigmoid(exp(A_log) *
    (f_b(f_a(x)) + dt_bias))`` (the bound multiplies the sigmoid: ``g`` in ``(lower_bound, 0)``;
    with ``linear_lower_bound=None`` ``g = -exp(A_log) * softplus(...)``), ``beta = sigmoid(b(x))``,
    the KDA recurrence with L2-normalised q/k, then a sigmoid-gated RMSNorm per head and ``o_proj``.

    Recurrence: ``fla.ops.kda.chunk_kda`` on CUDA (imported lazily, GPU only), the project's
    :func:`model.ops.kda.chunk_kda_torch` elsewhere. TP splits heads. CP (contiguous layout, see
    :mod:`model.parallel`): parallel state passing (:meth:`_kda_context_parallel`) and the
    convolution history of rank r-1, both through all-gathers.
    ``cu_seqlens`` (packed documents, ``b == 1``, no CP) restarts state and convolution at each
    document start. ``layout`` (:class:`model.parallel.ParallelLayout`, default one process) gives
    the TP size and the CP group.
    """

    def __init__(self, config: Glm5NextConfig, layer_number: int = 1, layout: ParallelLayout | None = None):
        super().__init__(config)
        self.layout = layout or ParallelLayout()
        tp = self.layout.tp_size
        h, d = config.hidden_size, config.linear_head_dim
        self.head_dim = d
        self.heads = _divide(config.linear_num_heads, tp, "linear_num_heads")
        self.dim = self.heads * d
        full = config.linear_num_heads * d
        init = init_normal(config.init_method_std)
        col = dict(config=config, init_method=init, bias=False, gather_output=False)
        self.q_proj = ColumnParallelLinear(h, full, **col)
        self.k_proj = ColumnParallelLinear(h, full, **col)
        self.v_proj = ColumnParallelLinear(h, full, **col)
        self.b_proj = ColumnParallelLinear(h, config.linear_num_heads, **col)
        self.f_a_proj = torch.nn.Linear(h, d, bias=False)
        self.f_b_proj = ColumnParallelLinear(d, full, **col)
        self.g_a_proj = torch.nn.Linear(h, d, bias=False)
        self.g_b_proj = ColumnParallelLinear(d, full, **col)
        kernel = config.linear_conv_kernel_dim
        self.q_conv = torch.nn.Parameter(torch.empty(self.dim, kernel))
        self.k_conv = torch.nn.Parameter(torch.empty(self.dim, kernel))
        self.v_conv = torch.nn.Parameter(torch.empty(self.dim, kernel))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.dim))
        self.A_log = torch.nn.Parameter(torch.zeros(self.heads))
        for p in (self.q_conv, self.k_conv, self.v_conv, self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.o_norm_weight = torch.nn.Parameter(torch.ones(d))
        self.o_proj = RowParallelLinear(full, h, config=config, init_method=init, bias=False,
                                        input_is_parallel=True, skip_bias_add=False)
        self.lower_bound = config.linear_lower_bound
        self.eps = config.layernorm_epsilon
        self.chunk_size = config.kda_chunk_size
        self.compile_glue = config.compile_glue
        self.conv_backend = config.kda_conv
        with torch.no_grad():
            for w in (self.f_a_proj.weight, self.g_a_proj.weight):
                init(w)
            bound = 1 / math.sqrt(kernel)
            for w in (self.q_conv, self.k_conv, self.v_conv):
                w.uniform_(-bound, bound)
            # fla / transformers init: dt = exp(U(log 1e-3, log 1e-1)), dt_bias = softplus^{-1}(dt).
            dt = torch.empty(self.dim).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if self.lower_bound is None:
                self.A_log.copy_(torch.empty(self.heads).uniform_(1, 16).log())

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        f, _ = self.f_b_proj(self.f_a_proj(x))
        return recompute(self._gate_math, f, self.dt_bias, self.A_log)  # saves f, not its float32 steps

    def _gate_math(self, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
        return glue(kda_gate, self.compile_glue, f, dt_bias, a_log, self.heads, self.head_dim, self.lower_bound)

    def _recurrence(self, q, k, v, g, beta, initial_state):
        if q.is_cuda:
            from fla.ops.kda import chunk_kda

            return chunk_kda(q, k, v, g=g, beta=beta.to(q.dtype), initial_state=initial_state, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
        return chunk_kda_torch(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, chunk_size=self.chunk_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``x [s, b, h]`` -> ``[s, b, h]``."""
        cp = self.layout.cp
        xb = x.transpose(0, 1)  # [b, s, h]
        b, s, _ = xb.shape
        # q, k, v convolved apart: each stays a contiguous [b, s, heads * head_dim] tensor for the
        # recurrence (a concatenation and its split views would be copied back out by chunk_kda).
        pres = [p(xb)[0] for p in (self.q_proj, self.k_proj, self.v_proj)]
        weights = (self.q_conv, self.k_conv, self.v_conv)
        kernel = self.q_conv.shape[-1]
        g = self._gate(xb)
        beta = torch.sigmoid(self.b_proj(xb)[0].float())
        if cp.size > 1:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens packing with context parallelism is not implemented")
            # Rank r's convolution history is rank r-1's last kernel-1 inputs (all-gathered:
            # collectives only, so a recomputed layer repeats them in step on every rank).
            tails = all_gather_seq(torch.cat([p[:, s - (kernel - 1):] for p in pres], dim=-1), 1, cp)
            if cp.rank:
                history = tails[:, (cp.rank - 1) * (kernel - 1): cp.rank * (kernel - 1)]
            else:  # zeros that keep the gather in rank 0's graph: its backward is a collective
                history = tails[:, : kernel - 1] * 0
            qkv = [self._conv(p, w, h) for p, w, h in zip(pres, weights, history.split(self.dim, dim=-1))]
            o = self._kda_context_parallel(qkv, g, beta, cp)
        elif cu_seqlens is not None:
            bounds = cu_seqlens.tolist()
            if bounds[0] != 0 or bounds[-1] != s:
                raise ValueError(f"cu_seqlens must run from 0 to the sequence length {s}, got {bounds}")
            # split, not sliced: the backward of a split is one concatenation of the documents' gradients, where
            # each slice's backward writes a zero-filled full-length gradient that autograd then adds up
            lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
            outs = []
            for *doc_pres, doc_g, doc_beta in zip(*(t.split(lengths, dim=1) for t in (*pres, g, beta))):
                qkv = [self._conv(p, w, None) for p, w in zip(doc_pres, weights)]
                outs.append(self._kda(qkv, doc_g, doc_beta, None)[0])
            o = torch.cat(outs, dim=1)
        else:
            o, _ = self._kda([self._conv(p, w, None) for p, w in zip(pres, weights)], g, beta, None)
        gate, _ = self.g_b_proj(self.g_a_proj(xb))
        # Replicated weight, local heads: its gradient is summed over TP ranks by the copy region.
        w = copy_to_tensor_model_parallel_region(self.o_norm_weight) if self.layout.tp_size > 1 else self.o_norm_weight
        gate = gate.unflatten(-1, (self.heads, self.head_dim))
        # recomputed in backward: saves o and gate in their dtypes, not four float32 [s, b, KD] steps. The
        # function closes over the dtype, not x: the node keeps its function, and x would keep the step's graph
        dtype = x.dtype
        o = recompute(lambda o, gate, w: self._gated_norm(o, gate, w, dtype), o, gate, w)
        out, _ = self.o_proj(o.flatten(-2))
        return out.transpose(0, 1)

    def _kda_context_parallel(self, qkv, g, beta, cp: CPContext) -> torch.Tensor:
        """KDA over a sequence split contiguously across CP ranks, with parallel state passing.

        The recurrence ``S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T`` is
        linear in ``(S_0, v)``, so a rank's final state is ``M S_in + S_loc`` with ``M [K, K]``
        its chunk's transition and ``S_loc`` its final state from zero. One pass with values
        ``[v | 0]`` and initial state ``[0 | I]`` returns ``[S_loc | M]``; ``(M, S_loc)`` are
        all-gathered (``[B, H, K, K + V]`` float32 per rank), each rank folds its predecessors'
        into its incoming state, and a second pass from that state gives the output. All ranks
        work at once (about 2x the local KDA work instead of waiting for ``r`` predecessors),
        and the only communication is collective, which full-layer recompute may repeat. The
        same state-passing idea as fla's ``FLACPContext`` (fla 0.6.0), on top of any ``chunk_kda``.
        """
        q, k, v = self._heads(qkv)
        b, d = q.shape[0], self.head_dim
        v_ext = torch.cat([v, torch.zeros_like(v)], dim=-1)
        eye = torch.eye(d, device=q.device, dtype=torch.float32).expand(b, self.heads, d, d)
        s0 = torch.cat([torch.zeros_like(eye), eye], dim=-1)
        _, final = self._recurrence(q, k, v_ext, g, beta, s0)
        gathered = all_gather_seq(final.unsqueeze(1), 1, cp)          # [B, R, H, K, 2V]
        o, _ = self._recurrence(q, k, v, g, beta, fold_cp_states(gathered, cp.rank, d))
        return o

    def _conv(self, x, weight, history):
        return _depthwise_causal_conv(x, weight, history, self.conv_backend)

    def _heads(self, qkv):
        """``(q, k, v)``, each ``[b, s, heads, head_dim]``, of the convolved ``[b, s, heads * head_dim]`` q, k, v."""
        return tuple(t.unflatten(-1, (self.heads, self.head_dim)) for t in qkv)

    def _kda(self, qkv, g, beta, state0):
        return self._recurrence(*self._heads(qkv), g, beta, state0)

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return glue(gated_rms_norm, self.compile_glue, o, gate, w, self.eps, dtype)


class Indexer(torch.nn.Module):
    """DSA lightning indexer weights (``Glm5NextTextIndexer``), replicated over TP ranks.

    ``wq_b [H_i*D_i, q_lora]``, ``wk [D_i, h]``, ``k_norm`` (LayerNorm, eps 1e-6), ``weights_proj
    [H_i, h]``, k-pool compression ``ape [kpool, D_i]`` and ``gate [D_i, h]``. Selection runs under
    ``no_grad`` (as in transformers): the language-model loss does not train the indexer.
    """

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        h, d, nh = config.hidden_size, config.index_head_dim, config.index_n_heads
        self.n_heads, self.head_dim = nh, d
        self.wq_b = torch.nn.Linear(config.q_lora_rank, nh * d, bias=False)
        self.wk = torch.nn.Linear(h, d, bias=False)
        self.k_norm = torch.nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = torch.nn.Linear(h, nh, bias=False)
        self.kpool_compress_ape = torch.nn.Parameter(torch.zeros(config.index_kpool, d))
        self.kpool_compress_gate = torch.nn.Parameter(torch.ones(d, h))
        init = init_normal(config.init_method_std)
        with torch.no_grad():
            for w in (self.wq_b.weight, self.wk.weight, self.weights_proj.weight):
                init(w)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def score_inputs(self, x: torch.Tensor, q_resid: torch.Tensor, cp: CPContext):
        """What the k-pool scores are computed from, for ``x [b, s, h]`` and ``q_resid [b, s, q_lora]``.

        Returns:
            (queries ``[b, s, H_i, D_i]``, keys ``[b, s_all, D_i]`` and k-pool gate inputs
            ``[b, s_all, D_i]`` gathered over CP, head weights float32 ``[b, s, H_i]``
            scaled by ``H_i ** -0.5``).
        """
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim))
        k = all_gather_seq(self.k_norm(self.wk(x)), 1, cp)
        gate = all_gather_seq(F.linear(x, self.kpool_compress_gate), 1, cp)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, k, gate, weights


DKV_POOL_MAX_HEADS = 32
"""``dsa_dkv="auto"``: the sparse MLA backward sums the latent's gradient per k-pool up to this many heads
per rank, and scatters it per query above. The pool pass reads each (query, pool) pair's query and output
gradient rows, bytes that grow with the heads; the per-query atomics do not. One H200, 64k tokens,
fwd+bwd (``tests/benchmarks/dsa_bench.py``): 8 heads 0.124 s per pool vs 0.195 s per query; 64 heads
0.585 s vs 0.496 s."""


DKV_KERNEL = {"auto": "auto", "pool": "triton", "query": "triton", "gluon": "gluon"}
"""``dsa_dkv`` -> :func:`kernels.dsa.sparse_attention.sparse_mla_attention`'s ``dkv_kernel`` (``pool`` and ``auto``
up to :data:`DKV_POOL_MAX_HEADS` heads also pass ``runs``, which keeps ``auto`` on the Triton per-pool sum)."""


class DSAMixer(MegatronModule):
    """DeepSeek Sparse Attention on NoPE MLA (``Glm5NextTextAttention`` with ``Glm5NextTextIndexer``).

    MLA: ``q = q_b(RMSNorm(q_a(x)))`` (``[H, qk_nope]`` per token), latent
    ``c = RMSNorm(kv_a(x))`` (``kv_lora_rank``), ``kv_b`` maps ``c`` to per-head keys
    (``W_UK [qk_nope, kv_lora]``) and values (``W_UV [v, kv_lora]``). The attention runs in the
    absorbed (MQA) form of DeepSeek-V3.2 / FlashMLA sparse: ``q_abs = q W_UK`` against the shared
    latent, ``out = (softmax . c) W_UV^T``, over the tokens selected by the indexer only
    (:func:`kernels.dsa.sparse_mla_attention`; blockwise, never ``T x T``). Softmax scale
    ``qk_nope_head_dim ** -0.5`` (the un-absorbed head width; no RoPE).

    Selection (:func:`kernels.dsa.lightning_indexer_topk`): k-pool scores, top ``index_topk /
    index_kpool`` complete visible pools, plus the query's incomplete tail pool; ties go to the
    lower pool index. A ``shared`` layer (``indexer_types``) reuses the indices of the full DSA
    layer directly before it and has no indexer weights.

    TP splits heads (``q_b``, ``kv_b`` column-parallel, ``o_proj`` row-parallel); ``q_a``,
    ``kv_a`` and the indexer are replicated. CP all-gathers the latent and the indexer keys
    (contiguous layout, queries at offset ``cp_rank * s``). ``layout``
    (:class:`model.parallel.ParallelLayout`, default one process) gives the TP size and the CP group.
    """

    def __init__(self, config: Glm5NextConfig, layer_number: int = 1, shared_indexer: bool = False,
                 layout: ParallelLayout | None = None):
        super().__init__(config)
        self.layout = layout or ParallelLayout()
        tp = self.layout.tp_size
        h = config.hidden_size
        self.heads = _divide(config.num_attention_heads, tp, "num_attention_heads")
        self.nope, self.v_dim, self.kv_lora = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        init = init_normal(config.init_method_std)
        col = dict(config=config, init_method=init, bias=False, gather_output=False)
        self.q_a_proj = torch.nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.layernorm_epsilon, config.compile_glue)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, config.num_attention_heads * self.nope, **col)
        self.kv_a_proj_with_mqa = torch.nn.Linear(h, self.kv_lora, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, config.layernorm_epsilon, config.compile_glue)
        kv_b_out = config.num_attention_heads * (self.nope + self.v_dim)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, kv_b_out, **col)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_dim, h, config=config, init_method=init,
                                        bias=False, input_is_parallel=True, skip_bias_add=False)
        with torch.no_grad():
            init(self.q_a_proj.weight)
            init(self.kv_a_proj_with_mqa.weight)
        self.indexer = None if shared_indexer else Indexer(config)
        self.cfg = config
        # Set by tasks.sft.IndexerKL: each forward leaves (q_resid, q_abs, latent_all, lse, pool mass) in
        # ``self.kl_inputs`` for the KL hook that runs right after it, so the KL's target does not
        # recompute the queries, the latent and a whole sparse-attention forward.
        self.keep_kl_inputs = False
        self.kl_inputs = None
        # (out, lse) of each checkpointed forward, oldest first, until its recompute in backward
        # takes it (config.recompute_keep_attention).
        self.kept_attention: collections.deque = collections.deque()

    def absorbed_queries(self, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_resid [b, s, q_lora], q_abs [b, s, H, kv_lora])`` of ``xb [b, s, h]``: the normed low-rank
        query (the indexer's query input) and the query absorbed into the latent space, ``q W_UK``."""
        q_resid = self.q_a_layernorm(self.q_a_proj(xb))
        q = self.q_b_proj(q_resid)[0].unflatten(-1, (self.heads, self.nope))
        w_uk = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.kv_lora)[:, : self.nope]
        return q_resid, per_head_matmul(q, w_uk)

    def latent(self, xb: torch.Tensor) -> torch.Tensor:
        """This rank's normed KV latent ``[b, s, kv_lora]`` of ``xb [b, s, h]`` (before the CP gather)."""
        return self.kv_a_layernorm(self.kv_a_proj_with_mqa(xb))

    @property
    def softmax_scale(self) -> float:
        return self.nope**-0.5

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cp: CPContext, cu_seqlens=None) -> torch.Tensor:
        """Indexer top-k: ``x [b, s, h]``, ``q_resid [b, s, q_lora]`` -> int32 ``[b, s, W]`` global key indices."""
        from kernels.dsa import lightning_indexer_topk

        ix, c = self.indexer, self.cfg
        q, k, gate, weights = ix.score_inputs(x, q_resid, cp)
        return lightning_indexer_topk(
            q, k, gate, ix.kpool_compress_ape, weights, kpool=c.index_kpool, topk=c.index_topk,
            select_tail=c.index_kpool_always_select_tail, softmax_scale=ix.softmax_scale,
            q_offset=cp.rank * x.shape[1], cu_seqlens=cu_seqlens, block_size=c.dsa_query_block,
        )

    def forward(self, x: torch.Tensor, prev_topk: torch.Tensor | None = None, cu_seqlens=None,
                keep_attention: bool = False, **kwargs):
        """``x [s, b, h]`` -> ``(out [s, b, h], topk [b, s, W] int32)``.

        ``keep_attention``: the call is the no-grad forward of a full-layer checkpoint (the sparse
        attention's ``(out, lse)`` is kept) or its recompute in backward (the kept pair is reused
        instead of running the attention again); first in, first out per mixer.
        """
        from kernels.dsa import sparse_mla_attention

        cp = self.layout.cp
        if cu_seqlens is not None and cp.size > 1:
            raise ValueError("cu_seqlens packing with context parallelism is not implemented")
        xb = x.transpose(0, 1)
        q_resid, q_abs = self.absorbed_queries(xb)
        latent = self.latent(xb)
        if self.indexer is not None:
            topk = self.select(xb, q_resid, cp, cu_seqlens)
        elif prev_topk is None:
            raise ValueError("a shared-indexer DSA layer needs the top-k indices of the full DSA layer before it")
        else:
            topk = prev_topk
        w_uv = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.kv_lora)[:, self.nope:]
        if self.layout.tp_size > 1:
            # kv_b's weight is used directly (absorbed form), so sum the latent's gradient over
            # the TP ranks' heads here, as ColumnParallelLinear does for its input.
            latent = copy_to_tensor_model_parallel_region(latent)
        latent_all = all_gather_seq(latent, 1, cp)
        per_pool = self.cfg.dsa_dkv == "pool" or (self.cfg.dsa_dkv == "auto" and self.heads <= DKV_POOL_MAX_HEADS)
        kept = None
        if keep_attention and torch.is_grad_enabled():
            if not self.kept_attention:
                raise RuntimeError("a recomputed DSA layer found no kept attention output: its checkpointed "
                                   "forward did not run with keep_attention")
            kept = self.kept_attention.popleft()
        # the KL's target, each pool's attention mass, comes out of the attention's own softmax; a recompute
        # (kept attention) and an eval forward build no KL, so they ask for none
        pool_mass = None
        if self.keep_kl_inputs and self.training and kept is None:
            pool_mass = (self.cfg.index_kpool, self.cfg.index_topk // self.cfg.index_kpool)
        result = sparse_mla_attention(
            q_abs, latent_all, topk, self.softmax_scale, self.kv_lora, runs=self.cfg.index_kpool if per_pool else None,
            precomputed=kept, fwd_kernel=self.cfg.dsa_fwd, dkv_kernel=DKV_KERNEL[self.cfg.dsa_dkv], pool_mass=pool_mass)
        o_lat, lse, mass = (*result, None)[:3]   # the mass only when asked for
        if keep_attention and not torch.is_grad_enabled():
            self.kept_attention.append((o_lat, lse))
        if self.keep_kl_inputs:
            self.kl_inputs = (*(t.detach() for t in (q_resid, q_abs, latent_all, lse)), mass)
        o = per_head_matmul(o_lat, w_uv.transpose(1, 2))
        out, _ = self.o_proj(o.flatten(-2))
        return out.transpose(0, 1), topk
