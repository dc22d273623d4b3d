"""glm5_next text model for vLLM on CPU (KDA + k-pool DSA on NoPE MLA + MoE + mHC).

Serves ``Glm5NextForConditionalGeneration`` and ``Glm5NextForCausalLM`` checkpoints as a
text-only causal LM: the vision tower's weights are skipped, so vLLM's multimodal
processor (and the torchvision import it needs) never loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Literal

import torch
from torch import nn
from transformers import Glm5NextTextConfig
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from .layers import (
    MoE,
    KdaMixer,
    RMSNorm,
    SparseMLA,
    SwiGLU,
    hyper_connection_post,
    hyper_connection_pre,
)


class Glm5NextCpuConfigError(ValueError):
    """The checkpoint's glm5_next config uses an option the CPU path does not implement."""


def validate_config(config: Glm5NextTextConfig, vllm_config: VllmConfig) -> None:
    """Raise :class:`Glm5NextCpuConfigError` naming the first unsupported setting."""
    if config.qk_rope_head_dim != 0:
        raise Glm5NextCpuConfigError(
            f"qk_rope_head_dim={config.qk_rope_head_dim}: the CPU sparse MLA is NoPE only (0)"
        )
    if not config.index_kpool_always_select_tail:
        raise Glm5NextCpuConfigError("index_kpool_always_select_tail=False is not implemented")
    if config.index_topk % config.index_kpool:
        raise Glm5NextCpuConfigError(
            f"index_topk={config.index_topk} is not a multiple of index_kpool={config.index_kpool}"
        )
    if 2 * config.index_head_dim > config.kv_lora_rank:
        raise Glm5NextCpuConfigError(
            f"2 * index_head_dim={2 * config.index_head_dim} exceeds kv_lora_rank="
            f"{config.kv_lora_rank}: the indexer key cache shares the latent cache's page"
        )
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        raise Glm5NextCpuConfigError(
            f"tensor_parallel_size={vllm_config.parallel_config.tensor_parallel_size}: CPU path is single-rank"
        )
    if vllm_config.speculative_config is not None:
        raise Glm5NextCpuConfigError("speculative decoding is not implemented on the CPU path")
    for idx, layer_type in enumerate(config.layer_types):
        if layer_type == "indexed_attention" and config.indexer_types[idx] == "shared":
            previous = [i for i in range(idx) if config.layer_types[i] == "indexed_attention"]
            if not previous:
                raise Glm5NextCpuConfigError(f"layer {idx} shares the indexer but no DSA layer precedes it")


class DecoderLayer(nn.Module):
    """One glm5_next block: mHC around (KDA or sparse MLA) and around (MLP or MoE)."""

    def __init__(self, config: Glm5NextTextConfig, vllm_config: VllmConfig, layer_idx: int, prefix: str):
        super().__init__()
        self.is_kda = config.layer_types[layer_idx] == "linear_attention"
        if self.is_kda:
            self.self_attn = KdaMixer(config, vllm_config, f"{prefix}.self_attn")
        else:
            shared = config.indexer_types[layer_idx] == "shared"
            self.self_attn = SparseMLA(config, vllm_config, f"{prefix}.self_attn", shared)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = MoE(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.swiglu_limit)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        mix = (2 + config.hc_mult) * config.hc_mult
        width = config.hc_mult * config.hidden_size
        for block in ("attn", "ffn"):
            self.register_parameter(f"hc_{block}_fn", nn.Parameter(torch.empty(mix, width)))
            self.register_parameter(f"hc_{block}_base", nn.Parameter(torch.empty(mix)))
            self.register_parameter(f"hc_{block}_scale", nn.Parameter(torch.empty(3)))
        self.hc_args = dict(rms_eps=config.rms_norm_eps, hc_eps=config.hc_eps, sinkhorn_iters=config.hc_sinkhorn_iters)

    def forward(
        self, streams: torch.Tensor, positions: torch.Tensor, selection: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``streams [T, N, D]``, ``positions [T]`` -> (``[T, N, D]``, the DSA selection for later
        shared layers)."""
        post, comb, x = hyper_connection_pre(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, **self.hc_args
        )
        x = self.input_layernorm(x)
        if self.is_kda:
            x = self.self_attn(x, positions)
        else:
            x, own_selection = self.self_attn(x, selection)
            selection = own_selection if own_selection is not None else selection
        streams = hyper_connection_post(x, streams, post, comb)
        post, comb, x = hyper_connection_pre(
            streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, **self.hc_args
        )
        x = self.mlp(self.post_attention_layernorm(x))
        return hyper_connection_post(x, streams, post, comb), selection


class Glm5NextCpuForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM model class for glm5_next on CPU.

    ``forward(input_ids [T], positions [T]) -> hidden [T, D]``; ``compute_logits`` -> ``[T, V]``.
    """

    has_inner_state: ClassVar[Literal[True]] = True
    is_hybrid: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        validate_config(config, vllm_config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, vllm_config, idx, f"{prefix}layers.{idx}") for idx in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return MambaStateDtypeCalculator.kda_state_dtype(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.kda_state_shape(
            1, config.linear_num_heads, config.linear_head_dim, conv_kernel_size=config.linear_conv_kernel_dim
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        streams = hidden.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        selection = None
        for layer in self.layers:
            streams, selection = layer(streams, positions, selection)
        # The final collapse is an unweighted mean of the streams (transformers Glm5NextTextHyperHead).
        return self.norm(streams.mean(dim=1))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers-format tensors; vision-tower and MTP tensors are skipped.

        Accepts ``model.language_model.*`` (ConditionalGeneration) and ``model.*`` (CausalLM)
        names, per-expert (``mlp.experts.E.gate_proj.weight``) or fused 3-D expert tensors
        (``mlp.experts.gate_up_proj`` ``[E, 2I, D]``, ``mlp.experts.down_proj`` ``[E, D, I]``).
        Each tensor goes through its parameter's ``weight_loader``, so vLLM's in-place
        ``reload_weights`` (RL weight sync) works, with all or some of the tensors; vLLM's
        loader reports parameters a full load did not cover.

        Returns:
            The names of the parameters loaded.

        Raises:
            KeyError: a tensor has no parameter of that name.
            ValueError: a tensor's shape differs from its parameter's.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def assign(name: str, tensor: torch.Tensor) -> None:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in Glm5NextCpuForCausalLM")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)

        for name, tensor in weights:
            if name.startswith(("model.visual.", "visual.")) or "rotary_emb" in name:
                continue
            for outer in ("model.language_model.", "language_model.model.", "model."):
                if name.startswith(outer):
                    name = name[len(outer) :]
                    break
            if name.startswith("layers.") and int(name.split(".")[1]) >= self.config.num_hidden_layers:
                continue  # multi-token-prediction layers
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                half = tensor.shape[1] // 2
                for expert, weight in enumerate(tensor):
                    assign(f"{base}{expert}.gate_proj.weight", weight[:half])
                    assign(f"{base}{expert}.up_proj.weight", weight[half:])
            elif name.endswith("mlp.experts.down_proj"):
                for expert, weight in enumerate(tensor):
                    assign(f"{name[: -len('down_proj')]}{expert}.down_proj.weight", weight)
            else:
                assign(name, tensor)
        return loaded
