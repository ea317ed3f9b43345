"""GRPO: advantages and every loss mode against hand-computed values, degenerate batches, corrections, and the
options of the loop that use them (KL reference, PPO-style reuse, gradient accumulation)."""
import math
import pytest
import torch

from jetrl.grpo import (GRPOConfig, LOSS_TYPES, ROLLOUT_IS_MODES, group_advantages, grpo_loss, high_entropy_mask, policy_ratio,
                        rollout_importance_weights)


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


def test_an_all_equal_group_of_summed_rewards_has_zero_advantage():
    # 1.0 + 0.5 + 0.1 (answer, chain steps, format) eight times: the float mean leaves a 1.2e-7 residue that 'group'
    # scaling would turn into an advantage of -0.0012 on every row, with the group not counted as zero-std
    rewards = torch.tensor([1.0 + 0.5 + 0.1] * 8 + [1.6, 1.6, 1.1, 1.6, 1.6, 1.6, 1.6, 1.6])
    group = torch.tensor([0] * 8 + [1] * 8)
    for scaling in ("group", "batch", "none"):
        adv, stats = group_advantages(rewards, group, scaling)
        assert (adv[:8] == 0).all() and stats["zero_std_groups"] == 1 and stats["frac_zero_std_groups"] == 0.5
        assert adv[10] < -0.4 and (adv[8:] != 0).all()            # the mixed group keeps its signal


def test_single_sample_groups_and_empty_completions_give_zero_loss():
    adv, stats = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))
    assert torch.equal(adv, torch.zeros(2)) and stats["zero_std_groups"] == 2
    logp = torch.zeros(2, 3, requires_grad=True)
    for loss_type in LOSS_TYPES:
        config = GRPOConfig(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None)
        loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), torch.ones(2), torch.zeros(2, 3), config)
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


def test_rollout_importance_weights_truncate_and_mask():
    "TRL's four modes: ratios 4, 1, 0.5 with bounds [0.6, 3]; masked tokens keep their place in the normaliser."
    old = torch.log(torch.tensor([[0.4, 0.4, 0.4]]))
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.8]]))                        # pi_old / pi_rollout: 4, 1, 0.5
    mask = torch.ones(1, 3)
    def weights(mode, low=0.6, high=3.0):
        return rollout_importance_weights(old, rollout, mask, GRPOConfig(rollout_importance_sampling_mode=mode, rollout_importance_sampling_clip_min=low,
                                                                         rollout_importance_sampling_clip_max=high))
    assert torch.allclose(weights("token_truncate"), torch.tensor([[3.0, 1.0, 0.6]]))
    assert torch.allclose(weights("token_truncate", low=None, high=2.0), torch.tensor([[2.0, 1.0, 0.5]]))   # TIS: min(w, C)
    assert torch.allclose(weights("token_mask"), torch.tensor([[0.0, 1.0, 0.0]]))
    assert torch.allclose(weights("sequence_truncate", high=1.5), torch.tensor([[1.5]]))                     # product 2 -> 1.5
    assert torch.allclose(weights("sequence_mask", high=1.5), torch.tensor([[0.0]]))                         # the whole row drops
    logp = old.clone().requires_grad_()
    loss, stats = grpo_loss(logp, old, rollout, torch.tensor([1.0]), mask, GRPOConfig(rollout_importance_sampling_mode="token_mask",
                            rollout_importance_sampling_clip_min=0.6, rollout_importance_sampling_clip_max=3.0))
    assert loss.item() == pytest.approx(-(0 + 1 + 0) / 3)                      # N stays 3: masked tokens count as zeros
    assert stats["correction/masked_frac"] == pytest.approx(2 / 3) and stats["correction/weight_mean"] == pytest.approx(1 / 3)


def test_gspo_sequence_ratio_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.2, 1.2, 1.2], [2.0, 0.5, 9.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    ratio = policy_ratio(logp, old, mask, "sequence")
    assert torch.allclose(ratio, torch.tensor([[1.2], [1.0]]))                   # row 1: exp((log 2 + log 0.5) / 2); the pad is ignored
    loss, stats = grpo_loss(logp, old, old, torch.tensor([1.0, 1.0]), mask, GRPOConfig(importance_sampling_level="sequence"))
    loss.backward()
    # row 0's ratio 1.2 is clipped (A > 0, 1.2 = 1 + epsilon: at the bound, still the min) -> -(3 * 1.2 + 2 * 1.0) / 5
    assert loss.item() == pytest.approx(-(3 * 1.2 + 2 * 1.0) / 5)
    assert torch.allclose(logp.grad[1], torch.tensor([-1.0 / 2 * 2 / 5, -1.0 / 2 * 2 / 5, 0.0]))   # d ratio / d logp_t = ratio / |y|


def test_cispo_and_delta_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.05, 0.5, 1.0]]))                             # ratios 10, 1, 0.5
    loss, stats = grpo_loss(logp, old, old, torch.tensor([2.0]), torch.ones(1, 3), GRPOConfig(loss_type="cispo", epsilon_high=4.0))
    loss.backward()
    weights = torch.tensor([4.0, 1.0, 0.5])                                       # min(ratio, 4), detached
    assert loss.item() == pytest.approx(float(-(weights * 2 * math.log(0.5)).sum() / 3))
    assert torch.allclose(logp.grad, -weights[None] * 2 / 3) and stats["cispo_clip_ratio"] == pytest.approx(1 / 3)
    # delta: A < 0, ratios 3 and 0.5; clip range [0.8, 1.2]; delta 2 caps the unclipped term of the first
    logp = torch.log(torch.tensor([[3.0, 0.5]])).requires_grad_()
    loss, _ = grpo_loss(logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), GRPOConfig(delta=2.0))
    loss.backward()
    assert loss.item() == pytest.approx((2.0 + 0.8) / 2)                          # max(min(3, 2), 1.2) and max(0.5, 0.8)
    assert torch.allclose(logp.grad, torch.zeros(1, 2))                           # both at a bound: no gradient
    loss, _ = grpo_loss(logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), GRPOConfig())
    assert loss.item() == pytest.approx((3.0 + 0.8) / 2)                          # without delta the first grows with the ratio


def test_kl_forms_by_hand():
    "k3 with and without the policy ratio as a weight, off-policy (ratio 2) so that the values differ too."
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    old, ref = torch.log(torch.tensor([[0.25]])), torch.log(torch.tensor([[0.25]]))
    k3 = 0.5 - math.log(0.5) - 1
    for bias_correction, value, grad in [(False, k3, 1 - 0.5), (True, 2 * k3, 2 * (1 - 0.5) + 2 * k3)]:
        logp.grad = None
        cfg = GRPOConfig(beta=0.1, use_bias_correction_kl=bias_correction)
        loss, stats = grpo_loss(logp, old, old, torch.zeros(1), torch.ones(1, 1), cfg, ref_logp=ref)
        loss.backward()
        assert loss.item() == pytest.approx(0.1 * value) and logp.grad.item() == pytest.approx(0.1 * grad)
        assert stats["kl"] == pytest.approx(value)


def test_top_entropy_quantile_by_hand():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.3], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    # masked entropies 0.1 0.9 0.5 0.3 2.0: the 0.6 quantile (keep the top 40%) is 0.5 + 0.4 * (0.9 - 0.5) = 0.66
    assert torch.equal(high_entropy_mask(entropy, mask, 0.4), torch.tensor([[False, True, False, False], [True, False, False, False]]))
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask.bool())
    assert torch.equal(high_entropy_mask(entropy, mask, 0.0), torch.tensor([[False] * 4, [True, False, False, False]]))
    assert not high_entropy_mask(entropy, torch.zeros(2, 4), 0.5).any()


def test_truncated_completions_can_be_masked():
    logp = torch.zeros(2, 2, requires_grad=True)
    cfg = GRPOConfig(mask_truncated_completions=True)
    loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, 3.0]), torch.ones(2, 2), cfg,
                            truncated=torch.tensor([False, True]))
    assert loss.item() == pytest.approx(-1.0) and stats["loss/tokens"] == 2
    grpo, _ = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, 3.0]), torch.ones(2, 2),
                        GRPOConfig(loss_type="grpo", mask_truncated_completions=True), truncated=torch.tensor([False, True]))
    assert grpo.item() == pytest.approx(-1.0 / 2)                                # the paper's 1/G: the masked row counts as 0


@pytest.mark.parametrize("bad, message", [
    (dict(loss_type="ppo"), "loss_type must be one of"), (dict(scale_rewards="max"), "scale_rewards"), (dict(epsilon=1.5), "epsilon"),
    (dict(rollout_importance_sampling_mode="token"), "token_truncate"), (dict(rollout_importance_sampling_clip_max=0.5), "clip_max must be >= 1"),
    (dict(rollout_importance_sampling_clip_min=2.0), "clip_min must be in"), (dict(importance_sampling_level="batch"), "importance_sampling_level"),
    (dict(loss_type="cispo"), "set it .ScaleRL uses 5.0"), (dict(delta=0.9), "delta"), (dict(loss_type="cispo", epsilon_high=5.0, delta=2.0), "delta"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile"), (dict(reward_weights=[1.0, "a"]), "reward_weights"),
    (dict(num_iterations=0), "num_iterations"), (dict(steps_per_generation=0), "steps_per_generation"), (dict(num_generations=0), "num_generations")])
def test_bad_config(bad, message):
    with pytest.raises(ValueError, match=message): GRPOConfig(**bad)


def test_reward_weights_become_a_tuple():
    "A list (as JSON gives back) and a tuple make equal configs, so that a logged config compares equal on resume."
    assert GRPOConfig(reward_weights=[1.0, 0.5]) == GRPOConfig(reward_weights=(1.0, 0.5))


def test_loop_options_run(model_dir, tmp_path):
    "KL reference (beta), PPO-style reuse (num_iterations) and gradient accumulation in a real run."
    from jetrl.train import TrainConfig, train
    config = TrainConfig(model=model_dir, strategy="bf16", steps=2, prompts_per_step=2, max_new_tokens=6, lr=1e-3, micro_batch_size=3,
                         grpo=GRPOConfig(num_generations=4, beta=0.05, num_iterations=2))
    run = train(config)
    assert run.ref_model is not None and all(not p.requires_grad for p in run.ref_model.parameters())
    last = run.history[-1]
    assert "reuse/ratio_mean" in last and last["grad_norm"] >= 0


@pytest.mark.parametrize("name, value", [("epsilon_high", float("nan")), ("delta", float("nan")), ("beta", float("nan")),
                                         ("beta", float("inf")), ("rollout_importance_sampling_clip_max", float("nan")),
                                         ("epsilon", float("nan")), ("top_entropy_quantile", float("nan")), ("beta", "0.1"),
                                         ("rollout_importance_sampling_clip_min", float("nan")), ("epsilon_high", float("inf"))])
def test_grpo_config_refuses_nan_inf_and_strings(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a (finite )?number"):
        GRPOConfig(**{name: value})

@pytest.mark.parametrize("weights", [(float("nan"), 1.0), (1.0, float("inf")), ("1", 1.0), (True, 1.0)])
def test_grpo_config_refuses_reward_weights_that_are_not_finite_numbers(weights):
    with pytest.raises(ValueError, match="reward_weights must be finite numbers"): GRPOConfig(reward_weights=weights)

def test_grpo_config_takes_an_infinite_is_cap_as_no_cap():
    assert GRPOConfig(rollout_importance_sampling_clip_max=float("inf")).rollout_importance_sampling_clip_max == float("inf")
