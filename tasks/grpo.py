"""GRPO on DNA continuation: reward, group-normalized advantages, clipped objective.

The math of the RL stage, free of models and engines so that it is checked by hand:

* Reward (:func:`continuation_reward`): the policy continues a prompt of ``prompt_len``
  bases from a training chromosome with ``gen_len`` bases (sampling restricted to A/C/G/T);
  the reward compares them with the true continuation in the reference genome.
  ``"match_fraction"``: fraction of positions whose generated base equals the reference base
  (N in the reference matches nothing), range [0, 1]. ``"prefix"``: length of the longest
  exactly matching prefix divided by ``gen_len``, range [0, 1].

  Why match fraction *with* the KL term, for a model judged by held-out bits per base. Per
  base with context ``c``, let ``p(a | c)`` be how often base ``a`` follows ``c`` in the
  genome. The expected reward of sampling ``a`` is ``p(a | c)``, so the per-base objective
  ``E_{a~pi}[p(a | c)] - beta KL(pi || pi_ref)`` is maximised (Gibbs variational principle) by
  ``pi*(a) ~ pi_ref(a) exp(p(a | c) / beta)``. Without the KL term (``beta -> 0``) the optimum
  is the argmax base: a deterministic policy with unbounded loss on every other base, the
  opposite of what bits per base reward. With it: (i) a calibrated reference (``pi_ref = p``)
  is kept to second order, ``KL(p || pi*) ~ Var_{a~p}[p(a)] / (2 beta^2)`` nats, at most
  ``1 / (8 beta^2)`` and ``0.005`` nats for ``p = (0.4, 0.3, 0.2, 0.1)`` at ``beta = 1``;
  (ii) a reference that under-predicts the bases that occur moves toward ``p`` at first
  order, the cross-entropy falling by ``(sum_a p(a)^2 - sum_a pi_ref(a) p(a)) / beta``. So
  ``beta`` of about 1 per base makes the reward a bounded, calibration-preserving correction
  of the SFT model. The loss below averages over tokens and the reward over ``gen_len``
  bases, so the per-base ``beta`` is ``kl_coef x gen_len`` (the RL stage sets ``kl_coef``
  from the preset's ``kl_per_base``), and Dr. GRPO advantages (``scale_by_std=False``) keep
  the reward's scale against ``beta`` instead of renormalising it per group.
* Advantages (:func:`group_advantages`): GRPO (Shao et al. 2024, DeepSeekMath, arXiv
  2402.03300, eq. 3): ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` over the
  ``group_size`` rollouts of one prompt; with ``scale_by_std=False`` the division is dropped
  (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).
* Loss (:func:`grpo_loss`), per generated token ``t`` with ``ratio = exp(logp - logp_old)``:
  PPO clipped surrogate (Schulman et al. 2017) ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)``,
  multiplied by the truncated importance weight ``min(exp(logp_old - logp_rollout), C)``
  between the trainer's and the inference engine's log-probs of the sampled token (TIS, Yao
  et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"), plus
  ``beta`` times the k3 KL estimator to the SFT reference, ``exp(ref - logp) - (ref - logp) - 1``
  (Schulman 2020, "Approximating KL divergence"), averaged over all generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tasks import vocab


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO objective knobs.

    Attributes:
        clip_eps: PPO ratio clip half-width.
        kl_coef: weight ``beta`` of the k3 KL to the reference policy.
        tis_cap: cap ``C`` of the truncated importance weight trainer/engine.
        scale_by_std: divide advantages by the group's reward std (GRPO) or not (Dr. GRPO).
        adv_eps: added to the std in the advantage denominator.
    """

    clip_eps: float = 0.2
    kl_coef: float = 0.01
    tis_cap: float = 2.0
    scale_by_std: bool = True
    adv_eps: float = 1e-6


def continuation_reward(generated: np.ndarray, reference: np.ndarray, kind: str = "match_fraction") -> float:
    """Reward of one rollout against the reference genome's true continuation.

    Args:
        generated: token ids ``[gen_len]`` (int) produced by the policy.
        reference: token ids ``[gen_len]`` of the reference continuation.
        kind: ``"match_fraction"`` or ``"prefix"`` (see module docstring). Range [0, 1].

    Raises:
        ValueError: shapes differ or ``kind`` is unknown.
    """
    generated, reference = np.asarray(generated), np.asarray(reference)
    if generated.shape != reference.shape or generated.ndim != 1 or generated.size == 0:
        raise ValueError(f"generated {generated.shape} and reference {reference.shape} must be equal, 1-D, non-empty")
    hit = (generated == reference) & (reference >= vocab.A) & (reference <= vocab.T)
    if kind == "match_fraction":
        return float(hit.mean())
    if kind == "prefix":
        misses = np.flatnonzero(~hit)
        return float((misses[0] if misses.size else hit.size) / hit.size)
    raise ValueError(f"unknown reward kind {kind!r}: expected 'match_fraction' or 'prefix'")


def group_advantages(rewards: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Group-normalized advantages.

    Args:
        rewards: float ``[n_prompts, group_size]``.

    Returns:
        float ``[n_prompts, group_size]``; the std is the population std (``unbiased=False``).
    """
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not cfg.scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + cfg.adv_eps)


def grpo_token_terms(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    cfg: GRPOConfig,
) -> dict[str, torch.Tensor]:
    """Per-token GRPO terms (no reduction): what :func:`grpo_loss` averages.

    Ranks that hold different tokens of one batch (data and context parallelism) sum these
    over their tokens and reduce the sums; the mean over all tokens is the same as on one rank.

    Args:
        logp, logp_old, logp_ref, logp_rollout: float ``[n_rollouts, k]`` log-probs (nats) of
            ``k`` sampled tokens: current policy (requires grad), the policy that generated the
            batch (trainer side, detached), the frozen SFT reference, the inference engine.
        advantages: ``[n_rollouts]``, broadcast over each rollout's tokens.

    Returns:
        float ``[n_rollouts, k]`` tensors: ``objective`` (TIS-weighted clipped surrogate plus
        ``kl_coef`` x k3 KL; differentiable), and detached ``kl``, ``clipped`` (1.0 where the
        ratio left the clip range), ``tis_weight``, ``gap`` (``|logp_old - logp_rollout|``).
    """
    adv = advantages[:, None].to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    surrogate = -torch.minimum(ratio * adv, clipped * adv)
    tis = torch.exp(logp_old - logp_rollout).clamp(max=cfg.tis_cap).detach()
    log_ratio_ref = logp_ref - logp
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
    return {
        "objective": tis * surrogate + cfg.kl_coef * kl,
        "kl": kl.detach(),
        "clipped": ((ratio - 1.0).abs() > cfg.clip_eps).to(logp.dtype).detach(),
        "tis_weight": tis,
        "gap": (logp_old - logp_rollout).abs().detach(),
    }


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss over generated tokens (the mean of :func:`grpo_token_terms`), with metrics.

    Args:
        logp: trainer log-probs of the sampled tokens under the current policy, float
            ``[n_rollouts, gen_len]`` (requires grad).
        logp_old: the same under the policy that generated the batch (trainer side), detached.
        logp_ref: the same under the frozen SFT reference, detached.
        logp_rollout: the inference engine's log-probs of the sampled tokens, ``[n_rollouts, gen_len]``.
        advantages: ``[n_rollouts]``, one per rollout (broadcast over its tokens).
        mask: bool ``[n_rollouts, gen_len]``, True for tokens that count.

    Returns:
        (scalar loss, metrics: kl, clip_fraction, tis_weight_mean,
        rollout_train_logprobs_abs_diff_mean/max).
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp_min(1.0)
    terms = grpo_token_terms(logp, logp_old, logp_ref, logp_rollout, advantages, cfg)
    loss = (terms["objective"] * mask).sum() / n_tokens
    metrics = {
        "kl": float((terms["kl"] * mask).sum() / n_tokens),
        "clip_fraction": float((terms["clipped"] * mask).sum() / n_tokens),
        "tis_weight_mean": float((terms["tis_weight"] * mask).sum() / n_tokens),
        "rollout_train_logprobs_abs_diff_mean": float((terms["gap"] * mask).sum() / n_tokens),
        "rollout_train_logprobs_abs_diff_max": float((terms["gap"] * mask).max()),
    }
    return loss, metrics
