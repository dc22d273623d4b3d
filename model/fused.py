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

__all__ = ["glue", "hc_maps", "hc_projection", "bf16_parts", "hc_collapse", "hc_merge", "rms_norm", "rms_norm_backward", "kda_gate",
           "gated_rms_norm", "swiglu_probs"]


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
    """``a @ b`` of bf16 ``a [m, k]`` and ``b [k, n]`` as float32 ``[m, n]``, accumulated in float32.

    On CUDA cuBLAS's bf16 GEMM with a float32 output (``torch.mm(..., out_dtype=torch.float32)``);
    elsewhere the same products in float32 (exact: a bf16 x bf16 product fits float32), for tests.
    """
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _weight_parts(w: torch.Tensor, parts: int) -> torch.Tensor:
    """``w`` as stacked bf16 parts ``[r, *w.shape]``: itself when already bf16, else :func:`bf16_parts`."""
    return w[None] if w.dtype == torch.bfloat16 else bf16_parts(w, parts)


class _HCProjection(torch.autograd.Function):
    """``rsqrt(mean(x^2) + eps) * (x @ w^T)`` for bf16 ``x [m, k]`` and ``w [p, k]`` (:func:`hc_projection`)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        p = w.shape[0]
        parts = _weight_parts(w, 3)
        # One GEMM against the stacked parts of w: x is read once.
        y = _mm_f32(x, parts.flatten(0, 1).t()).unflatten(-1, (len(parts), p)).sum(-2)   # [m, p]
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)                 # [m, 1]
        ctx.save_for_backward(x, w, y, rstd)
        return y * rstd

    @staticmethod
    def backward(ctx, grad):
        x, w, y, rstd = ctx.saved_tensors
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
        dw = _mm_f32(torch.cat([hi, lo], dim=-1).t(), x).unflatten(0, (2, p)).sum(0)   # [p, k]
        return dx.to(x.dtype), dw.to(w.dtype), None


def hc_projection(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The mHC projection of RMS-normalised streams, ``rsqrt(mean(x^2) + eps) * (x @ w^T)``, from bf16 streams
    on bf16 tensor cores.

    Args:
        x: ``[..., k]`` bf16, the flattened streams (``k = n * h``).
        w: ``[p, k]`` bf16 or float32, the projection ``fn`` (``p = (2 + n) n``).
        eps: RMS epsilon.

    Returns:
        float32 ``[..., p]``. Forward: one GEMM with float32 accumulation and output, against ``w``
        itself (bf16) or its three bf16 parts (float32 ``w``, :func:`bf16_parts`, exact): the float32
        GEMM's result up to summation order. Backward: ``dx`` (bf16) and ``dw`` (``w``'s dtype) from
        GEMMs on two-part splits of the gradient (and of a float32 ``w``): relative error about 2^-16 per
        product, below ``dx``'s bf16 rounding and ``dw``'s float32 accumulation over ``m`` rows; the RMS
        term's gradient is added in float32 before ``dx``'s one rounding.

    Raises:
        ValueError: ``x`` is not bf16, or ``w`` neither bf16 nor float32.
    """
    if x.dtype != torch.bfloat16 or w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"hc_projection takes bf16 streams and a bf16 or float32 weight, got {x.dtype} and {w.dtype}")
    lead = x.shape[:-1]
    return _HCProjection.apply(x.reshape(-1, x.shape[-1]), w, eps).reshape(*lead, w.shape[0])


def hc_maps(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
            hc_eps: float, norm_eps: float, gemm: str = "float32"):
    """mHC maps of ``n`` residual streams (Xie et al. 2026; transformers ``Glm5NextTextHyperConnection``).

    Args:
        streams: ``[..., n, h]`` residual streams (any float dtype; computed in float32).
        fn: ``[(2+n)n, n*h]`` projection; base: ``[(2+n)n]``; scale: ``[3]`` (pre, post, comb).
        n: number of streams (``hc_mult``); iters: Sinkhorn-Knopp normalisations of ``comb``.
        hc_eps: added to ``pre`` and ``comb`` and to Sinkhorn's denominators; norm_eps: RMS epsilon.
        gemm: the projection's GEMM (``Glm5NextConfig.hc_gemm``): ``float32`` (float32 copies of the
            streams and the weight; FFMA on GPUs) or ``auto`` (bf16 streams on CUDA: :func:`hc_projection`,
            bf16 tensor cores with float32 accumulation and output; otherwise ``float32``).

    Returns:
        float32 ``(pre [..., n], post [..., n], comb [..., n, n])``: ``pre`` collapses the streams
        into the block input, ``post`` (in ``(0, 2)``) expands the block output, ``comb``
        (doubly stochastic up to ``hc_eps``) mixes the streams.

    The RMS normalisation of the flattened streams is a per-row scale, so it is applied to the
    ``(2+n)n`` projected values rather than to the ``n*h`` inputs (same function, one float32 copy
    of the streams fewer).
    """
    if gemm == "auto" and streams.is_cuda and streams.dtype == torch.bfloat16:
        mixed = hc_projection(streams.flatten(-2), fn, norm_eps)
    else:
        flat = streams.flatten(-2).float()
        rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        mixed = F.linear(flat, fn.float()) * rstd
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


def swiglu_probs(hidden: torch.Tensor, probs: torch.Tensor, clamp: float | None, linear_offset: float,
                 activation=F.silu) -> torch.Tensor:
    """Routed experts' gated activation ``act(gate) * (up + offset) * p`` of ``hidden [T, 2f]``.

    ``gate = hidden[:, :f]`` clamped above at ``clamp``, ``up = hidden[:, f:]`` clamped to
    ``[-clamp, clamp]`` (megatron's ``activation_func_clamp_value``); ``probs [T]`` float32, the product
    with it formed in float32 and cast back to ``hidden``'s dtype, as megatron's MLP does. -> ``[T, f]``.
    """
    gate, up = torch.chunk(hidden, 2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(min=None, max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    inner = activation(gate) * (up + linear_offset)
    return (inner * probs.unsqueeze(-1)).to(inner.dtype)
