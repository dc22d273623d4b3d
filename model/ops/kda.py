"""Kimi Delta Attention (KDA) in plain torch: a chunked form (cost linear in T) and a token recurrence.

KDA (Kimi Linear, arXiv:2510.26692) is the gated delta rule with a per-channel (key-dim) decay.
Per head, with state ``S`` of shape ``[K, V]``, for each token ``t``::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

The chunked form (the WY representation of DeltaNet, Yang et al. 2024, arXiv:2406.06484, with the
per-channel decay of fla's ``fla/ops/kda``) processes ``chunk_size`` tokens at a time: inside a
chunk, ``(I + A)^{-1}`` with ``A_ij = beta_i <k_i, k_j * exp(G_i - G_j)>`` (j < i, ``G`` the
in-chunk cumulative log decay) turns the sequential delta updates into matrix products; across
chunks, the ``[K, V]`` state is carried. The loop is over ``T / chunk_size`` chunks, so time and
memory are linear in ``T``. Everything runs in float32, as fla and transformers do.

This is the CPU path of the model and the reference the GPU path (``fla.ops.kda.chunk_kda``) is
compared against; it is tested against transformers' ``chunk_kimi_delta_attention`` and
``recurrent_kimi_delta_attention`` (``transformers/models/glm5_next/modeling_glm5_next.py``),
including a carried initial state. Autograd differentiates through it (no custom backward).
"""

from __future__ import annotations

import torch

__all__ = ["chunk_kda_torch", "naive_recurrent_kda", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's form: eps inside the root, not a max)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]``.

    ``A`` is nilpotent (``A^C = 0``), so ``(I + A)^{-1} = sum_{k<C} (-A)^k = (I - A)(I + A^2)(I + A^4)...``:
    ``ceil(log2 C)`` batched matmuls (in float64), much faster on CPU than a batched triangular
    solve of many small systems, and differentiable by autograd.
    """
    C = A.shape[-1]
    dtype = A.dtype
    # The partial products grow with C; float64 keeps the float32 result as exact as a solve.
    A = A.double()
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    inv = eye - A
    power = A
    k = 2
    while k < C:
        power = power @ power
        inv = inv + inv @ power
        k *= 2
    return inv.to(dtype)


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward, differentiable by autograd; fla ``chunk_kda`` argument conventions.

    Args:
        q (torch.Tensor): queries of shape ``[B, T, H, K]``.
        k (torch.Tensor): keys of shape ``[B, T, H, K]``.
        v (torch.Tensor): values of shape ``[B, T, H, V]``.
        g (torch.Tensor): per-channel log decay (``<= 0``) of shape ``[B, T, H, K]``.
        beta (torch.Tensor): delta-rule step sizes in ``(0, 1)`` of shape ``[B, T, H]``.
        scale (float): query scale; default ``K ** -0.5``.
        initial_state (torch.Tensor): ``[B, H, K, V]`` state before token 0 (zeros if None); the
            final state of the previous sequence segment (context parallelism).
        output_final_state (bool): also return the ``[B, H, K, V]`` float32 state after token T-1.
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k over K first (in float32).
        chunk_size (int): tokens per chunk (64 as in fla); any positive value gives the same result
            up to float32 rounding.

    Returns:
        ``(o, final_state)``: ``o`` of shape ``[B, T, H, V]`` in ``q.dtype``; ``final_state`` of
        shape ``[B, H, K, V]`` (float32; float64 for float64 inputs) or None.
    """
    dtype = q.dtype
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    if scale is None:
        scale = K**-0.5
    # float32 as fla and transformers; float64 inputs stay float64 (tests against exact references).
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    pad = (-T) % C
    # [B, H, N, C, *]; padded tokens have beta = 0 and g = 0, so they leave the state unchanged.
    def chunked(x):
        x = x.transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, -1, C, x.shape[-1])

    q, k, v, g = chunked(q) * 1.0, chunked(k), chunked(v), chunked(g)
    q = q * scale
    beta = chunked(beta.unsqueeze(-1)).squeeze(-1)
    N = q.shape[2]
    g = g.cumsum(-2)  # G: in-chunk cumulative log decay
    k_beta = k * beta.unsqueeze(-1)

    strict_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
    # exp(G_i - G_j) for j <= i (<= 1, no overflow); masked before exp so j > i gives exp(-inf) = 0.
    diff = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf")).exp()
    # [B, H, N, C, C]: A_ij = beta_i <k_i, k_j exp(G_i - G_j)>, kept strictly lower.
    A = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", k_beta, k, diff).masked_fill(~strict_lower, 0.0)
    T_inv = _unit_lower_inverse(A)
    u = T_inv @ (v * beta.unsqueeze(-1))  # pseudo-values with intra-chunk interactions resolved
    w = T_inv @ (k_beta * g.exp())  # how much each pseudo-value depends on the incoming state
    qk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q, k, diff)  # includes the diagonal
    q_decay = q * g.exp()
    k_decay = k * (g[..., -1:, :] - g).exp()
    chunk_decay = g[..., -1, :].exp()  # [B, H, N, K]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(compute)
    outs = []
    for n in range(N):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append(q_decay[:, :, n] @ S + qk[:, :, n] @ v_new)
        S = S * chunk_decay[:, :, n].unsqueeze(-1) + k_decay[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(dtype), (S if output_final_state else None)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (the definition above), in the input dtype; for tests at small T only.

    Same arguments and returns as :func:`chunk_kda_torch`; run it in float64 for a reference.
    """
    B, T, H, K = k.shape
    if scale is None:
        scale = K**-0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt, bt = k[:, t], beta[:, t].unsqueeze(-1)
        S = S + kt.unsqueeze(-1) * (bt * (v[:, t] - (kt.unsqueeze(-1) * S).sum(-2))).unsqueeze(-2)
        outs.append((S * (scale * q[:, t]).unsqueeze(-1)).sum(-2))
    return torch.stack(outs, 1), (S if output_final_state else None)
