"""Per-token log-probabilities and cross-entropy without full-vocabulary logits for all positions.

Vocabulary decision: the output head keeps its full width (a pretrained checkpoint's 154,880-row
head stays as is; presets use 16 rows for the 9 DNA ids). Memory is bounded instead by chunking
the sequence: logits exist for ``chunk_tokens`` positions at a time, in float32, and in training
each chunk is recomputed in backward (``torch.utils.checkpoint``). Under TP the head is
vocabulary-parallel and megatron's ``vocab_parallel_cross_entropy`` reduces across ranks.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_token_nll", "restricted_token_logprobs", "token_logprobs"]


def _chunk_nll(model, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model.logits(hidden).float()
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.contiguous())


def chunked_token_nll(model, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    """Negative log-likelihood of ``labels`` per position, in chunks.

    Args:
        model: a :class:`model.glm5_next.Glm5NextModel` (its ``logits``).
        hidden: final hidden states ``[s, b, h]``.
        labels: ``[s, b]`` int64 target ids (the next tokens).
        chunk_tokens: positions per chunk (``s``-rows of ``chunk_tokens // b``).

    Returns:
        ``[s, b]`` float32 NLL in nats.
    """
    rows = max(1, chunk_tokens // hidden.shape[1])
    outs = []
    for h, y in zip(hidden.split(rows, 0), labels.split(rows, 0)):
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk_nll, model, h, y, use_reentrant=False))
        else:
            outs.append(_chunk_nll(model, h, y))
    return torch.cat(outs, 0)


def restricted_token_logprobs(model, hidden: torch.Tensor, labels: torch.Tensor, allowed_token_ids: tuple[int, ...],
                              temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``labels`` under the model restricted to ``allowed_token_ids`` at ``temperature``.

    ``log softmax(logits[allowed] / temperature)[label]``: the distribution an inference engine
    samples from with ``allowed_token_ids`` and ``temperature`` (vLLM's ``processed_logprobs``,
    no top-k/top-p), so the RL trainer's ratio and importance weights compare like with like.
    Under TP the vocabulary-parallel logits are gathered first (differentiable); only the rows
    of ``hidden`` are scored, so callers pass the few positions that predict sampled tokens.

    Args:
        model: a :class:`model.glm5_next.Glm5NextModel`.
        hidden: final hidden states ``[s, b, h]``.
        labels: ``[s, b]`` int64 ids, each one of ``allowed_token_ids``.
        allowed_token_ids: the ids sampled from (e.g. the four bases).
        temperature: > 0.

    Returns:
        ``[s, b]`` float32 log-probs in nats.

    Raises:
        ValueError: a label outside ``allowed_token_ids``, or ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: the restricted log-probs need temperature > 0")
    allowed = torch.tensor(allowed_token_ids, device=labels.device)
    where = labels.unsqueeze(-1) == allowed                         # [s, b, len(allowed)]
    if not bool(where.any(-1).all()):
        bad = sorted(set(labels[~where.any(-1)].tolist()))
        raise ValueError(f"labels {bad[:8]} are not among the allowed ids {tuple(allowed_token_ids)}")
    logits = model.logits(hidden).float()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    logp = torch.log_softmax(logits[..., allowed] / temperature, dim=-1)
    return (logp * where).sum(-1)


@torch.no_grad()
def token_logprobs(model, input_ids: torch.Tensor, chunk_tokens: int = 4096, cu_seqlens=None,
                   labels: torch.Tensor | None = None) -> torch.Tensor:
    """Forward-only log-probability of each actual next token.

    Args:
        model: a :class:`model.glm5_next.Glm5NextModel` (eval mode is the caller's choice).
        input_ids: ``[b, s]`` int64.
        chunk_tokens: positions whose logits exist at once.
        cu_seqlens: optional packed-document bounds (``b == 1``).
        labels: ``[b, s]`` next-token ids for every position. Needed under context parallelism,
            where the label of a shard's last position is the first token of the next shard;
            without it the labels are ``input_ids`` shifted by one inside this call.

    Returns:
        ``[b, s - 1]`` float32 ``log p(input_ids[:, t + 1] | input_ids[:, : t + 1])``, or ``[b, s]``
        ``log p(labels[:, t] | input_ids[:, : t + 1])`` when ``labels`` is given.
    """
    hidden = model.hidden_states(input_ids, cu_seqlens)
    if labels is None:
        hidden, labels = hidden[:-1], input_ids[:, 1:]
    return -chunked_token_nll(model, hidden, labels.transpose(0, 1), chunk_tokens).transpose(0, 1)
