"""Context-parallel communication used inside the glm5_next mixers (gloo on CPU, nccl on GPU).

CP layout decision: **contiguous**. CP rank ``r`` of ``R`` holds tokens
``[r * T/R, (r + 1) * T/R)`` of every sequence. KDA is a recurrence, so a contiguous split needs
exactly one state hand-off per layer (rank r-1 -> rank r: the ``[B, H, K, V]`` KDA state and the
last ``conv_kernel - 1`` pre-convolution activations); a zigzag split would need two and breaks
the per-rank prefix structure of the k-pool grid. The price is causal load imbalance in the DSA
layers (later ranks attend over more keys, at most ``index_topk`` per query, so bounded).

The hand-off is sequential (rank r waits for rank r-1 in each KDA layer), on CPU and, for now,
on GPU as well: fla 0.6.0's ``FLACPContext`` (parallel state passing inside ``chunk_kda``) is not
wired in yet. Forward and
backward are autograd functions: the gradient of the received state goes back to rank r-1 and
arrives there as the gradient of its sent final state. Messages between two ranks are matched in
issue order (one tag), which forward (layer order) and backward (reverse layer order) keep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["recv_from_prev", "send_to_next", "all_gather_seq", "CPContext"]


class CPContext:
    """Rank, size and group of the context-parallel dimension (size 1 = no CP)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if group is None or dist.get_world_size(group) == 1:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def global_rank(self, cp_rank: int) -> int:
        return dist.get_global_rank(self.group, cp_rank)


class _RecvFromPrev(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, shape, dtype, cp):
        ctx.cp = cp
        buf = torch.zeros(shape, dtype=dtype, device=anchor.device)
        if cp.rank > 0:
            dist.recv(buf, src=cp.global_rank(cp.rank - 1), group=cp.group)
        return buf

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        if cp.rank > 0:
            dist.send(grad.contiguous(), dst=cp.global_rank(cp.rank - 1), group=cp.group)
        return None, None, None, None


class _SendToNext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, state, cp):
        ctx.cp = cp
        ctx.state_meta = (state.shape, state.dtype)
        if cp.rank < cp.size - 1:
            dist.send(state.detach().contiguous(), dst=cp.global_rank(cp.rank + 1), group=cp.group)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        cp = ctx.cp
        shape, dtype = ctx.state_meta
        grad_state = torch.zeros(shape, dtype=dtype, device=grad_out.device)
        if cp.rank < cp.size - 1:
            dist.recv(grad_state, src=cp.global_rank(cp.rank + 1), group=cp.group)
        return grad_out, grad_state, None


def recv_from_prev(anchor: torch.Tensor, shape, dtype: torch.dtype, cp: CPContext) -> torch.Tensor:
    """Receive a tensor of ``shape`` from CP rank ``r - 1`` (zeros on rank 0).

    ``anchor`` is any tensor of the current graph that requires grad: it makes autograd call the
    backward, which sends the received tensor's gradient back to rank ``r - 1``.
    """
    return _RecvFromPrev.apply(anchor, tuple(shape), dtype, cp)


def send_to_next(out: torch.Tensor, state: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """Send ``state`` to CP rank ``r + 1`` (nothing on the last rank); returns ``out`` unchanged.

    Routing ``out`` through this function ties the send into the graph: its backward receives
    the gradient of ``state`` from rank ``r + 1``.
    """
    return _SendToNext.apply(out, state, cp)


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, cp):
        ctx.dim, ctx.cp = dim, cp
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad.chunk(ctx.cp.size, dim=ctx.dim)[ctx.cp.rank].contiguous(), None, None


def all_gather_seq(x: torch.Tensor, dim: int, cp: CPContext) -> torch.Tensor:
    """All-gather the contiguous CP shards of ``x`` along ``dim`` (identity when CP size is 1).

    Backward: the full gradient is summed over ranks and each rank keeps its own shard.
    """
    if cp.size == 1:
        return x
    return _AllGatherSeq.apply(x, dim, cp)
