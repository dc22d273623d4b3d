"""Elementwise glue of the glm5_next layer, written once in plain torch and fused by ``torch.compile`` on GPUs.

Between its GEMMs and attention kernels a glm5_next layer runs many small elementwise and
reduction ops over ``[s, b, n, h]`` residual streams and ``[tokens, width]`` activations: the mHC
maps (RMS of the flattened streams, sigmoid/softmax and ``hc_sinkhorn_iters`` Sinkhorn-Knopp
normalisations), the stream collapse and merge, RMSNorm, the KDA gate and gated norm, and the MoE
SwiGLU with its routing probability. Run eagerly on a GPU each op is one kernel launch and one
round trip of its tensor through HBM, mostly in float32; a whole-step profile of the ``small``
preset at 64k tokens put such kernels at ~45% of GPU time (``docs/measurements.md``).

Each function here is the one definition of its math (pure: tensors and Python scalars in,
tensors out, no module state, so one compiled graph serves every layer). :func:`glue` calls it
eagerly, or, when ``compile`` is set and its first tensor argument lives on a CUDA device, through
``torch.compile`` (inductor fuses each function and its autograd backward into a few Triton
kernels). The CPU path stays eager: CPU presets check numerics, and inductor's CPU code generation
needs a C++ toolchain at run time. ``Glm5NextConfig.compile_glue`` is the switch the model's
modules pass here (a benchmark flips it per run, ``tests/benchmarks/sft_profile.py --compile-glue``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.hc.projection import bf16_parts, hc_projection

__all__ = ["glue", "hc_maps", "hc_maps_of_logits", "hc_projection", "bf16_parts", "hc_collapse",
           "hc_collapse_weight_grad", "hc_streams_grad_float32", "hc_merge", "hc_merge_backward",
           "tensor_core_projection", "rms_norm", "rms_norm_backward", "kda_gate", "gated_rms_norm", "swiglu",
           "swiglu_probs"]


# Graphs one glue function may need in a process: SFT's step alone compiles a few per function
# (dtypes, widths, autograd on or off); RL, verify and evaluate in one process (a float32 and a bf16
# trainer leg, 8k..256k windows, several widths per norm) took rms_norm past dynamo's default 8 on an
# H200, and a function compiled with fullgraph=True then fails instead of running eagerly.
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn, backend: str = "inductor"):
    # dynamic=None: the first shape compiles static, a second distinct shape compiles a dynamic graph.
    # The limit is dynamo's per code object; raised, never lowered, for every compiled function.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, fullgraph=True, backend=backend)


def glue(fn, compile: bool, *args):
    """``fn(*args)``, through ``torch.compile`` when ``compile`` and ``args[0]`` is a CUDA tensor."""
    if compile and args[0].is_cuda:
        return _compiled(fn)(*args)
    return fn(*args)


def tensor_core_projection(streams: torch.Tensor, gemm: str) -> bool:
    """Whether the mHC projection of ``streams`` runs on bf16 tensor cores
    (:func:`kernels.hc.projection.hc_projection`): ``gemm == "auto"`` with bf16 CUDA streams; otherwise it is a
    float32 GEMM."""
    return gemm == "auto" and streams.is_cuda and streams.dtype == torch.bfloat16


def hc_maps(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
            hc_eps: float, norm_eps: float, gemm: str = "auto"):
    """mHC maps of ``n`` residual streams (Xie et al. 2026; transformers ``Glm5NextTextHyperConnection``).

    Args:
        streams: ``[..., n, h]`` residual streams (any float dtype; computed in float32).
        fn: ``[(2+n)n, n*h]`` projection; base: ``[(2+n)n]``; scale: ``[3]`` (pre, post, comb).
        n: number of streams (``hc_mult``); iters: Sinkhorn-Knopp normalisations of ``comb``.
        hc_eps: added to ``pre`` and ``comb`` and to Sinkhorn's denominators; norm_eps: RMS epsilon.
        gemm: the projection's GEMM (``Glm5NextConfig.hc_gemm``): ``float32`` (float32 copies of the
            streams and the weight; FFMA on GPUs) or ``auto`` (bf16 streams on CUDA:
            :func:`kernels.hc.projection.hc_projection`, bf16 tensor cores with float32 accumulation in
            Triton kernels, a custom op that ``torch.compile`` leaves whole; otherwise ``float32``).

    Returns:
        float32 ``(pre [..., n], post [..., n], comb [..., n, n])``: ``pre`` collapses the streams
        into the block input, ``post`` (in ``(0, 2)``) expands the block output, ``comb``
        (doubly stochastic up to ``hc_eps``) mixes the streams.

    The RMS normalisation of the flattened streams is a per-row scale, so it is applied to the
    ``(2+n)n`` projected values rather than to the ``n*h`` inputs (same function, one float32 copy
    of the streams fewer).
    """
    if tensor_core_projection(streams, gemm):
        mixed = hc_projection(streams.flatten(-2), fn, norm_eps)
    else:
        flat = streams.flatten(-2).float()
        rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        mixed = F.linear(flat, fn.float()) * rstd
    return hc_maps_of_logits(mixed, base, scale, n, iters, hc_eps)


def hc_maps_of_logits(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                      hc_eps: float):
    """The mHC maps ``(pre [..., n], post [..., n], comb [..., n, n])``, float32, of the RMS-normalised projection
    ``mixed [..., (2+n)n]`` float32 (:func:`hc_maps` after its projection; arguments as there)."""
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Block input ``sum_i pre[..., i] * streams[..., i, :]``: ``pre [..., n]`` float32, ``streams [..., n, h]``
    -> ``[..., h]`` in the streams' dtype (accumulated in float32)."""
    # float32 by type promotion: autograd saves the streams as they are, not a float32 copy
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def hc_collapse_weight_grad(block_grad: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`hc_collapse` with respect to ``pre``: ``sum_h block_grad[..., h] * streams[..., i, h]``
    ``[..., n]`` float32, from ``block_grad [..., h]`` and ``streams [..., n, h]``."""
    return (block_grad.unsqueeze(-2).float() * streams.float()).sum(-1)


def hc_streams_grad_float32(mixed_grad: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, streams: torch.Tensor,
                            fn: torch.Tensor, pre: torch.Tensor, block_grad: torch.Tensor, streams_grad: torch.Tensor):
    """The streams' and the projection's gradients of an mHC block whose projection is the float32 GEMM.

    ``mixed = y * rstd`` with ``y = flat @ fn^T`` and ``rstd = rsqrt(mean(flat^2) + eps)`` of ``flat = streams [...,
    n, h]`` flattened (float32); ``mixed_grad [..., p]``, ``y [..., p]``, ``rstd [..., 1]``, ``pre [..., n]``
    float32, ``block_grad [..., h]`` (the collapsed block input's gradient), ``streams_grad [..., n, h]`` (the
    merge's). Returns ``(d_streams [..., n, h]`` in the streams' dtype, ``d_fn [p, n*h]`` in ``fn``'s): the
    projection's gradient (``d rstd / d flat = -rstd^3 flat / k``) plus ``pre[..., i] * block_grad`` plus
    ``streams_grad``, summed in float32. :func:`kernels.hc.projection.hc_projection_streams_grad` is the
    tensor-core path's counterpart."""
    flat = streams.flatten(-2).float()
    dy = mixed_grad * rstd
    coef = (mixed_grad * y).sum(-1, keepdim=True) * rstd.pow(3) / flat.shape[-1]
    d_flat = dy @ fn.float() - coef * flat
    d_streams = d_flat.unflatten(-1, streams.shape[-2:]) + streams_grad.float() \
        + pre.unsqueeze(-1) * block_grad.unsqueeze(-2).float()
    d_fn = dy.flatten(0, -2).t() @ flat.flatten(0, -2)
    return d_streams.to(streams.dtype), d_fn.to(fn.dtype)


def hc_merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Next residual streams ``post[..., j] * out + sum_i comb[..., i, j] * streams[..., i, :]``.

    Args:
        post: ``[..., n]`` float32; comb: ``[..., n, n]`` float32; out: ``[..., h]`` block output;
        streams: ``[..., n, h]``.

    Returns:
        ``[..., n, h]`` in the streams' dtype, accumulated in float32. The ``n x n`` mix is written
        as ``n`` broadcast products: as a batched matmul it ran as one tiny GEMM per token on
        GPUs (a 4x4 @ 4x1024 product per token, ~5 ms per call at 64k tokens).
    """
    # float32 by type promotion (post and comb are float32): autograd saves out and the streams as
    # they are, not float32 copies
    mixed = post.unsqueeze(-1) * out.unsqueeze(-2)
    for i in range(streams.shape[-2]):
        mixed = mixed + comb[..., i, :].unsqueeze(-1) * streams[..., i, :].unsqueeze(-2)
    return mixed.to(streams.dtype)


def hc_merge_backward(grad: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
                      streams: torch.Tensor):
    """Gradients ``(d_post, d_comb, d_out, d_streams)`` of :func:`hc_merge` for ``grad [..., n, h]``, in float32
    products as the merge computes (``d_post``, ``d_comb`` float32; ``d_out``, ``d_streams`` in their inputs'
    dtypes): ``d_out = sum_j post_j g_j``, ``d_post_j = sum_h g_j out``, ``d_comb_ij = sum_h streams_i g_j``,
    ``d_streams_i = sum_j comb_ij g_j``. :mod:`kernels.hc.merge_triton` computes the same in one pass on CUDA."""
    g = grad.float()
    d_out = (post.unsqueeze(-1) * g).sum(-2)
    d_post = (g * out.float().unsqueeze(-2)).sum(-1)
    d_comb = (streams.float().unsqueeze(-3) * g.unsqueeze(-2)).sum(-1).transpose(-1, -2)
    d_streams = (comb.unsqueeze(-1) * g.unsqueeze(-3)).sum(-2)
    return d_post, d_comb, d_out.to(out.dtype), d_streams.to(streams.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * (x * rstd).to(x.dtype), rstd)`` with float32 ``rstd = rsqrt(mean(x^2) + eps)`` ``[..., 1]``
    (transformers ``Glm5NextTextRMSNorm``: normalised in float32, cast back before the weight)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """``(grad_x [..., d] in x.dtype, grad_weight [d] in weight.dtype)`` of :func:`rms_norm`, from its
    input and ``rstd``; roundings as autograd would apply them to the forward's casts."""
    xhat = x.float() * rstd
    g = grad.float()
    # the forward's product saw xhat rounded to x's dtype
    grad_weight = (g * xhat.to(x.dtype).float()).flatten(0, -2).sum(0).to(weight.dtype)
    gxhat = (g * weight.float()).to(x.dtype).float()  # autograd rounds this grad to x's dtype
    grad_x = (rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
    return grad_x, grad_weight


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, heads: int, head_dim: int,
             lower_bound: float | None) -> torch.Tensor:
    """KDA forget gate (log space) ``[..., heads, head_dim]`` float32 of ``f [..., heads*head_dim]``.

    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` (in ``(lower_bound, 0)``), or
    ``-exp(A_log) * softplus(f + dt_bias)`` with ``lower_bound`` None (Kimi Linear, arXiv:2510.26692;
    transformers ``Glm5NextTextLinearAttention``). ``a_log [heads]``, ``dt_bias [heads*head_dim]``.
    """
    g = (f.float() + dt_bias.float()).unflatten(-1, (heads, head_dim))
    a = a_log.float().exp().view(heads, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * F.softplus(g, threshold=20.0)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """KDA output norm ``weight * RMSNorm(o) * sigmoid(gate)`` per head, in float32, cast to ``dtype``.

    ``o``, ``gate``: ``[..., head_dim]``; ``weight [head_dim]`` (``Glm5NextTextLinearAttention``'s
    gated RMSNorm).
    """
    of = o.float()
    of = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * of * torch.sigmoid(gate.float())).to(dtype)


def swiglu(hidden: torch.Tensor, clamp: float | None, linear_offset: float, activation=F.silu) -> torch.Tensor:
    """Gated activation ``act(gate) * (up + offset)`` of ``hidden [..., 2f]`` -> ``[..., f]``, ``hidden``'s dtype.

    ``gate = hidden[..., :f]`` clamped above at ``clamp``, ``up = hidden[..., f:]`` clamped to
    ``[-clamp, clamp]``: megatron's ``MLP`` gated-linear-unit path with ``activation_func_clamp_value``
    (megatron/core/transformer/mlp.py, ``glu``), the same ops in the same order.
    """
    gate, up = torch.chunk(hidden, 2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(min=None, max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    return activation(gate) * (up + linear_offset)


def swiglu_probs(hidden: torch.Tensor, probs: torch.Tensor, clamp: float | None, linear_offset: float,
                 activation=F.silu) -> torch.Tensor:
    """Routed experts' gated activation ``act(gate) * (up + offset) * p`` of ``hidden [T, 2f]`` (:func:`swiglu`).

    ``probs [T]`` float32, the product with it formed in float32 and cast back to ``hidden``'s dtype, as
    megatron's MLP does. -> ``[T, f]``.
    """
    inner = swiglu(hidden, clamp, linear_offset, activation)
    return (inner * probs.unsqueeze(-1)).to(inner.dtype)
