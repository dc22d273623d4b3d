"""Plain-torch operators of the glm5_next model (CPU paths and references)."""

from model.ops.kda import chunk_kda_torch, naive_recurrent_kda

__all__ = ["chunk_kda_torch", "naive_recurrent_kda"]
