"""Kimi Delta Attention (KDA) on CPU in plain torch: short causal convolution, chunked
prefill and one-token recurrent decode, for variable-length requests on vLLM's state cache.

KDA (Kimi Team, "Kimi Linear", arXiv:2510.26692) is the gated delta rule with a
per-channel forget gate. Per head, with a state ``S`` of shape ``[K, V]``:

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

vLLM's CPU gated-delta-rule op takes one gate per head, so it cannot run KDA; these
functions are the CPU path. The chunked form is the WY representation used by fla's
``chunk_kda`` (fla/ops/kda): inside a chunk of ``C`` tokens the deltas solve a unit lower
triangular system, across chunks the state is carried, so the cost is linear in length.
All state arithmetic is float32, as in fla and in transformers' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
"""Tokens per chunk of the chunked prefill. Memory per chunk is ``H * C * C * K`` floats."""


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32 (fla's convention)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d_with_state(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one request, continuing from a cached prefix, + SiLU.

    Args:
        x: inputs of shape ``[T, C]`` (any float dtype).
        weight: depthwise kernel of shape ``[C, W]``.
        conv_state: the last ``W - 1`` inputs before ``x``, shape ``[C, W - 1]``, or None
            for a fresh request (zeros, i.e. left padding).

    Returns:
        ``(y, new_state)``: ``y`` of shape ``[T, C]`` in ``x.dtype`` and the last ``W - 1``
        inputs, shape ``[C, W - 1]``, to store for the next call.
    """
    channels, width = weight.shape
    if conv_state is None:
        prefix = x.new_zeros(width - 1, channels)
    else:
        prefix = conv_state.transpose(0, 1).to(x.dtype)
    padded = torch.cat([prefix, x], dim=0)
    y = F.conv1d(padded.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=channels)
    y = F.silu(y[0].t()).to(x.dtype)
    return y, padded[-(width - 1) :].t()


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
    first_position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over one request.

    Args:
        q: queries ``[T, H, K]``, already L2-normalised and scaled by ``K ** -0.5``.
        k: keys ``[T, H, K]``, L2-normalised.
        v: values ``[T, H, V]``.
        g: log forget gates ``[T, H, K]`` (<= 0), one per key channel.
        beta: delta-rule step sizes ``[T, H]`` in (0, 1).
        initial_state: ``[H, K, V]`` state before the first token, or None for zeros.
        chunk_size: tokens per chunk.
        first_position: position of the first token in its sequence. Chunks end at multiples
            of ``chunk_size`` in sequence positions, so a prompt prefilled over several engine
            steps is cut into the chunks of a one-step prefill, but for the chunk a step
            boundary splits: the results agree to float32 rounding of that one chunk.

    Returns:
        ``(o, final_state)``: outputs ``[T, H, V]`` and the state after the last token
        ``[H, K, V]``, both float32.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    seq_len, num_heads, key_dim = k.shape
    value_dim = v.shape[-1]
    state = (
        torch.zeros(num_heads, key_dim, value_dim, dtype=torch.float32)
        if initial_state is None
        else initial_state.float().clone()
    )
    out = torch.empty(seq_len, num_heads, value_dim, dtype=torch.float32)
    first = chunk_size - first_position % chunk_size
    for start in [0, *range(first, seq_len, chunk_size)]:
        stop = min(first if start == 0 else start + chunk_size, seq_len)
        n = stop - start
        qc, kc, vc, gc = (t[start:stop].transpose(0, 1) for t in (q, k, v, g))  # [H, n, *]
        bc = beta[start:stop].t().unsqueeze(-1)  # [H, n, 1]
        cum = gc.double().cumsum(dim=1)  # [H, n, K]: log decay from the chunk start, float64
        future = torch.ones(n, n, dtype=torch.bool).triu(diagonal=1)
        # exp(cum_i - cum_j) for j <= i; masking before exp keeps j > i from overflowing.
        decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(future[..., None], float("-inf")).exp().float()
        kk = (kc.unsqueeze(2) * kc.unsqueeze(1) * decay).sum(-1)  # [H, i, j]
        strictly_lower = (bc * kk).masked_fill(~future.t(), 0.0)
        # (I + A) U = beta (V - exp(cum) K S0): a unit lower triangular solve per head.
        rhs = torch.cat([bc * vc, bc * kc * cum.exp().float()], dim=-1)
        solved = torch.linalg.solve_triangular(
            strictly_lower + torch.eye(n), rhs, upper=False, unitriangular=True
        )
        u = solved[..., :value_dim] - solved[..., value_dim:] @ state  # deltas [H, n, V]
        qk = (qc.unsqueeze(2) * kc.unsqueeze(1) * decay).sum(-1)  # [H, i, j], zero for j > i
        out[start:stop] = ((qc * cum.exp().float()) @ state + qk @ u).transpose(0, 1)
        last = cum[:, -1:]  # [H, 1, K]
        state = last.exp().float().transpose(1, 2) * state + (kc * (last - cum).exp().float()).transpose(1, 2) @ u
    return out, state


def recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token of KDA for a batch of requests.

    Args:
        q: ``[B, H, K]`` L2-normalised, scaled queries; k: ``[B, H, K]``; v: ``[B, H, V]``;
        g: ``[B, H, K]`` log gates; beta: ``[B, H]``; state: ``[B, H, K, V]`` float32.

    Returns:
        ``(o, new_state)``: ``[B, H, V]`` and ``[B, H, K, V]``, float32.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = state.float() * g.exp().unsqueeze(-1)
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state
