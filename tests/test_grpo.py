"""GRPO: advantages and every loss mode against hand-computed values, degenerate batches, corrections, and the
options of the loop that use them (KL reference, PPO-style reuse, gradient accumulation)."""
import math
import pytest
import torch

from jetrl.grpo import GRPOConfig, LOSS_TYPES, group_advantages, grpo_loss, rollout_correction


def test_group_advantages_by_hand():
    rewards, group = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0]), torch.tensor([0, 0, 0, 1, 1])
    adv, stats = group_advantages(rewards, group, "group", eps=0.0)
    # group 0: mean 0.5, sample std 0.5 -> (1, -1, 0); group 1: all equal -> 0, counted as zero-std
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0]))
    assert stats["zero_std_groups"] == 1 and stats["groups"] == 2
    none, _ = group_advantages(rewards, group, "none")
    assert torch.allclose(none, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))
    batch, _ = group_advantages(rewards, group, "batch", eps=0.0)
    assert torch.allclose(batch, none / rewards.std())
    with pytest.raises(ValueError, match="scale_rewards"): group_advantages(rewards, group, "max")


def test_single_sample_groups_and_empty_completions_give_zero_loss():
    adv, stats = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))
    assert torch.equal(adv, torch.zeros(2)) and stats["zero_std_groups"] == 2
    logp = torch.zeros(2, 3, requires_grad=True)
    for loss_type in LOSS_TYPES:
        loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), torch.ones(2), torch.zeros(2, 3), GRPOConfig(loss_type=loss_type))
        assert loss.item() == 0 and stats["loss/tokens"] == 0
        loss.backward()
        assert torch.equal(logp.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("loss_type, expected", [
    # token losses -A (on-policy: ratio 1): row 0 has 3 tokens of A=+2, row 1 has 1 token of A=-1
    ("dapo", -(3 * 2 + 1 * -1) / 4),          # all tokens of the batch
    ("bnpo", -(3 * 2 + 1 * -1) / 4),          # the micro-batch's tokens (one micro-batch here)
    ("grpo", -(2 + -1) / 2),                  # per-sequence mean, then mean over sequences
    ("dr_grpo", -(3 * 2 + 1 * -1) / (2 * 5)),  # constant: sequences x max_completion_length
])
def test_loss_aggregations_by_hand(loss_type, expected):
    logp = torch.full((2, 3), math.log(0.5), requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([2.0, -1.0]), mask,
                        GRPOConfig(loss_type=loss_type, max_completion_length=5))
    assert loss.item() == pytest.approx(expected)


def test_dapo_normalizer_spans_gradient_accumulation():
    "With loss_normalizer = tokens of the whole batch, micro-batch losses add up to the full-batch loss."
    torch.manual_seed(0)
    logp = torch.randn(4, 5).clamp(max=0)
    mask = (torch.rand(4, 5) > 0.3).long()
    adv = torch.randn(4)
    cfg = GRPOConfig(loss_type="dapo")
    full, _ = grpo_loss(logp, logp, logp, adv, mask, cfg)
    parts = [grpo_loss(logp[r], logp[r], logp[r], adv[r], mask[r], cfg, loss_normalizer=float(mask.sum()))[0]
             for r in (slice(0, 1), slice(1, 4))]
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-6)


def test_clipping_and_clip_higher():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[0.7, 1.1, 1.3]])).requires_grad_()          # ratios 0.7, 1.1, 1.3
    loss, stats = grpo_loss(logp, old, old, torch.tensor([1.0]), torch.ones(1, 3), GRPOConfig(epsilon=0.2, epsilon_high=0.28))
    loss.backward()
    # A > 0: ratio 1.3 > 1 + 0.28 is clipped (no gradient); 0.7 and 1.1 pull with gradient -ratio / 3
    assert torch.allclose(logp.grad, torch.tensor([[-0.7 / 3, -1.1 / 3, 0.0]]))
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 3) and stats["clip_ratio/low_mean"] == 0


def test_kl_to_reference_k3():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    cfg = GRPOConfig(beta=0.1, loss_type="dapo")
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 2), cfg, ref_logp=ref)
    d = math.log(0.25 / 0.5)                                                     # ref - logp on token 0; 0 on token 1
    assert loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1) / 2)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 2), cfg)


def test_tis_weights_multiply_and_mis_masks():
    old = torch.log(torch.tensor([[0.4, 0.4, 0.4]]))
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.8]]))                        # ratios 4, 1, 0.5
    mask = torch.ones(1, 3)
    weight, keep = rollout_correction(old, rollout, mask, GRPOConfig(tis_cap=2.0, mis_cap=3.0))
    assert torch.allclose(weight, torch.tensor([[2.0, 1.0, 0.5]])) and torch.equal(keep, torch.tensor([[0.0, 1.0, 1.0]]))
    seq_weight, seq_keep = rollout_correction(old, rollout, mask, GRPOConfig(tis_cap=2.0, tis_level="sequence",
                                                                                mis_cap=1.5, mis_level="sequence"))
    assert torch.allclose(seq_weight, torch.full((1, 3), 2.0))                     # product 4 * 1 * 0.5 = 2 -> capped at 2
    assert torch.equal(seq_keep, torch.zeros(1, 3))                                # log 2 > log 1.5: whole sequence dropped
    logp = old.clone().requires_grad_()
    loss, stats = grpo_loss(logp, old, rollout, torch.tensor([1.0]), mask, GRPOConfig(tis_cap=2.0))
    assert loss.item() == pytest.approx(-(2.0 + 1.0 + 0.5) / 3)                  # weights times -A, token mean
    assert stats["correction/weight_mean"] == pytest.approx(3.5 / 3)


def test_truncated_completions_can_be_masked():
    logp = torch.zeros(2, 2, requires_grad=True)
    cfg = GRPOConfig(mask_truncated_completions=True)
    loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, 3.0]), torch.ones(2, 2), cfg,
                            truncated=torch.tensor([False, True]))
    assert loss.item() == pytest.approx(-1.0) and stats["loss/tokens"] == 2


@pytest.mark.parametrize("bad", [dict(loss_type="ppo"), dict(scale_rewards="max"), dict(epsilon=1.5), dict(tis_cap=0.5),
                                 dict(mis_cap=0.9), dict(tis_level="batch"), dict(num_iterations=0), dict(num_generations=0)])
def test_bad_config(bad):
    with pytest.raises(ValueError): GRPOConfig(**bad)


def test_loop_options_run(model_dir, tmp_path):
    "KL reference (beta), PPO-style reuse (num_iterations) and gradient accumulation in a real run."
    from jetrl.train import TrainConfig, train
    config = TrainConfig(model=model_dir, strategy="bf16", steps=2, prompts_per_step=2, max_new_tokens=6, lr=1e-3, micro_batch_size=3,
                         grpo=GRPOConfig(num_generations=4, beta=0.05, num_iterations=2))
    run = train(config)
    assert run.ref_model is not None and all(not p.requires_grad for p in run.ref_model.parameters())
    last = run.history[-1]
    assert "reuse/ratio_mean" in last and last["grad_norm"] >= 0
