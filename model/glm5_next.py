"""The glm5_next text model (GLM-5.3-Flash architecture) as megatron-core ModuleSpecs.

Structure (transformers ``Glm5NextTextModel`` + ``lm_head``): token embedding copied into
``hc_mult`` residual streams ``[s, b, n, h]``; per layer, an mHC-wrapped token mixer (KDA or DSA,
by ``layer_types``) and an mHC-wrapped MLP (dense SwiGLU or MoE, by ``mlp_layer_types``; the MoE's
routed experts as grouped GEMMs, :mod:`model.moe`, or megatron's SequentialMLP, by ``moe_experts``);
the final stream mean, RMSNorm and the output head.

A layer is assembled from a :class:`Glm5NextLayerSubmodules` spec: KDA and DSA layers differ in
the ``mixer`` entry only, dense and MoE layers in the ``mlp`` entry (megatron's ``MLP`` and
``MoELayer`` builders from ``get_mlp_module_spec``). The ``[s, b, n, h]`` streams do not fit
megatron's ``TransformerLayer`` (its residual is one ``[s, b, h]`` tensor), so
:class:`Glm5NextLayer` is its own module that keeps megatron's hooks:

* recompute: ``recompute_granularity="full"`` checkpoints whole layers
  (``tensor_parallel.checkpoint``, RNG-tracker aware) and, inside them, each MLP/MoE chunk when
  there are several (the MLP/MoE runs forward twice per step with one chunk, three times with more);
  ``"selective"`` with ``"mlp"`` / ``"moe"``
  in ``recompute_modules`` checkpoints the MLP/MoE only;
* activation offload: ``cpu_offloading=True`` saves the activations of the first
  ``cpu_offloading_num_layers`` layers to pinned host memory (:class:`model.offload.OffloadActivations`,
  one host copy per saved storage; on a GPU the copies run on a copy stream and each offloaded layer
  prefetches the one before in backward, :class:`model.offload.OffloadChain`);
* sequence-chunked MLP/MoE: ``mlp_chunk_tokens > 0`` runs the MLP/MoE (router and dispatch
  included) on chunks of that many tokens, which bounds the dispatch buffers at 1M tokens and
  balances expert load per chunk.

Packing (``cu_seqlens``): documents joined in one row (``b == 1``) are separated exactly: KDA
state and convolution restart at each document start and the DSA indexer selects only keys of
the query's own document; the MLP is per token. Not combined with CP here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from model.config import DSA, Glm5NextConfig
from model.layers import DSAMixer, HyperConnection, KDAMixer, RMSNorm, init_normal, merge_streams
from model.moe import GatherMoELayer, GroupedMLP, SwiGLUActivation
from model.offload import OffloadChain
from model.parallel import ParallelLayout

__all__ = ["Glm5NextLayerSubmodules", "Glm5NextLayer", "Glm5NextModel", "layer_spec", "build_model", "mlp_recomputed"]


def mlp_recomputed(granularity: str | None, modules, is_moe: bool) -> bool:
    """Whether a layer's MLP/MoE chunks are checkpointed (recomputed in backward).

    ``selective`` with ``"mlp"`` (every MLP) or ``"moe"`` (MoE layers) in ``modules``, and
    ``full``: full-layer recompute checkpoints the chunks too, so the layer's recompute in
    backward holds one chunk's MLP activations instead of the whole sequence's. A layer whose
    tokens are one chunk is not checkpointed again inside its full-layer checkpoint
    (:meth:`Glm5NextLayer._chunked_mlp`): that would hold the same activations at the same time.
    """
    return granularity == "full" or (
        granularity == "selective" and ("mlp" in modules or (is_moe and "moe" in modules)))


@dataclass
class Glm5NextLayerSubmodules:
    """Spec of one layer: the token mixer (KDA or DSA) and the MLP builder (dense or MoE)."""

    mixer: ModuleSpec
    mlp: Any


def _with_swiglu(builder):
    """An MLP builder of megatron's spec (a ``functools.partial`` with ``submodules=MLPSubmodules``, or
    None) with :class:`model.moe.SwiGLUActivation` in its activation slot."""
    if builder is None:
        return None
    sub = dataclasses.replace(builder.keywords["submodules"], activation_func=SwiGLUActivation)
    return functools.partial(builder.func, *builder.args, **{**builder.keywords, "submodules": sub})


def layer_spec(config: Glm5NextConfig, layer_idx: int) -> ModuleSpec:
    """The ModuleSpec of layer ``layer_idx`` (0-based) from the config's schedules."""
    if config.layer_types[layer_idx] == DSA:
        mixer = ModuleSpec(module=DSAMixer, params={"shared_indexer": config.indexer_types[layer_idx] == "shared"})
    else:
        mixer = ModuleSpec(module=KDAMixer)
    moe = config.mlp_layer_types[layer_idx] == "sparse"
    mlp = get_mlp_module_spec(use_te=False, num_experts=config.num_moe_experts if moe else None)
    if moe:
        # megatron's local MoE spec: MoELayer with SequentialMLP experts; the layer's class carries the
        # token permutation (moe_permute), the experts' module the expert path (moe_experts)
        sub = mlp.keywords["submodules"]
        sub = dataclasses.replace(sub, experts=_with_swiglu(sub.experts),
                                  shared_experts=_with_swiglu(sub.shared_experts))
        if config.moe_experts == "grouped":
            sub = dataclasses.replace(sub, experts=functools.partial(GroupedMLP, *sub.experts.args,
                                                                     **sub.experts.keywords))
        mlp = functools.partial(GatherMoELayer, *mlp.args, **{**mlp.keywords, "submodules": sub})
    else:
        mlp = _with_swiglu(mlp)
    return ModuleSpec(module=Glm5NextLayer, submodules=Glm5NextLayerSubmodules(mixer=mixer, mlp=mlp))


class Glm5NextLayer(MegatronModule):
    """One decoder layer on ``hc_mult`` residual streams (``Glm5NextTextDecoderLayer``).

    ``forward(streams [s, b, n, h], prev_topk, cu_seqlens) -> (streams, topk)``; ``topk`` is the
    DSA selection ``[b, s, W]`` of this layer (None for KDA layers), handed to the next layer.
    """

    def __init__(self, config: Glm5NextConfig, submodules: Glm5NextLayerSubmodules, layer_number: int = 1,
                 layout: ParallelLayout | None = None):
        super().__init__(config)
        self.layer_number = layer_number
        self.attn_hc = HyperConnection(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.compile_glue)
        self.mixer = build_module(submodules.mixer, config=config, layer_number=layer_number, layout=layout)
        self.ffn_hc = HyperConnection(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.compile_glue)
        self.is_moe = config.mlp_layer_types[layer_number - 1] == "sparse"
        # megatron's MoELayer requires sequence parallelism under TP when training; the mixers run
        # without it, so the MoE alone sees the sequence split over TP ranks (scatter/gather below).
        self.moe_sequence_parallel = self.is_moe and config.tensor_model_parallel_size > 1
        mlp_config = dataclasses.replace(config, sequence_parallel=True) if self.moe_sequence_parallel else config
        self.mlp = submodules.mlp(config=mlp_config, pg_collection=get_default_pg_collection(), is_mtp_layer=False)
        if hasattr(self.mlp, "set_layer_number"):
            self.mlp.set_layer_number(layer_number)
        self.recompute_mlp = mlp_recomputed(config.recompute_granularity, config.recompute_modules, self.is_moe)

    def _merge(self, post, comb, out, streams):
        return merge_streams(post, comb, out, streams, self.config.compile_glue)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe_sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        out, bias = self.mlp(x)
        out = out if bias is None else out + bias
        if self.moe_sequence_parallel:
            # Downstream compute is replicated over TP, so each rank already holds the full gradient.
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out

    def _chunked_mlp(self, x: torch.Tensor) -> torch.Tensor:
        chunk = self.config.mlp_chunk_tokens
        whole = chunk <= 0 or x.shape[0] * x.shape[1] <= chunk
        fn = self._mlp
        # Inside a full-layer checkpoint a checkpointed single chunk saves nothing: its backward
        # recomputes the same activations while the layer's recomputed ones are alive, the same
        # peak, for one more MLP/MoE forward (and MoE dispatch). Only several chunks are checkpointed.
        if self.recompute_mlp and not (whole and self.config.recompute_granularity == "full"):
            fn = lambda t: tensor_parallel.checkpoint(self._mlp, False, t)  # noqa: E731
        if whole:
            return fn(x)
        rows = max(1, chunk // x.shape[1])
        return torch.cat([fn(part) for part in x.split(rows, dim=0)], dim=0)

    def forward(self, streams: torch.Tensor, prev_topk: torch.Tensor | None = None, cu_seqlens=None,
                keep_attention: bool = False):
        """``keep_attention``: this call is the forward or the recompute of a full-layer checkpoint
        whose DSA sparse attention output is kept (:meth:`model.layers.DSAMixer.forward`)."""
        post, comb, x, streams = self.attn_hc(streams)
        x = self.input_layernorm(x)
        if isinstance(self.mixer, DSAMixer):
            x, topk = self.mixer(x, prev_topk=prev_topk, cu_seqlens=cu_seqlens, keep_attention=keep_attention)
        else:
            x, topk = self.mixer(x, cu_seqlens=cu_seqlens), None
        streams = self._merge(post, comb, x, streams)
        post, comb, x, streams = self.ffn_hc(streams)
        x = self._chunked_mlp(self.post_attention_layernorm(x))
        return self._merge(post, comb, x, streams), topk


class Glm5NextModel(MegatronModule):
    """glm5_next text model with its output head; megatron layout ``[s, b, ...]`` inside.

    ``forward(input_ids [b, s], labels=None, cu_seqlens=None)``: with ``labels`` returns the
    per-token cross-entropy ``[b, s]`` (float32, computed ``logits_chunk_tokens`` tokens at a time,
    each chunk's logits recomputed in backward: full-vocabulary logits never exist for all
    positions at once); without, the final hidden states ``[s, b, h]``. Under CP, ``input_ids`` and
    ``labels`` are this rank's contiguous shard. ``layout`` (:class:`model.parallel.ParallelLayout`)
    reaches every mixer.
    """

    def __init__(self, config: Glm5NextConfig, logits_chunk_tokens: int = 4096, layout: ParallelLayout | None = None):
        super().__init__(config)
        init = init_normal(config.init_method_std)
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size, init_method=init, config=config)
        self.layers = torch.nn.ModuleList(
            [build_module(layer_spec(config, i), config=config, layer_number=i + 1, layout=layout)
             for i in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.compile_glue)
        self.output_layer = ColumnParallelLinear(config.hidden_size, config.vocab_size, config=config, init_method=init,
                                                 bias=False, gather_output=False)
        self.logits_chunk_tokens = logits_chunk_tokens

    def _layer_call(self, layer: Glm5NextLayer, streams, topk, cu_seqlens, offload: OffloadChain | None = None):
        c = self.config
        offloaded = offload is not None and layer.layer_number <= c.cpu_offloading_num_layers
        ctx = offload.context() if offloaded else contextlib.nullcontext()
        with ctx:
            if c.recompute_granularity == "full" and self.training:
                # kept only for a forward whose backward recomputes it (the checkpoint runs without grad)
                keep = c.recompute_keep_attention and torch.is_grad_enabled()
                return tensor_parallel.checkpoint(
                    lambda s, t: layer(s, t, cu_seqlens, keep_attention=keep), False, streams, topk
                )
            return layer(streams, topk, cu_seqlens)

    def hidden_states(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[s, b, h]`` of ``input_ids [b, s]``."""
        x = self.embedding(input_ids).transpose(0, 1)  # [s, b, h]
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        topk = None
        # one copy stream per forward; each offloaded layer prefetches the one before in backward
        offload = OffloadChain() if self.config.cpu_offloading and torch.is_grad_enabled() else None
        for layer in self.layers:
            streams, topk = self._layer_call(layer, streams, topk, cu_seqlens, offload)
        return self.final_norm(streams.mean(dim=2))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel logits ``[..., vocab / tp]`` of ``hidden [..., h]``."""
        return self.output_layer(hidden)[0]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cu_seqlens=None):
        hidden = self.hidden_states(input_ids, cu_seqlens)
        if labels is None:
            return hidden
        from model.logprobs import chunked_token_nll

        return chunked_token_nll(self, hidden, labels.transpose(0, 1), self.logits_chunk_tokens).transpose(0, 1)


def build_model(config: Glm5NextConfig, *, seed: int = 0, logits_chunk_tokens: int = 4096,
                dtype: torch.dtype | None = None, layout: ParallelLayout | None = None,
                zero_head: bool = False) -> Glm5NextModel:
    """Build the glm5_next model for this rank in ``layout`` (TP/CP; EP through megatron's MoE).

    Initialises ``parallel_state`` for a single process (gloo) if no one did, enables
    :mod:`model.cpu_compat` when no GPU is present, seeds megatron's model-parallel RNG with
    ``seed``. ``dtype`` casts parameters (the router's ``expert_bias`` stays float32). ``layout``
    is the trainer's (:func:`tasks.trainer.init_parallel`); without one, the layout megatron's
    ``parallel_state`` was initialised with (:meth:`ParallelLayout.from_megatron`), read once here.

    ``zero_head`` sets the output head to zero after the usual initialisation (every other weight
    as without it): the initialisation to train from. Every logit starts at 0 and the loss at
    ``ln(vocab_size)``, the readout of muP (Yang et al. 2022, arXiv 2203.03466, Tensor Programs V).
    With the head at ``init_method_std`` = 0.02 over the `small` preset's 1024 final-norm
    channels the logits start with std ~0.64 and the loss 0.15-0.4 nats above ``ln 16``; its
    gradient (norm ~50) reaches every weight of the body in the first steps, and the loss jumped
    to 4-8 nats at steps 3-6 at every peak lr from 3e-4 to 3e-3 on an H200, with or without
    warm-up. With a zero head the same runs fall smoothly (``docs/measurements.md``, "Stable
    training"). Off by default: the HF reference's ``_init_weights`` draws the head like every
    other weight, and checks that compare two models at initialisation need a head that
    carries the body's differences into the logits.
    """
    from model import cpu_compat

    cpu_compat.enable()
    if not torch.distributed.is_initialized():
        cpu_compat.init_process_group(0, 1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    layout = layout or ParallelLayout.from_megatron()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = Glm5NextModel(config, logits_chunk_tokens=logits_chunk_tokens, layout=layout)
    if zero_head:
        with torch.no_grad():
            model.output_layer.weight.zero_()
    if dtype is not None:
        model.to(dtype)
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.router._maintain_float32_expert_bias()
    if torch.cuda.is_available():
        model.cuda()
    return model
