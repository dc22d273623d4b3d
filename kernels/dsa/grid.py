"""Where the k-pools of a (possibly packed) key sequence lie: :class:`KPoolGrid` and its builder.

Shared by the torch path (:mod:`kernels.dsa.indexer`), the Triton kernels
(:mod:`kernels.dsa.indexer_triton`) and the indexer loss (:mod:`kernels.dsa.loss`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kernels.dsa.errors import DSAInputError

__all__ = ["KPoolGrid", "kpool_grid", "query_docs"]


@dataclass(frozen=True)
class KPoolGrid:
    """Where the k-pools of ``S`` (possibly packed) keys lie.

    Attributes:
        start: ``[P]`` int64, first token of each pool (pools of a document are
            contiguous and in position order, documents in order).
        doc: ``[P]`` int64, document of each pool.
        complete: ``[P]`` bool, the pool has ``kpool`` tokens inside its document.
        doc_bounds: ``[n_docs + 1]`` int64, ``cu_seqlens`` (``[0, S]`` for one document).
        doc_first_pool: ``[n_docs + 1]`` int64, index of each document's first pool.
        kpool: tokens per pool.
        bounds_host, first_pool_host: ``doc_bounds`` and ``doc_first_pool`` as host integers
            (block bounds without a device-to-host read).
    """

    start: torch.Tensor
    doc: torch.Tensor
    complete: torch.Tensor
    doc_bounds: torch.Tensor
    doc_first_pool: torch.Tensor
    kpool: int
    bounds_host: tuple[int, ...]
    first_pool_host: tuple[int, ...]

    @property
    def end(self) -> torch.Tensor:
        """``[P]`` int64, last token of each complete pool (the visibility position)."""
        return self.start + (self.kpool - 1)

    def pool_of_start(self, start_token: torch.Tensor) -> torch.Tensor:
        """Pool index of pools given by their first token (any shape, int)."""
        start_token = start_token.long()
        doc = torch.searchsorted(self.doc_bounds, start_token, right=True) - 1
        doc = doc.clamp(0, self.doc_bounds.numel() - 2)
        return self.doc_first_pool[doc] + (start_token - self.doc_bounds[doc]) // self.kpool

    def visible_range(self, position: int) -> tuple[int, int]:
        """The pools ``[lo, hi)`` a query at token ``position`` sees (host integers): its document's
        complete pools whose last token is at or before it; :meth:`visible_ranges` for many."""
        doc = bisect.bisect_right(self.bounds_host, position) - 1
        lo = self.first_pool_host[doc]
        return lo, lo + (position - self.bounds_host[doc] + 1) // self.kpool

    def visible_ranges(self, q_pos: torch.Tensor, q_doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T]`` int64 ``lo`` and ``hi`` of :meth:`visible_range` for queries at ``q_pos`` (``[T]``
        int64) in documents ``q_doc``: ``lo`` the document's first pool, ``hi - lo`` its pools
        that end at or before the query (a document's pools are ``kpool`` tokens from its start,
        and one that ends at or before a query inside the document is complete)."""
        lo = self.doc_first_pool[q_doc]
        return lo, lo + (q_pos - self.doc_bounds[q_doc] + 1) // self.kpool


def kpool_grid(
    n_keys: int, kpool: int, cu_seqlens: torch.Tensor | None = None, device: torch.device | None = None
) -> KPoolGrid:
    """Lay k-pools over ``n_keys`` keys, restarting at every document start.

    The document bounds are read to the host once (none are read without ``cu_seqlens``); the
    device tensors are built without waiting for the device.

    Args:
        n_keys: key count ``S``.
        kpool: tokens per pool (>= 1).
        cu_seqlens: optional ``[n_docs + 1]`` document bounds (fla convention).
        device: where the grid tensors live.

    Raises:
        DSAInputError: ``kpool < 1`` or ``cu_seqlens`` not rising from 0 to ``n_keys``.
    """
    if kpool < 1:
        raise DSAInputError(f"kpool must be >= 1, got {kpool}")
    if cu_seqlens is None:
        bounds_host = [0, n_keys]
    else:
        bounds_host = cu_seqlens.long().tolist() if cu_seqlens.ndim == 1 else None
        if bounds_host is None or len(bounds_host) < 2 or bounds_host[0] != 0 or bounds_host[-1] != n_keys or any(
            b1 < b0 for b0, b1 in zip(bounds_host, bounds_host[1:])
        ):
            raise DSAInputError(f"cu_seqlens must rise from 0 to the key length {n_keys}, got {cu_seqlens.tolist()}")
    first_pool_host = [0]
    for b0, b1 in zip(bounds_host, bounds_host[1:]):
        first_pool_host.append(first_pool_host[-1] + -(-(b1 - b0) // kpool))
    # (non-blocking copies from host lists: torch.tensor(..., device=cuda) would wait for the device)
    bounds = torch.tensor(bounds_host, dtype=torch.long).to(device, non_blocking=True)
    first_pool = torch.tensor(first_pool_host, dtype=torch.long).to(device, non_blocking=True)
    n_docs, n_pools = len(bounds_host) - 1, first_pool_host[-1]
    doc = torch.repeat_interleave(torch.arange(n_docs, device=device), first_pool[1:] - first_pool[:-1],
                                  output_size=n_pools)
    local = torch.arange(n_pools, device=device) - first_pool[doc]
    start = bounds[doc] + local * kpool
    complete = start + kpool <= bounds[doc + 1]
    return KPoolGrid(start, doc, complete, bounds, first_pool, kpool, tuple(bounds_host), tuple(first_pool_host))


def query_docs(grid: KPoolGrid, n_q: int, q_offset: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` int64 positions ``q_offset .. q_offset + n_q - 1`` of the queries and the document of each."""
    q_pos = q_offset + torch.arange(n_q, device=device)
    q_doc = torch.searchsorted(grid.doc_bounds, q_pos, right=True) - 1
    return q_pos, q_doc
