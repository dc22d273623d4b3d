"""The backward of the mHC stream merge in one Triton pass over the streams.

The merge (:func:`model.fused.hc_merge`, the definition) writes the next residual streams ``new_j = post_j * out +
sum_i comb_ij * streams_i`` from the block output ``out [T, h]``, the streams ``[T, n, h]`` and the float32 maps
``post [T, n]``, ``comb [T, n, n]``. Given ``g_j = dL / d new_j`` its backward is

* ``d_out = sum_j post_j g_j`` and ``d_streams_i = sum_j comb_ij g_j`` (elementwise over ``h``), and
* ``d_post_j = sum_h g_j * out`` and ``d_comb_ij = sum_h streams_i * g_j`` (reductions over ``h``).

Under ``torch.compile`` the backward of the collapse and the merge together ran as four inductor kernels per
block, each re-reading ``g`` or the streams: 22 ms of a 64k ``small`` step (``h`` 1024, ``n`` 4) on an H200 (the
profile's trace), against 0.39 ms per merge to read ``g``, the streams and ``out`` once and write ``d_out`` and
``d_streams`` once at 4.8 TB/s. Here one program takes ``BLOCK_T`` tokens, walks ``h`` in ``BLOCK_C``-wide
chunks, writes both elementwise gradients per chunk and keeps the two reductions in float32 registers. The
products are float32, as in the definition (whose float32 maps promote the bf16 operands); the gradients are
rounded once to their tensors' dtypes.

Checked under Triton's CPU interpreter with float32 tensors (the interpreter has no bfloat16; the kernel has no
bf16 arithmetic of its own, only loads and the final stores) against autograd of the definition in float64 by
``tests/test_hc_kernels_interpreter.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MERGE_BWD_CONFIGS = [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=w, num_stages=1)
                     for t, c, w in [(8, 64, 4), (8, 128, 4), (8, 128, 8), (16, 64, 4)]]
"""Autotuned tiles (tokens, columns, warps). The kernel moves bytes: at 64k tokens x 4 streams x 1,024 the
first took 1.0 ms per call on an H100 (1.8 GB, 54% of the copy rate), each thread loading 8 bytes per stream
and chunk; the 128-column tiles at 4 warps load 16. sm_90 compiles (:mod:`kernels.dsa.sm90`,
``tests/test_kernels_sm90.py``): 107, 149, 107 and 140 registers, 4, 3, 2 and 3 CTAs per SM, no spill; 16 x 256
and 32 x 128 tiles spill. On an H100 at that size: 1.007, 0.850, 0.945 and 0.931 ms (8 x 128 at 4 warps won)."""


@triton.jit
def _stream(X, rows, c, ok2, has, k, n, h):
    """Stream ``k`` of ``X [T, n, h]`` at the tokens ``rows`` and columns ``c``: ``[BLOCK_T, BLOCK_C]`` float32."""
    return tl.load(X + rows[:, None] * (n * h) + k * h + c[None, :], mask=ok2 & has[:, None], other=0.0).to(tl.float32)


@triton.autotune(configs=MERGE_BWD_CONFIGS, key=["n", "h"])
@triton.jit
def hc_merge_bwd_kernel(G, OUT, S, POST, COMB, D_OUT, D_S, D_POST, D_COMB, T, n, h,
                        NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok = rows < T
    i = tl.arange(0, NP)
    in_n = tok[:, None] & (i[None, :] < n)
    d_post = tl.zeros([BLOCK_T, NP], tl.float32)
    d_comb = tl.zeros([BLOCK_T, NP * NP], tl.float32)   # [token, i * NP + j]
    pair = tl.arange(0, NP * NP)
    for c0 in range(0, h, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok2 = tok[:, None] & (c[None, :] < h)
        out = tl.load(OUT + rows[:, None] * h + c[None, :], mask=ok2, other=0.0).to(tl.float32)   # [BT, BC]
        d_out = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        # the stream loops are unrolled (NP constant): per (i, j) pair only [BLOCK_T, BLOCK_C] tiles live in
        # registers, not [BLOCK_T, n, n, BLOCK_C] products
        for j in tl.static_range(NP):
            has_j = tok & (tl.full([BLOCK_T], j, tl.int32) < n)
            g = _stream(G, rows, c, ok2, has_j, j, n, h)
            d_out += tl.load(POST + rows * n + j, mask=has_j, other=0.0)[:, None] * g
            d_post += tl.sum(g * out, axis=1)[:, None] * (i == j).to(tl.float32)[None, :]
        tl.store(D_OUT + rows[:, None] * h + c[None, :], d_out.to(D_OUT.dtype.element_ty), mask=ok2)
        for si in tl.static_range(NP):
            has_i = tok & (tl.full([BLOCK_T], si, tl.int32) < n)
            s = _stream(S, rows, c, ok2, has_i, si, n, h)
            d_s = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
            for j in tl.static_range(NP):
                has_j = has_i & (tl.full([BLOCK_T], j, tl.int32) < n)
                g = _stream(G, rows, c, ok2, has_j, j, n, h)   # again: L1/L2 hits, fewer live registers
                d_s += tl.load(COMB + rows * (n * n) + si * n + j, mask=has_j, other=0.0)[:, None] * g
                d_comb += tl.sum(s * g, axis=1)[:, None] * (pair == si * NP + j).to(tl.float32)[None, :]
            tl.store(D_S + rows[:, None] * (n * h) + si * h + c[None, :], d_s.to(D_S.dtype.element_ty),
                     mask=ok2 & has_i[:, None])
    tl.store(D_POST + rows[:, None] * n + i[None, :], d_post, mask=in_n)
    pi, pj = pair // NP, pair % NP
    tl.store(D_COMB + rows[:, None] * (n * n) + (pi * n + pj)[None, :], d_comb,
             mask=tok[:, None] & ((pi < n) & (pj < n))[None, :])


def triton_hc_merge_bwd(grad: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
                        streams: torch.Tensor):
    """Gradients ``(d_post, d_comb, d_out, d_streams)`` of :func:`model.fused.hc_merge` for ``grad [..., n, h]``.

    ``post [..., n]`` and ``comb [..., n, n]`` float32, ``out [..., h]``, ``streams [..., n, h]``; the gradients
    come back in their inputs' dtypes (``d_post``, ``d_comb`` float32), each summed in float32 and rounded once.

    Raises:
        ValueError: the shapes do not fit together.
    """
    *lead, n, h = streams.shape
    if grad.shape != streams.shape or out.shape != (*lead, h) or post.shape != (*lead, n) or \
            comb.shape != (*lead, n, n):
        raise ValueError(f"hc_merge backward: grad {tuple(grad.shape)}, post {tuple(post.shape)}, comb "
                         f"{tuple(comb.shape)}, out {tuple(out.shape)} do not fit streams {tuple(streams.shape)}")
    t = streams[..., 0, 0].numel()
    g, s, o = (x.reshape(t, -1).contiguous() for x in (grad, streams, out))
    p, c = post.reshape(t, n).float().contiguous(), comb.reshape(t, n * n).float().contiguous()
    d_out, d_s = torch.empty_like(o), torch.empty_like(s)
    d_post = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    d_comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    if t:
        hc_merge_bwd_kernel[lambda meta: (triton.cdiv(t, meta["BLOCK_T"]),)](
            g, o, s, p, c, d_out, d_s, d_post, d_comb, t, n, h, NP=triton.next_power_of_2(n))
    return (d_post.view(post.shape).to(post.dtype), d_comb.view(comb.shape).to(comb.dtype), d_out.view(out.shape),
            d_s.view(streams.shape))
