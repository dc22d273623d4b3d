"""transformers' glm5_next as the tests' independent numerical reference (plain-torch paths on CPU)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import torch


def _lower_index_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` with the project's tie rule (equal scores: the lower index first)."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def transformers_logits(export: Path, sequences: list[np.ndarray]) -> list[torch.Tensor]:
    """Float64 logits ``[len(seq), vocab]`` of each int64 token sequence, from the HF export's
    ``Glm5NextForConditionalGeneration`` in float32 (the DSA top-k under the project's tie rule)."""
    from transformers import Glm5NextForConditionalGeneration

    hf = Glm5NextForConditionalGeneration.from_pretrained(str(export), dtype=torch.float32).eval()
    out = []
    with mock.patch.object(torch.Tensor, "topk", _lower_index_topk), torch.no_grad():
        for ids in sequences:
            out.append(hf(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].double())
    return out
