"""Reward failures follow TRL's policy and are never silent: None is unscorable (NaN, left out of the group's
statistics and of the loss), failures are counted per step in metrics.jsonl, non-numbers and values beyond float32
are refused, and a step whose every reward fails stops the run."""
import json, math, warnings
import pytest
import torch

from jetrl.grpo import GRPOConfig, group_advantages
from jetrl.sampling import Rollout
from jetrl.tasks import RewardFunctionWarning, combine_rewards
import jetrl.train as train_module
from jetrl.train import TrainConfig, contributing_mask, read_metrics, train


def small(model_dir, **changes) -> TrainConfig:
    return TrainConfig(**dict(model=str(model_dir), strategy="bf16", steps=2, prompts_per_step=2, grpo=GRPOConfig(num_generations=4),
                              max_new_tokens=6, lr=1e-3) | changes)


def quietly(rewards, completions):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardFunctionWarning)
        return rewards.score(None, completions)


def test_none_is_unscorable_not_zero():
    def sometimes(prompts, completions, **kwargs): return [1.0, None, 0.0, None]
    def never(prompts, completions, **kwargs): return [None, None, 0.5, None]
    scores = quietly(combine_rewards([(sometimes, 1.0), (never, 2.0)]), ["a", "b", "c", "d"])
    assert scores.total[0] == 1.0 and scores.total[2] == 1.0                  # nansum over functions, as TRL
    assert math.isnan(scores.total[1]) and math.isnan(scores.total[3])       # every function said None: unscorable
    assert scores.unscored == 5 and scores.errors == 0 and scores.scored == 3
    assert scores.means()["reward"] == 1.0 and scores.means()["rewards/sometimes"] == 0.5


def test_unscorable_completions_are_left_out_of_the_group_statistics():
    rewards = torch.tensor([1.0, math.nan, 0.0, math.nan, 2.0, 2.0, math.nan, 2.0])
    advantages, stats = group_advantages(rewards, torch.arange(8) // 4)
    std = math.sqrt(0.5)                                                     # of (1, 0), unbiased
    assert advantages[:4].tolist() == pytest.approx([0.5 / (std + 1e-4), 0.0, -0.5 / (std + 1e-4), 0.0])
    assert advantages[4:].tolist() == [0.0] * 4 and stats["zero_std_groups"] == 1
    for scale in ("batch", "none"):
        assert torch.isfinite(group_advantages(rewards, torch.arange(8) // 4, scale)[0]).all()


def test_unscorable_completions_do_not_count_in_the_loss():
    mask = torch.ones(4, 3)
    rollout = Rollout(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long), torch.zeros(4, 3, dtype=torch.long),
                      mask.long(), torch.zeros(4, 3), ["p"] * 4, ["c"] * 4, ["stop"] * 4, torch.arange(4) // 2)
    unscorable = torch.tensor([False, True, False, True])
    assert contributing_mask(rollout, GRPOConfig(), unscorable).sum(1).tolist() == [3, 0, 3, 0]


@pytest.mark.parametrize("returns", [["1.5", "2"], "12", 1.0, [1.0], [1e39, 0.0], [b"1", 0.0], [1.0, 2.0, 3.0]])
def test_non_numbers_wrong_lengths_and_overflows_are_errors(returns):
    def bad(prompts, completions, **kwargs): return returns
    with pytest.warns(RewardFunctionWarning):
        scores = combine_rewards([(bad, 1.0)]).score(None, ["a", "b"])
    assert scores.errors >= 1 and all(isinstance(v, float) for v in scores.total), scores
    assert not any(abs(v) > 3.4e38 for v in scores.total)


def test_nan_is_unscorable_as_none_is():
    "TRL keeps rewards in a tensor, where None becomes NaN: the two mean the same, and neither is a failure."
    def sick(prompts, completions, **kwargs): return [math.nan, 1.0]
    scores = combine_rewards([(sick, 1.0)]).score(None, ["a", "b"])
    assert math.isnan(scores.total[0]) and scores.total[1] == 1.0 and scores.unscored == 1 and scores.errors == 0


def test_rewards_near_the_float32_limit_give_finite_advantages():
    rewards = torch.tensor([3e38, -3e38, 3e38, 1.0], dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        advantages, _ = group_advantages(rewards, torch.zeros(4, dtype=torch.long), scale)
        assert torch.isfinite(advantages).all() and advantages.dtype == torch.float32, (scale, advantages)
    assert group_advantages(rewards, torch.zeros(4, dtype=torch.long))[0][0] > 0


def test_reward_failures_are_logged_per_step(model_dir, tmp_path):
    def half_broken(prompts, completions, **kwargs):                          # by the completion: the same alone or in a batch
        kinds = [sum(map(ord, c)) % 3 for c in completions]
        return [None if kind == 0 else ("x" if kind == 1 else 1.0) for kind in kinds]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardFunctionWarning)
        train(small(model_dir), tmp_path / "run", reward_funcs=half_broken)
    _, steps = read_metrics(tmp_path / "run")
    for m in steps:
        assert m["rewards/unscorable"] == m["rewards/nan"] and m["rewards/nan"] + m["rewards/errors"] <= 8, m
        assert math.isfinite(m["reward"]) and math.isfinite(m["loss"])
    assert sum(m["rewards/nan"] for m in steps) > 0 and sum(m["rewards/errors"] for m in steps) > 0


def test_a_run_whose_every_reward_fails_stops_with_a_clear_error_and_keeps_its_steps(model_dir, tmp_path):
    def breaks_at_step_2(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 2: raise RuntimeError("the grader is down")
        return [1.0 * (i % 2) for i in range(len(completions))]
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardFunctionWarning)
        with pytest.raises(getattr(train_module, "AllRewardsFailedError", ValueError)) as error:
            train(small(model_dir, steps=4, save_every=10), out, reward_funcs=breaks_at_step_2)
    message = str(error.value)
    assert "step 2" in message and "breaks_at_step_2" in message and "the grader is down" in message and "--resume" in message, message
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1]
    assert json.loads((out / "checkpoint" / "checkpoint.json").read_text())["step"] == 1   # saved what it did


def test_a_reward_that_always_fails_is_one_error_line(model_dir, tmp_path, capsys):
    from jetrl.cli import main
    (tmp_path / "broken.py").write_text("def reward(prompts, completions, **kwargs):\n    return [float('nan')] * len(completions)\n")
    code = main(["train", "--model", str(model_dir), "--strategy", "bf16", "--prompts-per-step", "2", "--group-size", "4",
                 "--max-new-tokens", "6", "--steps", "2", "--out", str(tmp_path / "run"), "--reward", f"{tmp_path / 'broken.py'}:reward"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "every reward" in err, err
