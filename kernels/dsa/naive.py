"""Plain-torch definitions of the glm5_next DeepSeek Sparse Attention (DSA) operators.

These are the readable, dense definitions a reader checks line by line against
transformers' ``Glm5NextTextIndexer`` / ``Glm5NextTextAttention``
(``transformers/models/glm5_next/modeling_glm5_next.py``) and against DeepSeek-V3.2
(arXiv 2512.02556, Sec. 2.1). They build ``T x S`` (or ``T x P``) tensors and are
meant for tests at small ``T`` only; the entries in :mod:`kernels.dsa.indexer`,
:mod:`kernels.dsa.sparse_attention` and :mod:`kernels.dsa.loss` compute the same
values blockwise (CPU) or with Triton kernels (CUDA).

Conventions shared by every DSA operator in this package
-------------------------------------------------------
* Sequences are padding-free. Several documents may be packed into one row with
  ``cu_seqlens`` (fla convention: ``B == 1``, ``cu_seqlens = [0, len_0, len_0 + len_1,
  ..., S]``); no selection crosses a document boundary and k-pools restart at each
  document start (transformers starts pools at the first non-padding token, which is
  the same rule for one document per row).
* Queries sit at global positions ``q_offset .. q_offset + T - 1`` over keys
  ``0 .. S - 1`` (context parallelism: local queries, all-gathered keys).
* k-pool ``j`` of a document starting at ``a`` covers tokens ``a + j*kpool ..
  a + (j+1)*kpool - 1``. Only complete pools are selectable, and a pool is visible to a
  query only when its LAST token is causally visible (``pool_end <= query_position``).
* Tie rule (project decision): among pools with equal index scores the one with the
  lower index (earlier position) wins. transformers leaves ties to ``torch.topk``;
  tests compare against it modulo ties.
* Index output layout, width ``W = topk (+ kpool - 1 with the tail)``: entries
  ``[j*kpool, (j+1)*kpool)`` hold the tokens of the ``j``-th best pool (descending
  score, ties by lower index), or ``-1`` when fewer than ``topk // kpool`` pools are
  visible; entries ``[topk, topk + kpool - 1)`` hold the visible tokens of the query's
  current incomplete pool (the tail), ``-1``-padded. transformers' layout differs only
  in where the ``-1`` padding sits; the sets of valid indices are equal.
"""

from __future__ import annotations

import torch

from kernels.dsa.errors import DSAInputError

__all__ = [
    "naive_kpool_compress",
    "naive_index_scores",
    "naive_lightning_indexer_topk",
    "naive_sparse_mla_attention",
    "naive_indexer_kl_loss",
]


def naive_kpool_compress(
    keys: torch.Tensor, gate_scores: torch.Tensor, ape: torch.Tensor, kpool: int
) -> torch.Tensor:
    """Compress indexer keys into one key per k-pool (one document per row).

    ``pool_key[b, j, d] = sum_i softmax_i(gate[b, j*kpool+i, d] + ape[i, d]) * keys[b, j*kpool+i, d]``,
    the softmax running over the ``kpool`` tokens of the pool, separately per channel
    (``Glm5NextTextIndexer.get_pooled_states``).

    Args:
        keys: indexer keys ``[B, T, D]`` (after ``k_norm``).
        gate_scores: ``x @ index_kpool_compress_gate.T``, ``[B, T, D]``.
        ape: ``index_kpool_compress_ape``, ``[kpool, D]``.
        kpool: tokens per pool.

    Returns:
        ``[B, P, D]`` in ``keys.dtype`` with ``P = ceil(T / kpool)``. When ``T % kpool != 0``
        the last (tail) pool is compressed over the tokens it has, as transformers does,
        but it is never selectable: its tokens reach the attention through the tail rule.
    """
    batch, seq_len, dim = keys.shape
    n_pools = -(-seq_len // kpool)
    pad = n_pools * kpool - seq_len
    logits = (gate_scores.double() if keys.dtype == torch.float64 else gate_scores.float())
    keys_c = keys.to(logits.dtype)
    logits = torch.nn.functional.pad(logits, (0, 0, 0, pad)).view(batch, n_pools, kpool, dim)
    logits = logits + ape.to(logits.dtype)
    present = torch.arange(n_pools * kpool, device=keys.device).view(n_pools, kpool) < seq_len
    logits = logits.masked_fill(~present[None, :, :, None], float("-inf"))
    probs = logits.softmax(dim=2)
    keys_c = torch.nn.functional.pad(keys_c, (0, 0, 0, pad)).view(batch, n_pools, kpool, dim)
    return (probs * keys_c).sum(dim=2).to(keys.dtype)


def naive_index_scores(
    q: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Lightning-indexer scores of every query against every pool (no masking).

    ``I[b, t, p] = sum_h weights[b, t, h] * relu(softmax_scale * q[b, t, h] . pool_keys[b, p])``
    (DeepSeek-V3.2 eq. 1 on pooled keys).

    Args:
        q: indexer queries ``[B, T, H, D]``.
        pool_keys: ``[B, P, D]``.
        weights: per-head weights ``[B, T, H]``, already scaled by ``H ** -0.5``.
        softmax_scale: usually ``D ** -0.5``.

    Returns:
        ``[B, T, P]`` float32 (float64 if ``q`` is float64).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("bthd,bpd->bthp", q.to(dtype), pool_keys.to(dtype))
    scores = torch.relu(scores * softmax_scale)
    return torch.einsum("bthp,bth->btp", scores, weights.to(dtype))


def _check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> list[int]:
    if cu_seqlens is None:
        return [0, seq_len]
    if batch != 1:
        raise DSAInputError(f"cu_seqlens needs batch size 1 (packed documents), got batch {batch}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise DSAInputError(
            f"cu_seqlens must rise from 0 to the key length {seq_len}, got {bounds}"
        )
    return bounds


def naive_lightning_indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    gate_scores: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    *,
    kpool: int,
    topk: int,
    select_tail: bool,
    softmax_scale: float,
    q_offset: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense definition of the k-pool lightning indexer with top-k pool selection.

    Builds the full ``[T, P]`` score matrix per document, masks pools that are
    incomplete or whose last token is not causally visible, keeps the best
    ``min(topk // kpool, P)`` pools (ties: lower pool index wins), expands them to token
    indices and appends the tail (``Glm5NextTextIndexer.forward``). Arguments and
    output as in :func:`kernels.dsa.lightning_indexer_topk`.
    """
    batch, n_q, _, _ = q.shape
    n_k = k.shape[1]
    bounds = _check_cu_seqlens(cu_seqlens, batch, n_k)
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.full((batch, n_q, width), -1, dtype=torch.int32, device=q.device)
    q_pos = q_offset + torch.arange(n_q, device=q.device)
    for doc_start, doc_end in zip(bounds[:-1], bounds[1:]):
        rows = torch.nonzero((q_pos >= doc_start) & (q_pos < doc_end)).flatten()
        if rows.numel() == 0:
            continue
        doc_len = doc_end - doc_start
        pool_keys = naive_kpool_compress(
            k[:, doc_start:doc_end], gate_scores[:, doc_start:doc_end], ape, kpool
        )
        scores = naive_index_scores(q[:, rows], pool_keys, weights[:, rows], softmax_scale)
        scores = scores + 0.0  # -0.0 -> +0.0 so that equal scores compare equal everywhere
        n_pools = pool_keys.shape[1]
        pool_end = torch.arange(n_pools, device=q.device) * kpool + kpool - 1
        local_pos = q_pos[rows] - doc_start
        visible = (pool_end[None, :] <= local_pos[:, None]) & (pool_end[None, :] < doc_len)
        # Stable descending sort over pools in index order = ties won by the lower index.
        order = torch.sort(
            scores.masked_fill(~visible[None], float("-inf")), dim=-1, descending=True, stable=True
        ).indices
        n_select = min(topk // kpool, n_pools)
        chosen = order[..., :n_select]
        chosen_ok = torch.gather(visible[None].expand(batch, -1, -1), -1, chosen)
        tokens = doc_start + chosen[..., None] * kpool + torch.arange(kpool, device=q.device)
        tokens = tokens.masked_fill(~chosen_ok[..., None], -1).flatten(-2)
        out[:, rows, : n_select * kpool] = tokens.to(torch.int32)
        if select_tail:
            tail_count = (local_pos + 1) % kpool
            offsets = torch.arange(kpool - 1, device=q.device)
            tail = (q_pos[rows] + 1 - tail_count)[:, None] + offsets
            tail = tail.masked_fill(offsets[None, :] >= tail_count[:, None], -1)
            out[:, rows, topk:] = tail.to(torch.int32)
    return out


def _selection_mask(indices: torch.Tensor, n_keys: int) -> torch.Tensor:
    """``[B, T, S]`` bool mask of the keys named in ``indices`` (``-1`` ignored)."""
    valid = indices >= 0
    mask = torch.zeros(*indices.shape[:2], n_keys + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where(valid, indices.long(), n_keys), True)
    return mask[..., :n_keys]


def naive_sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked reference of sparse MLA attention in the absorbed (MQA) form.

    ``out[b, t, h] = sum_{s in sel(b,t)} softmax_s(scale * q[b,t,h] . kv[b,s]) * kv[b, s, :d_v]``
    with one latent ``kv`` shared by every head (DeepSeek-V3.2 / FlashMLA sparse).
    Equivalent to ``Glm5NextTextAttention`` with the top-k mask once ``q`` is absorbed
    through ``W_UK`` and the output projected through ``W_UV``. Rows without a valid
    index give ``out = 0`` and ``lse = -inf``.

    Args:
        q: ``[B, T, H, Dqk]``; kv: ``[B, S, Dqk]``; indices: ``[B, T, K]`` int, ``-1`` = none.
        softmax_scale: multiplies ``q . kv``; d_v: value width (``kv[..., :d_v]``).

    Returns:
        ``out [B, T, H, d_v]`` in ``q.dtype`` and ``lse [B, T, H]`` float32 (natural log).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = _selection_mask(indices, kv.shape[1])
    scores = torch.einsum("bthd,bsd->bths", q.to(dtype), kv.to(dtype)) * softmax_scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bths,bsv->bthv", probs, kv[..., :d_v].to(dtype))
    return out.to(q.dtype), lse.float()


def naive_indexer_kl_loss(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    gate_scores: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    kpool: int,
    topk: int,
    index_softmax_scale: float,
    softmax_scale: float,
) -> torch.Tensor:
    """Dense definition of the pooled DSA indexer KL loss (one document per row).

    DeepSeek-V3.2 (arXiv 2512.02556, Sec. 2.1, sparse stage) trains the indexer with
    ``sum_t KL(p_t || softmax(I_t))`` on the selected set, where ``p_t`` is the main
    attention distribution summed over heads and L1-normalized. With k-pools the
    indexer scores pools, so both sides live on the selected pools of query ``t``:

    * target ``p[t, j] = sum_h sum_{s in pool j} softmax(scale * q[t,h] . kv[s])`` over
      the attended set (the selected pools and the tail), then L1-normalized over the
      selected pools (the tail has no index score and is left out);
    * prediction ``log_softmax_j(I[t, pool j])``;
    * ``loss = mean over queries with >= 1 selected pool of sum_j p log(p / pred)``
      (``p`` clamped at 1e-10 inside the log, as megatron-core's ``dsa_indexer_loss``).

    The target is computed without gradients. Arguments as :func:`kernels.dsa.indexer_kl_loss`
    without ``lse``: it is recomputed here densely.
    """
    n_keys = kv.shape[1]
    with torch.no_grad():
        mask = _selection_mask(indices, n_keys)
        scores = torch.einsum("bthd,bsd->bths", q.double(), kv.double()) * softmax_scale
        probs = scores.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(dim=-1)
        probs = torch.nan_to_num(probs).sum(dim=2)  # [B, T, S]
        starts = indices[..., :topk:kpool].long()  # first token of each selected pool
        pool_ok = starts >= 0
        tokens = (starts.clamp_min(0)[..., None] + torch.arange(kpool, device=q.device)).flatten(-2)
        target = torch.gather(probs, -1, tokens).view(*starts.shape, kpool).sum(-1)
        target = target.masked_fill(~pool_ok, 0.0)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    pool_keys = naive_kpool_compress(k_index.double(), gate_scores.double(), ape.double(), kpool)
    all_scores = naive_index_scores(q_index.double(), pool_keys, weights.double(), index_softmax_scale)
    logits = torch.gather(all_scores, -1, (starts.clamp_min(0) // kpool))
    log_pred = logits.masked_fill(~pool_ok, float("-inf")).log_softmax(-1)
    terms = target * (target.clamp_min(1e-10).log() - log_pred)
    row_kl = terms.masked_fill(~pool_ok, 0.0).sum(-1)
    rows = pool_ok.any(-1)
    return (row_kl.sum() / rows.sum().clamp_min(1)).float()
