"""Context-parallel communication used inside the glm5_next mixers (gloo on CPU, nccl on GPU).

CP layout decision: **contiguous**. CP rank ``r`` of ``R`` holds tokens
``[r * T/R, (r + 1) * T/R)`` of every sequence. KDA is a recurrence: with a contiguous split each
rank needs the state at its start, which :meth:`model.layers.KDAMixer._kda_context_parallel`
gets by parallel state passing (every rank computes its chunk's transition and local final
state, these are all-gathered, each rank folds its predecessors'), and the last
``conv_kernel - 1`` pre-convolution activations of rank r-1 (all-gathered too). A zigzag split
would need two such states per rank and breaks the per-rank prefix structure of the k-pool
grid. The price is causal load imbalance in the DSA layers: a later rank's indexer scores more
pools; its sparse attention reads at most ``index_topk`` keys per query, as every rank's.

All communication is collective (:func:`all_gather_seq`), issued in the same order on every
rank, so full-layer recompute may repeat a layer's forward during backward.

The layout is an argument, not a global: the trainer builds one :class:`ParallelLayout` after
initialising megatron's ``parallel_state`` and :func:`model.glm5_next.build_model` hands it to
every mixer (as torchtitan passes ``parallel_dims`` and fla ``cp_context``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["all_gather_seq", "CPContext", "ParallelLayout"]


class CPContext:
    """Rank, size and group of the context-parallel dimension (size 1 = no CP)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if group is None or dist.get_world_size(group) == 1:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the job: global rank, and its TP / CP / DP / EP coordinates.

    Attributes:
        rank, world_size: in the whole job; local_world_size: ranks sharing this host.
        tp_size, tp_rank: tensor parallelism (the mixers split their heads by it).
        dp_size, dp_rank: data parallelism (without CP).
        ep_size: expert parallelism of the MoE layers.
        cp: the context-parallel group (:class:`CPContext`; size 1 = no CP).

    The default is one process with no parallelism.
    """

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    cp: CPContext = field(default_factory=lambda: CPContext(None), compare=False)

    @property
    def cp_rank(self) -> int:
        return self.cp.rank

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @classmethod
    def from_megatron(cls, local_world_size: int = 1) -> "ParallelLayout":
        """The layout megatron's ``parallel_state`` was initialised with (one process if it was not)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_world_size=local_world_size,
                   tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                   ep_size=ps.get_expert_model_parallel_world_size(), cp=CPContext(ps.get_context_parallel_group()))


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
