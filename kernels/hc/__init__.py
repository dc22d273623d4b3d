"""The mHC projection of bf16 residual streams on tensor cores: torch reference and Triton kernels."""

from kernels.hc.projection import bf16_parts, hc_projection

__all__ = ["bf16_parts", "hc_projection"]
