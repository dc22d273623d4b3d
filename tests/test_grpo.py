"""GRPO math against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks.grpo import GRPOConfig, continuation_reward, group_advantages, grpo_loss

A, C, G, T, N = 4, 5, 6, 7, 8


def test_rewards_by_hand():
    assert continuation_reward(np.array([A, C, G, T]), np.array([A, C, T, T])) == 0.75
    assert continuation_reward(np.array([A, C, G, T]), np.array([A, C, T, T]), "prefix") == 0.5
    # N in the reference matches nothing, even a generated N.
    assert continuation_reward(np.array([N, C, G, T]), np.array([N, C, G, T])) == 0.75
    assert continuation_reward(np.array([N, C, G, T]), np.array([N, C, G, T]), "prefix") == 0.0
    assert continuation_reward(np.array([G, G]), np.array([G, G]), "prefix") == 1.0
    with pytest.raises(ValueError, match="reward kind"):
        continuation_reward(np.array([A]), np.array([A]), "bleu")


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, GRPOConfig(adv_eps=0.0 + 1e-12))
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    torch.testing.assert_close(adv[1], torch.zeros(4))  # equal rewards carry no signal
    dr = group_advantages(rewards, GRPOConfig(scale_by_std=False))
    torch.testing.assert_close(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def _loss(delta_old=0.0, delta_rollout=0.0, delta_ref=0.0, adv=2.0, cfg=GRPOConfig()):
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    old = torch.full((1, 2), -1.0 - delta_old)
    ref = torch.full((1, 2), -1.0 + delta_ref)
    rollout = old - delta_rollout
    loss, metrics = grpo_loss(logp, old, ref, rollout, torch.tensor([adv]), torch.ones(1, 2, dtype=torch.bool), cfg)
    return logp, loss, metrics


def test_on_policy_loss_is_minus_advantage_and_gradient_by_hand():
    logp, loss, metrics = _loss(adv=2.0)
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    # d/dlogp of -(exp(logp - old) * A) / 2 tokens at ratio 1: -A / 2 = -1 per token.
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -1.0))
    assert metrics["kl"] == pytest.approx(0.0) and metrics["clip_fraction"] == 0.0


def test_clipping_by_hand():
    cfg = GRPOConfig(kl_coef=0.0)
    _, loss_pos, m = _loss(delta_old=math.log(1.5), adv=1.0, cfg=cfg)   # ratio 1.5 -> clipped to 1.2
    assert loss_pos.item() == pytest.approx(-1.2, rel=1e-6) and m["clip_fraction"] == 1.0
    _, loss_neg, _ = _loss(delta_old=math.log(1.5), adv=-1.0, cfg=cfg)  # pessimistic side keeps 1.5
    assert loss_neg.item() == pytest.approx(1.5, rel=1e-6)


def test_truncated_importance_weight_and_gap_metrics_by_hand():
    cfg = GRPOConfig(kl_coef=0.0, tis_cap=2.0)
    _, loss, m = _loss(delta_rollout=math.log(3.0), adv=1.0, cfg=cfg)  # weight 3 capped at 2
    assert loss.item() == pytest.approx(-2.0, rel=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(2.0)
    assert m["rollout_train_logprobs_abs_diff_mean"] == pytest.approx(math.log(3.0), rel=1e-6)
    assert m["rollout_train_logprobs_abs_diff_max"] == pytest.approx(math.log(3.0), rel=1e-6)


def test_k3_kl_by_hand():
    cfg = GRPOConfig(kl_coef=1.0)
    _, loss, m = _loss(delta_ref=math.log(2.0), adv=0.0, cfg=cfg)    # ref - logp = log 2
    expected = 2.0 - math.log(2.0) - 1.0
    assert m["kl"] == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
