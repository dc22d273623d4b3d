"""The mHC kernels: the projection of bf16 residual streams on tensor cores (torch reference and Triton kernels),
and the maps of its logits in Triton (:mod:`kernels.hc.maps_triton`; the torch definition is
:func:`model.fused.hc_maps_of_logits`)."""

from kernels.hc.projection import bf16_parts, hc_projection

__all__ = ["bf16_parts", "hc_projection"]
