"""DeepSeek Sparse Attention with GLM-5.3-Flash's k-pool lightning indexer, on CPU in plain torch.

The lightning indexer (DeepSeek-V3.2, arXiv:2512.02556) scores key candidates per query;
GLM-5.3-Flash scores *pools* of ``kpool`` consecutive keys instead of single keys. A pool's
key is the softmax-weighted sum of its tokens' indexer keys, the weights coming from a
per-channel gate score plus a learned per-position bias (``index_kpool_compress_ape``).
A query at position ``p`` may select a pool only when the pool is complete and its last
token is at or before ``p``; it keeps the ``index_topk // kpool`` best pools and always
attends to the trailing incomplete pool (the "tail") as raw tokens. Attention is then
MLA over the selected latent vectors only. The semantics follow transformers'
``Glm5NextTextIndexer`` / ``Glm5NextTextAttention`` (modeling_glm5_next.py, 5.19).

Unlike vLLM's GPU path (fp8 pooled-key cache, Hadamard-rotated fp8 queries, DeepGEMM
logits), everything here stays in the model dtype with float32 scores, so float32 runs
match transformers to rounding.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 512
"""Queries processed at once by the sparse attention; bounds the gathered-latent memory
(``QUERY_BLOCK * topk_width * kv_lora_rank`` elements)."""

SCORE_BUDGET = 1 << 24
"""Most float32 pool scores (queries x heads x pools) the indexer holds at once (64 MiB)."""


def pool_keys(keys: torch.Tensor, gate_scores: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Compress the complete pools of one request's indexer keys.

    Args:
        keys: indexer keys of tokens ``0 .. L-1``, shape ``[L, D]``.
        gate_scores: their gate scores, shape ``[L, D]``.
        ape: per-position-in-pool bias ``index_kpool_compress_ape``, shape ``[kpool, D]``.

    Returns:
        Pool keys ``[L // kpool, D]`` in ``keys.dtype``: for each complete pool, the sum over
        its tokens of ``softmax_over_tokens(gate + ape) * key``, per channel. The softmax is
        float32, then cast to the key dtype before the weighted sum (as transformers does).
    """
    kpool, dim = ape.shape
    num_pools = keys.shape[0] // kpool
    grouped_keys = keys[: num_pools * kpool].view(num_pools, kpool, dim)
    logits = gate_scores[: num_pools * kpool].view(num_pools, kpool, dim).float() + ape.float()
    weights = logits.softmax(dim=1).to(keys.dtype)
    return (weights * grouped_keys).sum(dim=1)


def select_topk_tokens(
    index_q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    index_topk: int,
) -> torch.Tensor:
    """Token indices each query attends to: its best complete pools, then its tail.

    Args:
        index_q: indexer queries ``[Q, heads, D]``.
        head_weights: per-head weights ``[Q, heads]``, already scaled by ``heads ** -0.5``.
        pooled: pool keys of the request ``[P, D]`` (from :func:`pool_keys`).
        positions: position of each query in its request, ``[Q]`` (int64).
        kpool: tokens per pool.
        index_topk: token budget of the selected pools (a multiple of ``kpool``).

    Returns:
        ``[Q, index_topk + kpool - 1]`` int64 token positions, -1 where unused. A pool
        ``j`` is eligible for the query at ``p`` when ``(j + 1) * kpool - 1 <= p``; pools are
        ranked by ``sum_h w_h * relu(q_h . k_pool * D ** -0.5)`` (float32), ties to the lower
        pool index.
    """
    num_queries, heads, dim = index_q.shape
    num_pools = pooled.shape[0]
    select_k = index_topk // kpool
    selected_tokens = torch.full((num_queries, select_k * kpool), -1, dtype=torch.long)
    if num_pools > 0:
        take = min(select_k, num_pools)
        pool_end = (torch.arange(num_pools) + 1) * kpool - 1
        rows = max(1, SCORE_BUDGET // (heads * num_pools))
        for start in range(0, num_queries, rows):
            stop = min(start + rows, num_queries)
            scores = torch.einsum("qhd,pd->qhp", index_q[start:stop].float(), pooled.float())
            scores = torch.relu(scores * dim**-0.5)
            index_scores = torch.einsum("qh,qhp->qp", head_weights[start:stop].float(), scores)
            eligible = pool_end[None, :] <= positions[start:stop, None]
            index_scores = index_scores.masked_fill(~eligible, float("-inf"))
            # Tie rule of the project (kernels.dsa): on equal scores the lower pool index wins.
            # ReLU'd scores tie exactly (every head's dot product negative), and topk's order
            # among ties is unspecified; a stable descending sort keeps index order.
            best = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[:, :take]  # [q, take]
            tokens = best[..., None] * kpool + torch.arange(kpool)  # [q, take, kpool]
            tokens = tokens.masked_fill(~eligible.gather(1, best)[..., None], -1)
            selected_tokens[start:stop, : take * kpool] = tokens.flatten(1)
    tail_len = (positions + 1) % kpool
    tail_offsets = torch.arange(kpool - 1)
    tail = positions[:, None] + 1 - tail_len[:, None] + tail_offsets
    tail = tail.masked_fill(tail_offsets[None, :] >= tail_len[:, None], -1)
    return torch.cat([selected_tokens, tail], dim=1)


def sparse_mla_attention(
    q_nope: torch.Tensor,
    latent: torch.Tensor,
    token_indices: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """NoPE multi-head latent attention over selected tokens, in absorbed form.

    Args:
        q_nope: queries ``[Q, H, Dqk]``.
        latent: normalised KV latents ``[N, R]`` (``R = kv_lora_rank``): a request's tokens
            or a whole paged cache viewed as rows.
        token_indices: ``[Q, W]`` rows of ``latent`` each query attends to, -1 = none.
            Valid indices of a row must be distinct (a repeat would count twice) and every
            row needs at least one; :func:`select_topk_tokens` guarantees both.
        w_uk: key up-projection ``[H, Dqk, R]``; w_uv: value up-projection ``[H, Dv, R]``
            (the two halves of ``kv_b_proj``).
        scaling: softmax scale (``Dqk ** -0.5``).

    Returns:
        ``[Q, H, Dv]`` in ``q_nope.dtype``. Scores are ``q . (W_uk c)``, computed as
        ``(W_uk^T q) . c`` so that keys and values never leave latent space (the MLA
        absorption, DeepSeek-V2 arXiv:2405.04434 §2.1.2); softmax is float32.
    """
    out = torch.empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=q_nope.dtype)
    for start in range(0, q_nope.shape[0], QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, q_nope.shape[0])
        indices = token_indices[start:stop]
        valid = indices >= 0
        gathered = latent[indices.clamp(min=0)]  # [q, W, R]
        q_latent = torch.einsum("qhd,hdr->qhr", q_nope[start:stop], w_uk)
        scores = torch.einsum("qhr,qwr->qhw", q_latent, gathered).float() * scaling
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(q_nope.dtype)
        out_latent = torch.einsum("qhw,qwr->qhr", probs, gathered)
        out[start:stop] = torch.einsum("qhr,hvr->qhv", out_latent, w_uv)
    return out
