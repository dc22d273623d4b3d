"""Lightning indexer with k-pool compression and streaming top-k (glm5_next DSA).

Public entries: :func:`kpool_compress` and :func:`lightning_indexer_topk`. On CUDA
tensors they run the Triton kernels of :mod:`kernels.dsa.indexer_triton`; elsewhere the
blockwise torch path below, which never holds more than ``block_size x pool_block``
scores. The dense definitions a reader checks against transformers live in
:mod:`kernels.dsa.naive` (see its module docstring for the shared conventions: pools,
visibility, tie rule, output layout).
"""

from __future__ import annotations

import torch

from kernels.dsa.errors import DSAInputError
from kernels.dsa.grid import KPoolGrid, kpool_grid, query_docs

__all__ = ["kpool_compress", "lightning_indexer_topk", "compress_on_grid", "torch_pool_topk", "expand_selection",
           "selection_keys", "decode_selection_keys", "tail_indices"]

# Composite int64 selection key: high 32 bits = order-preserving image of the float32
# score, low 32 bits = (2^32 - 1 - pool index). Every key is distinct, so top-k over keys
# is deterministic on every device and equal scores are won by the lower pool index.
_LOW_MASK = 0xFFFFFFFF
INVALID_KEY = torch.iinfo(torch.int64).min


def _check_kpool_inputs(keys: torch.Tensor, gate_scores: torch.Tensor, ape: torch.Tensor, kpool: int) -> None:
    if keys.ndim != 3 or gate_scores.shape != keys.shape:
        raise DSAInputError(
            f"keys and gate_scores must both be [B, S, D], got {tuple(keys.shape)} and {tuple(gate_scores.shape)}"
        )
    if ape.shape != (kpool, keys.shape[-1]):
        raise DSAInputError(f"ape must be [kpool, D] = {(kpool, keys.shape[-1])}, got {tuple(ape.shape)}")


def kpool_compress(
    keys: torch.Tensor,
    gate_scores: torch.Tensor,
    ape: torch.Tensor,
    kpool: int,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compress indexer keys into one key per k-pool (differentiable).

    ``pool_key[j, d] = sum_i softmax_i(gate[start_j + i, d] + ape[i, d]) * keys[start_j + i, d]``,
    softmax over the tokens of pool ``j`` per channel ``d`` (``Glm5NextTextIndexer.get_pooled_states``).

    Args:
        keys: indexer keys ``[B, S, D]`` (after ``k_norm``).
        gate_scores: ``x @ index_kpool_compress_gate.T``, ``[B, S, D]``.
        ape: ``index_kpool_compress_ape``, ``[kpool, D]``.
        kpool: tokens per pool.
        cu_seqlens: optional document bounds (``B == 1``); pools restart at each document.

    Returns:
        ``[B, P, D]`` in ``keys.dtype``, pools ordered as :func:`kpool_grid` (``P =
        ceil(S / kpool)`` for one document, ``sum_d ceil(len_d / kpool)`` when packed).
        Tail rule: a document's last, incomplete pool is compressed over the tokens it
        has (as transformers does) but is never selectable; the indexer reaches those
        tokens through the tail rule of :func:`lightning_indexer_topk`.

    Raises:
        DSAInputError: on shape mismatches or bad ``cu_seqlens``.
    """
    _check_kpool_inputs(keys, gate_scores, ape, kpool)
    if cu_seqlens is not None and keys.shape[0] != 1:
        raise DSAInputError(f"cu_seqlens needs batch size 1 (packed documents), got batch {keys.shape[0]}")
    grid = kpool_grid(keys.shape[1], kpool, cu_seqlens, keys.device)
    return compress_on_grid(keys, gate_scores, ape, grid)


def compress_on_grid(keys: torch.Tensor, gate_scores: torch.Tensor, ape: torch.Tensor, grid: KPoolGrid) -> torch.Tensor:
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    kpool = grid.kpool
    tokens = grid.start[:, None] + torch.arange(kpool, device=keys.device)  # [P, kpool]
    present = tokens < grid.doc_bounds[grid.doc + 1][:, None]
    tokens = tokens.clamp_max(keys.shape[1] - 1)
    logits = gate_scores[:, tokens].to(compute) + ape.to(compute)  # [B, P, kpool, D]
    logits = logits.masked_fill(~present[None, :, :, None], float("-inf"))
    probs = logits.softmax(dim=2)
    return (probs * keys[:, tokens].to(compute)).sum(dim=2).to(keys.dtype)


def selection_keys(scores: torch.Tensor, pool_index: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Composite int64 keys (see ``_LOW_MASK`` above) from float32 ``scores``; invisible -> INVALID_KEY."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0 folds -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    keys = (ordered << 32) | (_LOW_MASK - pool_index)
    return keys.masked_fill(~visible, INVALID_KEY)


def decode_selection_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool indices (int64) and validity of composite selection keys."""
    return _LOW_MASK - (keys & _LOW_MASK), keys != INVALID_KEY


def _check_indexer_inputs(q, k, gate_scores, ape, weights, kpool, topk, q_offset) -> None:
    if q.ndim != 4:
        raise DSAInputError(f"q must be [B, T, H, D], got {tuple(q.shape)}")
    batch, n_q, heads, dim = q.shape
    _check_kpool_inputs(k, gate_scores, ape, kpool)
    if k.shape[0] != batch or k.shape[2] != dim:
        raise DSAInputError(f"k must be [B, S, D] = [{batch}, S, {dim}], got {tuple(k.shape)}")
    if weights.shape != (batch, n_q, heads):
        raise DSAInputError(f"weights must be [B, T, H] = {(batch, n_q, heads)}, got {tuple(weights.shape)}")
    if topk < kpool or topk % kpool != 0:
        raise DSAInputError(f"topk ({topk}) must be a positive multiple of kpool ({kpool})")
    if q_offset < 0 or q_offset + n_q > k.shape[1]:
        raise DSAInputError(
            f"queries at positions {q_offset}..{q_offset + n_q - 1} do not lie within the {k.shape[1]} keys"
        )


def tail_indices(q_pos: torch.Tensor, q_doc_start: torch.Tensor, kpool: int) -> torch.Tensor:
    """``[T, kpool - 1]`` int64 tokens of each query's current incomplete pool, ``-1``-padded.

    A query at local position ``p`` (``p = q_pos - doc_start``) sees ``p + 1`` tokens of its
    document, ``(p + 1) % kpool`` of which lie past the last complete pool
    (``Glm5NextTextIndexer.append_visible_tail`` without padding).
    """
    tail_count = (q_pos - q_doc_start + 1) % kpool
    offsets = torch.arange(kpool - 1, device=q_pos.device)
    tail = (q_pos + 1 - tail_count)[:, None] + offsets
    return tail.masked_fill(offsets[None, :] >= tail_count[:, None], -1)


def lightning_indexer_topk(
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
    block_size: int = 256,
    score_kernel: str = "auto",
) -> torch.Tensor:
    """Select, per query, the tokens DSA attends to: the top k-pools by lightning-indexer score.

    Pools (:func:`kpool_compress`) are scored by
    ``I[t, p] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . pool_key[p])``
    (DeepSeek-V3.2, arXiv 2512.02556, eq. 1; GLM-5.3 k-pool variant,
    ``Glm5NextTextIndexer``). A pool is selectable when it is complete, in the query's
    document and its last token is at or before the query. The best
    ``topk // kpool`` selectable pools are kept and expanded to token indices; with
    ``select_tail`` the visible tokens of the query's current incomplete pool follow.

    Tie rule (project decision): among equal scores the pool with the lower index
    (earlier position) wins, in every path (composite int64 keys, see ``_LOW_MASK`` above).

    Queries are processed ``block_size`` at a time against pools in chunks with a
    running top-k: memory ``O(T * topk + block_size * pool_chunk)``, never ``T x S``.

    Args:
        q: indexer queries ``[B, T, H, D]`` (``wq_b(q_resid)``), at global positions
            ``q_offset .. q_offset + T - 1``.
        k: indexer keys ``[B, S, D]`` (``k_norm(wk(x))``), all keys ``0 .. S - 1``.
        gate_scores: ``[B, S, D]`` k-pool compression gates.
        ape: ``[kpool, D]`` k-pool positional bias.
        weights: ``[B, T, H]`` per-head weights, already scaled by ``H ** -0.5``.
        kpool: tokens per pool. topk: token budget, a multiple of ``kpool``.
        select_tail: append the current incomplete pool (``index_kpool_always_select_tail``).
        softmax_scale: score scale, ``D ** -0.5`` in glm5_next.
        q_offset: global position of the first query (context parallelism).
        cu_seqlens: ``[n_docs + 1]`` int document bounds over the ``S`` keys (``B == 1``).
        block_size: queries per block of the torch path (the Triton path on CUDA sizes its own
            blocks, whole waves of score programs: 8448 queries per launch on an H200 at 1M tokens;
            there the k-pool compression, selection and expansion are Triton kernels,
            :mod:`kernels.dsa.indexer_triton`).
        score_kernel: the CUDA path's score kernel, ``"auto"`` (Gluon on Hopper, Triton elsewhere),
            ``"triton"`` or ``"gluon"`` (:func:`kernels.dsa.indexer_triton.resolve_score_kernel`); both
            give the same scores bit for bit. Unused on the CPU.

    Returns:
        ``[B, T, W]`` int32 token indices into the ``S`` keys, ``-1`` = none,
        ``W = topk + (kpool - 1 if select_tail else 0)``; layout in :mod:`kernels.dsa.naive`.

    Raises:
        DSAInputError: on inconsistent shapes, ``topk`` not a multiple of ``kpool``,
            queries outside the keys, or bad ``cu_seqlens``.
    """
    _check_indexer_inputs(q, k, gate_scores, ape, weights, kpool, topk, q_offset)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise DSAInputError(f"cu_seqlens needs batch size 1 (packed documents), got batch {q.shape[0]}")
    if block_size < 1:
        raise DSAInputError(f"block_size must be >= 1, got {block_size}")
    if not softmax_scale > 0:
        raise DSAInputError(f"softmax_scale must be positive (ReLU commutes with it), got {softmax_scale}")
    grid = kpool_grid(k.shape[1], kpool, cu_seqlens, q.device)
    if q.is_cuda:
        # imported on the first CUDA call: CPU runs never load the Triton and Gluon modules
        from kernels.dsa.indexer_triton import triton_expand_selection, triton_kpool_compress, triton_pool_topk

        # float64 keys (a reference precision) are compressed by the torch path
        compress = compress_on_grid if k.dtype == torch.float64 else triton_kpool_compress
        pool_keys = compress(k, gate_scores, ape, grid)
        pools = triton_pool_topk(q, pool_keys, weights, grid, topk // kpool, softmax_scale, q_offset,
                                 score_kernel=score_kernel)
        return triton_expand_selection(pools, grid, q.shape[1], q_offset, topk, select_tail)
    pool_keys = compress_on_grid(k, gate_scores, ape, grid)
    pools = torch_pool_topk(q, pool_keys, weights, grid, topk // kpool, softmax_scale, q_offset, block_size)
    return expand_selection(pools, grid, q.shape[1], q_offset, topk, select_tail)


def torch_pool_topk(
    q: torch.Tensor,
    pool_keys: torch.Tensor,
    weights: torch.Tensor,
    grid: KPoolGrid,
    n_select: int,
    softmax_scale: float,
    q_offset: int,
    block_size: int,
    pool_chunk: int = 2048,
) -> torch.Tensor:
    """Blockwise scores with a running top-k; ``[B, T, n_select]`` int64 pool indices, -1 = none."""
    batch, n_q, _, _ = q.shape
    device = q.device
    q_pos, q_doc = query_docs(grid, n_q, q_offset, device)
    pool_end = grid.end
    selected = torch.full((batch, n_q, n_select), -1, dtype=torch.long, device=device)
    for t0 in range(0, n_q, block_size):
        t1 = min(t0 + block_size, n_q)
        pos, doc = q_pos[t0:t1], q_doc[t0:t1]
        # Pools are ordered by position: the candidates of this block are the pools from
        # its first document's first pool up to the last pool ending at its last query.
        p_lo = int(grid.doc_first_pool[doc[0]])
        p_hi = int(torch.searchsorted(pool_end, pos[-1], right=True))
        q_blk = q[:, t0:t1].float()
        w_blk = weights[:, t0:t1].float()
        running = torch.full((batch, t1 - t0, n_select), INVALID_KEY, dtype=torch.long, device=device)
        for c0 in range(p_lo, p_hi, pool_chunk):
            c1 = min(c0 + pool_chunk, p_hi)
            scores = torch.einsum("bthd,bpd->bthp", q_blk, pool_keys[:, c0:c1].float())
            scores = torch.einsum("bthp,bth->btp", torch.relu(scores * softmax_scale), w_blk)
            visible = (
                grid.complete[None, c0:c1]
                & (grid.doc[None, c0:c1] == doc[:, None])
                & (pool_end[None, c0:c1] <= pos[:, None])
            )
            keys = selection_keys(scores, torch.arange(c0, c1, device=device), visible[None])
            running = torch.cat([running, keys], dim=-1).topk(n_select, dim=-1).values
        pool_index, valid = decode_selection_keys(running)
        selected[:, t0:t1] = pool_index.masked_fill(~valid, -1)
    return selected


def expand_selection(
    pools: torch.Tensor, grid: KPoolGrid, n_q: int, q_offset: int, topk: int, select_tail: bool,
    query_block: int = 65536,
) -> torch.Tensor:
    """Pool indices ``[B, T, topk // kpool]`` (-1 = none) -> token indices ``[B, T, W]`` int32.

    Filled ``query_block`` rows at a time in int32: the output itself (``T x W x 4`` bytes)
    is the only full-size tensor.
    """
    batch, kpool = pools.shape[0], grid.kpool
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.full((batch, n_q, width), -1, dtype=torch.int32, device=pools.device)
    offsets = torch.arange(kpool, dtype=torch.int32, device=pools.device)
    q_pos, q_doc = query_docs(grid, n_q, q_offset, pools.device)
    n_pools = pools.shape[-1]
    for t0 in range(0, n_q, query_block):
        t1 = min(t0 + query_block, n_q)
        blk = pools[:, t0:t1]
        tokens = grid.start[blk.clamp_min(0)].to(torch.int32)[..., None] + offsets
        tokens = tokens.masked_fill((blk < 0)[..., None], -1)
        out[:, t0:t1, : n_pools * kpool] = tokens.flatten(-2)
        if select_tail:
            tail = tail_indices(q_pos[t0:t1], grid.doc_bounds[q_doc[t0:t1]], kpool)
            out[:, t0:t1, topk:] = tail.to(torch.int32)
    return out
