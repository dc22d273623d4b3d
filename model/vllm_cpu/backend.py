"""vLLM attention backend for the CPU sparse-MLA caches of glm5_next (latent and indexer keys).

The backend only stores and addresses: it declares the paged cache layout and builds,
per step, the per-request addressing the layers in :mod:`model.vllm_cpu.layers` read
(query ranges, sequence lengths, block table, slot mapping). The attention arithmetic
lives in the layers (:mod:`model.vllm_cpu.dsa_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)


@dataclass
class CpuSparseMlaMetadata:
    """Addressing of one scheduler step, shared by every latent / indexer-key cache.

    Attributes:
        num_actual_tokens: tokens of this step (rows of the flattened batch).
        query_start_loc: ``[num_reqs + 1]`` int32, request ``r`` owns rows
            ``query_start_loc[r] : query_start_loc[r + 1]``.
        seq_lens: ``[num_reqs]`` int32, tokens of request ``r`` including this step's.
        block_table: ``[num_reqs, max_blocks]`` int32 physical block ids.
        slot_mapping: ``[num_actual_tokens]`` int64 cache row of each new token.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class CpuSparseMlaMetadataBuilder(AttentionMetadataBuilder[CpuSparseMlaMetadata]):
    """Copies vLLM's common metadata into :class:`CpuSparseMlaMetadata` (CPU tensors)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CpuSparseMlaMetadata:
        meta = common_attn_metadata
        num_reqs = meta.num_reqs
        return CpuSparseMlaMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            query_start_loc=meta.query_start_loc_cpu[: num_reqs + 1].clone(),
            seq_lens=meta.seq_lens[:num_reqs].cpu().clone(),
            block_table=meta.block_table_tensor[:num_reqs].cpu(),
            slot_mapping=meta.slot_mapping[: meta.num_actual_tokens].cpu().long(),
        )


class CpuSparseMlaBackend(AttentionBackend):
    """Storage backend of the CPU sparse-MLA caches: any block size that is a multiple of 16,
    float32 / bfloat16 / float16 caches, one latent vector per token."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "MEGABASE_CPU_SPARSE_MLA"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            "MEGABASE_CPU_SPARSE_MLA has no AttentionImpl: the glm5_next CPU layers compute "
            "attention themselves (model/vllm_cpu/layers.py)."
        )

    @staticmethod
    def get_builder_cls() -> type[CpuSparseMlaMetadataBuilder]:
        return CpuSparseMlaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)
