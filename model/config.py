"""Configuration of the glm5_next text model: HF ``Glm5NextTextConfig`` <-> megatron ``TransformerConfig``.

The numerical reference is transformers' ``Glm5NextTextConfig``
(``transformers/models/glm5_next/configuration_glm5_next.py``). :func:`from_hf` maps one to a
:class:`Glm5NextConfig`, a megatron-core ``TransformerConfig`` that also carries the fields
megatron has no slot for (KDA, DSA indexer, mHC, per-layer schedules); :func:`to_hf` maps back,
and ``to_hf(from_hf(c)) == c`` for every field transformers stores.

Field mapping (HF -> megatron):

==============================  ===========================================================
``hidden_size``                 ``hidden_size``
``num_hidden_layers``           ``num_layers``
``num_attention_heads``         ``num_attention_heads`` (MLA heads of the DSA layers)
``intermediate_size``           ``ffn_hidden_size`` (dense MLP layers)
``moe_intermediate_size``       ``moe_ffn_hidden_size``; shared expert: ``x n_shared_experts``
``n_routed_experts``            ``num_moe_experts``; ``mlp_layer_types`` -> ``moe_layer_freq``
``num_experts_per_tok``         ``moe_router_topk``
``routed_scaling_factor``       ``moe_router_topk_scaling_factor``
``n_group`` / ``topk_group``    ``moe_router_num_groups`` / ``moe_router_group_topk``
``swiglu_limit``                ``activation_func_clamp_value`` (gate clamped above, up both sides)
``rms_norm_eps``                ``layernorm_epsilon``
==============================  ===========================================================

Routing is the DeepSeek-V3 sigmoid router (``moe_router_score_function="sigmoid"``, expert-score
correction bias = megatron's ``expert_bias``, scores normalised over the top-k because HF
``norm_topk_prob`` is true). Megatron scores an expert group by the sum of its top
``topk // topk_group`` scores where HF sums the top 2: the two agree when ``n_group == 1`` or
``num_experts_per_tok == 2 * topk_group``; other shapes raise :class:`ConfigError`.

Vocabulary decision: the project's DNA tokenizer has 9 ids (``<pad>=0 <sep>=1 <bos>=2 <unk>=3
A=4 C=5 G=6 T=7 N=8``); presets built here use ``vocab_size=16`` (9 ids padded to a multiple of 8
for the TP split of the embedding). A pretrained checkpoint keeps its full output head unchanged;
the loss never materialises full-vocabulary logits for all positions at once
(``model.logprobs``, chunked cross-entropy).

Presets (:data:`PRESETS`): ``tiny`` (every layer kind: KDA, DSA with a full and a shared indexer,
dense and MoE MLP, mHC; widths small enough for a CPU forward+backward of 16k tokens in
seconds), ``small`` (one H200 at 256k-1M tokens with recompute/offload), ``full`` (the published
GLM-5.3-Flash shape = transformers' defaults).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "ConfigError",
    "Glm5NextConfig",
    "PRESETS",
    "DNA_VOCAB",
    "from_hf",
    "to_hf",
    "preset",
    "hf_config_dict",
    "parameter_count",
]


class ConfigError(ValueError):
    """A glm5_next configuration that the megatron model cannot represent or that is inconsistent."""


DNA_VOCAB: dict[str, int] = {"<pad>": 0, "<sep>": 1, "<bos>": 2, "<unk>": 3, "A": 4, "C": 5, "G": 6, "T": 7, "N": 8}
"""The project's single-nucleotide tokenizer; presets pad it to ``vocab_size=16``."""

KDA = "linear_attention"
DSA = "indexed_attention"

# HF text-config fields that this module maps (everything transformers stores for the text model).
_HF_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "pad_token_id", "bos_token_id",
    "eos_token_id", "tie_word_embeddings", "mlp_layer_types", "attention_bias", "index_topk",
    "index_head_dim", "index_n_heads", "layer_types", "indexer_types", "swiglu_limit", "linear_head_dim",
    "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "hc_mult", "hc_eps",
    "hc_sinkhorn_iters", "router_aux_loss_coef", "index_kpool", "index_kpool_always_select_tail",
)

# Fields vLLM's glm5_next reads from the text config on top of transformers' ones.
VLLM_TEXT_FIELDS: dict[str, Any] = {
    "mhc": True,
    "mla_use_nope": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "indexer_rope_interleave": False,
}


@dataclass
class Glm5NextConfig(TransformerConfig):
    """megatron ``TransformerConfig`` plus the glm5_next fields megatron has no slot for.

    Per-layer schedules are lists of length ``num_layers``: ``layer_types`` (``"linear_attention"``
    = KDA, ``"indexed_attention"`` = DSA), ``indexer_types`` (``"full"`` runs the lightning indexer,
    ``"shared"`` reuses the top-k of the DSA layer directly before it, as in HF) and
    ``mlp_layer_types`` (``"dense"`` / ``"sparse"``).
    """

    vocab_size: int = 16
    layer_types: list[str] = field(default_factory=list)
    indexer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    # MLA (NoPE): qk_rope_head_dim is always 0 in glm5_next.
    q_lora_rank: int = 32
    kv_lora_rank: int = 320
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    # DSA lightning indexer.
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 64
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # KDA.
    linear_num_heads: int = 4
    linear_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    kda_chunk_size: int = 32
    # mHC.
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # Sequence-chunked MLP/MoE: tokens per chunk (0 = whole sequence at once).
    mlp_chunk_tokens: int = 0
    # Routed experts: "grouped" (model.moe.GroupedMLP, two grouped GEMMs for all local experts) or
    # "sequential" (megatron's SequentialMLP, one MLP per expert); same parameters and numerics.
    moe_experts: str = "grouped"
    # Elementwise glue (mHC maps, stream collapse/merge, RMSNorm, KDA gate and norm, MoE SwiGLU) fused
    # by torch.compile on CUDA tensors (model.fused); eager on CPU either way. Same function.
    compile_glue: bool = True
    # DSA plain-torch path: queries per block of the blockwise indexer / sparse attention.
    dsa_query_block: int = 1024
    # Sparse MLA backward on CUDA: the latent's gradient summed per selected k-pool ("pool"), scattered
    # per query with atomics ("query", kernels.dsa.sparse_attention_triton), per query with 64 heads per
    # program with the query gradient in the same form ("gluon": kernels.dsa.sparse_attention_gluon; Hopper,
    # heads per rank a multiple of 64, raises elsewhere), or "auto" (pool up to model.layers.DKV_POOL_MAX_HEADS
    # heads per TP rank, above that "gluon" where it runs and "query" elsewhere); the same function.
    dsa_dkv: str = "auto"
    # Sparse MLA forward on CUDA: "triton" (kernels.dsa.sparse_attention_triton, any head count), "gluon"
    # (kernels.dsa.sparse_attention_gluon: warp-specialized, Hopper, heads per rank a multiple of 64, d_v ==
    # Dqk <= 512; raises elsewhere) or "auto" (gluon where it runs, else triton); the same function.
    dsa_fwd: str = "auto"
    # Token permutation of megatron's allgather MoE dispatcher: "gather" (model.moe.GatherTokenDispatcher:
    # row gathers both ways, counts kept on the device; where every expert is local and no capacity factor
    # drops tokens) or "megatron" (its index_select / scatter_add with atomic backward and a host sync per
    # layer); the same function.
    moe_permute: str = "gather"
    # Full-layer recompute ("full" granularity): DSA layers keep their sparse MLA output and log-sum-exp
    # from the forward (heads/tp * (kv_lora_rank * 2 + 4) bytes per token and DSA layer on the device)
    # and the recompute reuses them instead of running the sparse attention again; bitwise the same.
    recompute_keep_attention: bool = False
    # KDA's depthwise causal short convolution on CUDA: "auto" (fla's Triton causal_conv1d on the
    # [b, s, c] layout, SiLU fused) or "torch" (cuDNN conv1d on a transposed copy, as on CPU); the same function.
    kda_conv: str = "auto"
    # The DSA indexer KL loss's indexer side on CUDA: "auto" (one fused Triton kernel per direction,
    # kernels.dsa.loss_triton) or "torch" (the blockwise torch path under activation checkpointing, as on
    # CPU); the same function.
    dsa_kl: str = "auto"
    # The mHC projection's GEMM: "auto" (bf16 streams on CUDA: bf16 tensor cores with float32 accumulation and
    # output, kernels.hc.projection's Triton kernels; float32 elsewhere) or "float32" (float32 copies of the
    # streams and weight; FFMA on GPUs); the same function up to summation order in the forward. "auto" is
    # checked against float64 by tests/gpu/hc_projection_check.py and took 35-43 ms off a 64k `small` step.
    hc_gemm: str = "auto"
    # HF bookkeeping fields carried through the round trip unchanged.
    hf_extra: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        n = self.num_layers
        for name in ("layer_types", "indexer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries, num_layers is {n}")
        for i, kind in enumerate(self.layer_types):
            if kind not in (KDA, DSA):
                raise ConfigError(f"layer_types[{i}]={kind!r}; valid: {KDA!r}, {DSA!r}")
            if kind == DSA and self.indexer_types[i] == "shared":
                if i == 0 or self.layer_types[i - 1] != DSA or self.indexer_types[i - 1] != "full":
                    raise ConfigError(
                        f"layer {i} is a shared-indexer DSA layer but layer {i - 1} is not a full-indexer "
                        "DSA layer; transformers hands top-k indices only from a full layer to the next layer"
                    )
        if self.moe_experts not in ("grouped", "sequential"):
            raise ConfigError(f"moe_experts={self.moe_experts!r}; valid: 'grouped', 'sequential'")
        if self.dsa_dkv not in ("auto", "pool", "query", "gluon"):
            raise ConfigError(f"dsa_dkv={self.dsa_dkv!r}; valid: 'auto', 'pool', 'query', 'gluon'")
        if self.dsa_fwd not in ("auto", "triton", "gluon"):
            raise ConfigError(f"dsa_fwd={self.dsa_fwd!r}; valid: 'auto', 'triton', 'gluon'")
        if self.moe_permute not in ("gather", "megatron"):
            raise ConfigError(f"moe_permute={self.moe_permute!r}; valid: 'gather', 'megatron'")
        for name in ("kda_conv", "dsa_kl"):
            if getattr(self, name) not in ("auto", "torch"):
                raise ConfigError(f"{name}={getattr(self, name)!r}; valid: 'auto', 'torch'")
        if self.hc_gemm not in ("float32", "auto"):
            raise ConfigError(f"hc_gemm={self.hc_gemm!r}; valid: 'float32', 'auto'")
        if self.index_topk % self.index_kpool:
            raise ConfigError(f"index_topk={self.index_topk} is not a multiple of index_kpool={self.index_kpool}")

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == DSA]

    @property
    def index_width(self) -> int:
        """Width W of the selected-token index list of one query (top-k plus the raw k-pool tail)."""
        return self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)


def _hf_to_dict(hf: Any) -> dict:
    if isinstance(hf, Mapping):
        d = dict(hf)
    else:
        d = hf.to_dict()
    if "text_config" in d and d.get("model_type") == "glm5_next":
        d = dict(d["text_config"])
    return d


HF_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=45, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
    n_routed_experts=288, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=0, v_head_dim=256, qk_nope_head_dim=256, n_group=1, topk_group=1,
    num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576,
    initializer_range=0.02, rms_norm_eps=1e-5, pad_token_id=154820, bos_token_id=None, eos_token_id=None,
    tie_word_embeddings=False, attention_bias=False, index_topk=2048, index_head_dim=128,
    index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64,
    linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
    router_aux_loss_coef=0.001, index_kpool=16, index_kpool_always_select_tail=True,
)
"""transformers 5.19's ``Glm5NextTextConfig()`` defaults (the published GLM-5.3-Flash shape), for
machines whose transformers predates glm5_next (the GPU image has 5.17); a test pins them to
transformers'. Schedules (``layer_types`` ...) follow its ``__post_init__`` rules."""


def _normalised_hf(hf: Any) -> dict:
    """Full text-config dict with transformers' defaults and ``__post_init__`` schedules filled in."""
    d = _hf_to_dict(hf)
    d = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")}
    try:
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5.19"):
            # Older releases with a glm5_next do not know "indexed_attention" layers.
            raise ImportError(f"transformers {transformers.__version__} predates glm5_next 5.19")
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    except ImportError:
        h = {**HF_TEXT_DEFAULTS, **{k: v for k, v in d.items() if k in _HF_FIELDS}}
        n = h["num_hidden_layers"]
        if h.get("mlp_layer_types") is None:
            h["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        if h.get("layer_types") is None:
            h["layer_types"] = [DSA if i % 4 == 3 else KDA for i in range(n)]
        if h.get("indexer_types") is None:
            h["indexer_types"] = ["full"] * n
        return h
    try:
        cfg = Glm5NextTextConfig(**d)
    except Exception as err:  # transformers' strict-dataclass validation errors share no base class
        raise ConfigError(f"transformers rejects this glm5_next text config: {err}") from err
    return {k: getattr(cfg, k) for k in _HF_FIELDS}


def from_hf(hf: Any, **overrides: Any) -> Glm5NextConfig:
    """Map an HF glm5_next text config to :class:`Glm5NextConfig`.

    Args:
        hf: a ``Glm5NextTextConfig``, a ``Glm5NextConfig`` (its ``text_config`` is used) or the
            dict of either (a ``config.json`` loaded with ``json.load``).
        overrides: ``TransformerConfig`` / :class:`Glm5NextConfig` fields to set (parallel sizes,
            recompute, ``params_dtype``, ``mlp_chunk_tokens``, ...).

    Raises:
        ConfigError: the HF config uses a feature the megatron model does not implement
            (RoPE in DSA, ``norm_topk_prob=False``, a group-routing shape megatron scores
            differently, a non-SiLU activation, attention bias, tied embeddings).
    """
    h = _normalised_hf(hf)
    if h["qk_rope_head_dim"] != 0:
        raise ConfigError(f"qk_rope_head_dim={h['qk_rope_head_dim']}: glm5_next DSA is NoPE, expected 0")
    if not h["norm_topk_prob"]:
        raise ConfigError("norm_topk_prob=False: megatron's sigmoid router always normalises the top-k scores")
    if h["hidden_act"] != "silu":
        raise ConfigError(f"hidden_act={h['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
    if h["attention_bias"]:
        raise ConfigError("attention_bias=True is not implemented")
    if h["tie_word_embeddings"]:
        raise ConfigError("tie_word_embeddings=True is not implemented")
    if h["n_group"] > 1 and h["num_experts_per_tok"] != 2 * h["topk_group"]:
        raise ConfigError(
            f"n_group={h['n_group']}, topk_group={h['topk_group']}, num_experts_per_tok="
            f"{h['num_experts_per_tok']}: megatron scores a group by its top topk//topk_group experts, "
            "HF by its top 2; they agree only when num_experts_per_tok == 2 * topk_group"
        )
    moe_freq = [1 if t == "sparse" else 0 for t in h["mlp_layer_types"]]
    kwargs: dict[str, Any] = dict(
        num_layers=h["num_hidden_layers"],
        hidden_size=h["hidden_size"],
        num_attention_heads=h["num_attention_heads"],
        num_query_groups=h["num_key_value_heads"],
        kv_channels=h["v_head_dim"],
        ffn_hidden_size=h["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=h["rms_norm_eps"],
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=h["swiglu_limit"],
        bias_activation_fusion=False,
        # megatron's switch for an activation module in MLPSubmodules.activation_func (named for
        # Transformer Engine's); every MLP spec here puts model.moe.SwiGLUActivation there
        use_te_activation_func=True,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=float(h["attention_dropout"]) if "attention_dropout" in h else 0.0,
        init_method_std=h["initializer_range"],
        use_cpu_initialization=True,
        num_moe_experts=h["n_routed_experts"] if any(moe_freq) else None,
        moe_layer_freq=moe_freq,
        moe_ffn_hidden_size=h["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=h["moe_intermediate_size"] * h["n_shared_experts"]
        if h["n_shared_experts"]
        else None,
        moe_router_topk=h["num_experts_per_tok"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=h["routed_scaling_factor"],
        moe_router_num_groups=h["n_group"] if h["n_group"] > 1 else None,
        moe_router_group_topk=h["topk_group"] if h["n_group"] > 1 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        vocab_size=h["vocab_size"],
        layer_types=list(h["layer_types"]),
        indexer_types=list(h["indexer_types"]),
        mlp_layer_types=list(h["mlp_layer_types"]),
        q_lora_rank=h["q_lora_rank"],
        kv_lora_rank=h["kv_lora_rank"],
        qk_nope_head_dim=h["qk_nope_head_dim"],
        v_head_dim=h["v_head_dim"],
        index_n_heads=h["index_n_heads"],
        index_head_dim=h["index_head_dim"],
        index_topk=h["index_topk"],
        index_kpool=h["index_kpool"],
        index_kpool_always_select_tail=h["index_kpool_always_select_tail"],
        linear_num_heads=h["linear_num_heads"],
        linear_head_dim=h["linear_head_dim"],
        linear_conv_kernel_dim=h["linear_conv_kernel_dim"],
        linear_lower_bound=h["linear_lower_bound"],
        hc_mult=h["hc_mult"],
        hc_eps=h["hc_eps"],
        hc_sinkhorn_iters=h["hc_sinkhorn_iters"],
        hf_extra={
            k: h[k]
            for k in (
                "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
                "router_aux_loss_coef", "n_group", "topk_group",
            )
        },
    )
    if kwargs["num_moe_experts"] is None:
        for k in ("moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                  "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk"):
            kwargs.pop(k)
        kwargs["hf_extra"]["n_routed_experts"] = h["n_routed_experts"]
    kwargs.update(overrides)
    # Under EP, megatron's alltoall dispatcher sends each routed token only to its experts' ranks;
    # allgather sends every rank's tokens to every rank (EP x the bytes: at b200-64, 256k, the layer
    # benchmark prices 0.18 s per MoE layer against 0.033 s). Without EP both are local.
    if "moe_token_dispatcher_type" not in overrides and kwargs.get("expert_model_parallel_size", 1) > 1:
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    return Glm5NextConfig(**kwargs)


def to_hf(cfg: Glm5NextConfig) -> dict:
    """Map :class:`Glm5NextConfig` back to an HF text-config dict (``Glm5NextTextConfig(**d)`` accepts it).

    The dict also carries the fields vLLM reads (:data:`VLLM_TEXT_FIELDS`).
    """
    extra = cfg.hf_extra
    d: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        n_shared_experts=(cfg.moe_shared_expert_intermediate_size or 0) // cfg.moe_ffn_hidden_size
        if cfg.num_moe_experts
        else 1,
        n_routed_experts=cfg.num_moe_experts if cfg.num_moe_experts else extra.get("n_routed_experts", 288),
        routed_scaling_factor=cfg.moe_router_topk_scaling_factor if cfg.num_moe_experts else 2.5,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=0,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=extra.get("n_group", cfg.moe_router_num_groups or 1),
        topk_group=extra.get("topk_group", cfg.moe_router_group_topk or 1),
        num_experts_per_tok=cfg.moe_router_topk,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=extra.get("max_position_embeddings", 1048576),
        initializer_range=cfg.init_method_std,
        rms_norm_eps=cfg.layernorm_epsilon,
        pad_token_id=extra.get("pad_token_id"),
        bos_token_id=extra.get("bos_token_id"),
        eos_token_id=extra.get("eos_token_id"),
        tie_word_embeddings=False,
        mlp_layer_types=list(cfg.mlp_layer_types),
        attention_bias=False,
        index_topk=cfg.index_topk,
        index_head_dim=cfg.index_head_dim,
        index_n_heads=cfg.index_n_heads,
        layer_types=list(cfg.layer_types),
        indexer_types=list(cfg.indexer_types),
        swiglu_limit=cfg.activation_func_clamp_value,
        linear_head_dim=cfg.linear_head_dim,
        linear_num_heads=cfg.linear_num_heads,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        linear_lower_bound=cfg.linear_lower_bound,
        hc_mult=cfg.hc_mult,
        hc_eps=cfg.hc_eps,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        router_aux_loss_coef=extra.get("router_aux_loss_coef", 0.001),
        index_kpool=cfg.index_kpool,
        index_kpool_always_select_tail=cfg.index_kpool_always_select_tail,
    )
    d.update(VLLM_TEXT_FIELDS)
    d["model_type"] = "glm5_next_text"
    return d


MINIMAL_VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 32,
    "projection_intermediate_size": 64,
}
"""Smallest vision tower transformers' ``Glm5NextForConditionalGeneration`` builds with (5.19 has no
text-only causal-LM class for glm5_next); exports without a source vision tower use it."""


def hf_config_dict(cfg: Glm5NextConfig, vision_config: Mapping[str, Any] | None = None) -> dict:
    """The ``config.json`` dict of the published GLM-5.3-Flash layout for ``cfg``.

    ``architectures = ["Glm5NextForConditionalGeneration"]``, ``model_type = "glm5_next"``, the text
    model under ``text_config``; ``vision_config`` defaults to :data:`MINIMAL_VISION_CONFIG`.
    """
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig as HFConfig

    text = to_hf(cfg)
    hf = HFConfig(text_config={k: v for k, v in text.items() if k != "model_type"},
                  vision_config=dict(vision_config or MINIMAL_VISION_CONFIG))
    d = hf.to_dict()
    d["architectures"] = ["Glm5NextForConditionalGeneration"]
    d["text_config"].update(VLLM_TEXT_FIELDS)
    return d


def _tiny() -> dict:
    return dict(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=320,
        qk_nope_head_dim=32,
        v_head_dim=32,
        qk_rope_head_dim=0,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        index_kpool=16,
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        hc_mult=4,
        layer_types=[KDA, DSA, DSA, KDA],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        max_position_embeddings=1048576,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        swiglu_limit=10.0,
    )


def _small() -> dict:
    n = 8
    return dict(
        vocab_size=16,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=n,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=16,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        q_lora_rank=384,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        v_head_dim=128,
        qk_rope_head_dim=0,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=2048,
        index_kpool=16,
        linear_num_heads=8,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
        hc_mult=4,
        layer_types=[DSA if i % 4 == 3 else KDA for i in range(n)],
        indexer_types=["full"] * n,
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )


def _full() -> dict:
    return dict(HF_TEXT_DEFAULTS)


PRESETS = {"tiny": _tiny, "small": _small, "full": _full}


def preset(name: str, **overrides: Any) -> Glm5NextConfig:
    """Build the named preset (``tiny``, ``small``, ``full``) as a :class:`Glm5NextConfig`.

    Raises:
        ConfigError: unknown preset name.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return from_hf(PRESETS[name](), **overrides)


def preset_hf(name: str) -> dict:
    """The HF text-config dict of the named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return _normalised_hf(PRESETS[name]())


def parameter_count(cfg: Glm5NextConfig) -> dict[str, int]:
    """Parameters of the text model by part, from the shapes alone (no tensors are built).

    Returns a dict with ``embedding``, ``output``, ``kda``, ``dsa``, ``dense_mlp``, ``moe_routed``,
    ``moe_shared``, ``router``, ``norms``, ``mhc``, ``total`` and ``active`` (per token: routed
    experts counted ``moe_router_topk`` times, not ``num_moe_experts``). Buffers (the expert-score
    correction bias) are not parameters and are not counted.
    """
    h, n = cfg.hidden_size, cfg.num_layers
    hc = cfg.hc_mult
    kd = cfg.linear_num_heads * cfg.linear_head_dim
    kda = (
        3 * h * kd  # q, k, v
        + 3 * kd * cfg.linear_conv_kernel_dim  # depthwise short convolutions
        + h * cfg.linear_head_dim + cfg.linear_head_dim * kd + kd + cfg.linear_num_heads  # forget gate
        + h * cfg.linear_num_heads  # beta
        + h * cfg.linear_head_dim + cfg.linear_head_dim * kd  # output gate
        + cfg.linear_head_dim  # gated RMSNorm
        + kd * h  # o_proj
    )
    heads = cfg.num_attention_heads
    mla = (
        h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_nope_head_dim
        + h * cfg.kv_lora_rank + cfg.kv_lora_rank
        + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + heads * cfg.v_head_dim * h
    )
    d_i = cfg.index_head_dim
    indexer = (
        cfg.q_lora_rank * cfg.index_n_heads * d_i + h * d_i + 2 * d_i + h * cfg.index_n_heads
        + cfg.index_kpool * d_i + d_i * h
    )
    dense = 3 * h * cfg.ffn_hidden_size
    n_exp = cfg.num_moe_experts or 0
    expert = 3 * h * (cfg.moe_ffn_hidden_size or 0)
    shared = 3 * h * (cfg.moe_shared_expert_intermediate_size or 0)
    hc_params = (2 + hc) * hc * hc * h + (2 + hc) * hc + 3
    out = {k: 0 for k in ("kda", "dsa", "dense_mlp", "moe_routed", "moe_shared", "router", "norms", "mhc")}
    active_routed = 0
    for i in range(n):
        if cfg.layer_types[i] == KDA:
            out["kda"] += kda
        else:
            out["dsa"] += mla + (indexer if cfg.indexer_types[i] == "full" else 0)
        if cfg.mlp_layer_types[i] == "sparse":
            out["moe_routed"] += n_exp * expert
            out["moe_shared"] += shared
            out["router"] += n_exp * h
            active_routed += cfg.moe_router_topk * expert
        else:
            out["dense_mlp"] += dense
        out["norms"] += 2 * h
        out["mhc"] += 2 * hc_params
    out["norms"] += h
    out["embedding"] = cfg.vocab_size * h
    out["output"] = cfg.vocab_size * h
    out["total"] = sum(out.values())
    out["active"] = out["total"] - out["moe_routed"] + active_routed
    return out


def replace(cfg: Glm5NextConfig, **changes: Any) -> Glm5NextConfig:
    """A copy of ``cfg`` with ``changes`` applied (validation re-runs)."""
    return dataclasses.replace(cfg, **changes)
