"""Your own task, dataset and reward functions through train() and the CLI (TRL's conventions), and the loop's use of
the GRPO options: the DAPO normaliser, steps_per_generation, top_entropy_quantile, reward_weights."""
import json
import textwrap
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch

from jetrl.cli import main
from jetrl.data import SEED_STRIDE, TrainerState
from jetrl.grpo import GRPOConfig, grpo_loss, high_entropy_mask
from jetrl.policy import token_log_probs
from jetrl.tasks import Task, format_reward
from jetrl.train import TrainConfig, optimize, read_metrics, start_run, train, trainer_log_probs

ROWS = [{"prompt": f"Reverse the digits of {n}. Put the final answer in <answer></answer>.\nAnswer:", "answer": str(n)[::-1],
         "digits": len(str(n))} for n in range(120, 150)]
SHORT = dict(steps=2, prompts_per_step=2, max_new_tokens=6, lr=1e-3, strategy="bf16", grpo=GRPOConfig(num_generations=3))


def reversed_digits(prompts, completions, answer, **kwargs) -> list[float]:
    "Fraction of the reversed digits in place (partial credit)."
    return [sum(x == y for x, y in zip(c.strip(), a)) / len(a) for c, a in zip(completions, answer)]


def test_dataset_and_reward_funcs_trl_style(model_dir, tmp_path):
    calls = []
    def spy(prompts, completions, completion_ids, trainer_state, answer, digits, **kwargs):
        calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, state=trainer_state,
                          answer=answer, digits=digits))
        return [1.0] * len(completions)
    run = train(TrainConfig(model=model_dir, **SHORT), tmp_path / "run", dataset=ROWS, reward_funcs=[reversed_digits, spy])
    first = calls[0]
    assert len(first["completions"]) == 6 and first["answer"][0] == first["answer"][1] == first["answer"][2]   # a prompt's G rows
    assert all(ROWS[[r["prompt"] for r in ROWS].index(p)]["answer"] == a for p, a in zip(first["prompts"], first["answer"]))
    assert isinstance(first["state"], TrainerState) and [c["state"].global_step for c in calls] == [0, 1]
    assert all(isinstance(ids, list) and 1 <= len(ids) <= 6 for ids in first["completion_ids"])
    config, steps = read_metrics(tmp_path / "run")
    assert config["task"]["name"] == "dataset" and config["task"]["rows"] == len(ROWS)
    assert steps[0]["rewards/spy"] == 1.0 and "rewards/reversed_digits" in steps[0]
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["reward_funcs"]
    assert [r["function"].rsplit(".", 1)[-1] for r in logged] == ["reversed_digits", "spy"] and [r["weight"] for r in logged] == [1.0, 1.0]


def test_reward_weights_sum_the_functions(model_dir):
    def one(prompts, completions, **kwargs): return [1.0] * len(completions)
    config = TrainConfig(model=model_dir, **SHORT | dict(steps=1, grpo=GRPOConfig(num_generations=3, reward_weights=[0.5, 2.0])))
    step = train(config, dataset=ROWS, reward_funcs=[reversed_digits, one]).history[0]
    assert step["reward"] == pytest.approx(0.5 * step["rewards/reversed_digits"] + 2.0 * 1.0)


def test_wrong_signature_fails_before_the_model_loads(tmp_path):
    def no_kwargs(prompts, completions, answer): return [0.0] * len(completions)
    with pytest.raises(TypeError, match=r"def no_kwargs\(prompts, completions, \*\*kwargs\) -> list\[float\]"):
        train(TrainConfig(model=str(tmp_path / "no-such-model"), **SHORT), tmp_path / "run", dataset=ROWS, reward_funcs=[no_kwargs])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="reward_funcs"):
        train(TrainConfig(model=str(tmp_path / "no-such-model"), **SHORT), dataset=ROWS)
    with pytest.raises(ValueError, match="row 1 has no 'prompt'"):
        train(TrainConfig(**SHORT), dataset=[ROWS[0], {"question": "x"}], reward_funcs=[reversed_digits])


@dataclass(frozen=True)
class ReverseTask(Task):
    "Reverse a number of `digits` digits: a task written from scratch."
    digits: int = 3
    seed: int = 0
    answer_format: str = "tag"
    name: ClassVar[str] = "reverse"
    reward = staticmethod(reversed_digits)

    def make_row(self, rng):
        n = str(rng.randint(10 ** (self.digits - 1), 10**self.digits - 1))
        return {"prompt": f"Reverse the digits of {n}. Put the final answer in <answer></answer>.\nAnswer:", "answer": n[::-1]}


def test_a_task_object_is_accepted_with_its_own_knobs(model_dir, tmp_path):
    run = train(TrainConfig(model=model_dir, task=ReverseTask(digits=2), **SHORT), tmp_path / "run")
    config, steps = read_metrics(tmp_path / "run")
    assert config["task"] == {"name": "reverse", "class": "test_front_door.ReverseTask", "digits": 2, "seed": 0, "answer_format": "tag"}
    assert config["task_knobs"] is None and set(run.rewards.functions) == {"reversed_digits", "format_reward"}
    assert len(run.batch(0)[0]["answer"]) == 2
    with pytest.raises(ValueError, match="a Task object carries its own"):
        TrainConfig(task=ReverseTask(), task_knobs=(("digits", 1),))
    class Plain(Task): pass
    with pytest.raises(TypeError, match="dataclass"):
        train(TrainConfig(task=Plain(), **SHORT))
    # a registered task other than arithmetic gets its own defaults, not arithmetic's knobs
    assert start_run(TrainConfig(model=model_dir, task="countdown", **SHORT)).task.count == 4


def test_dataset_run_resumes_only_with_the_same_data(model_dir, tmp_path):
    config = TrainConfig(model=model_dir, **SHORT)
    train(replace(config, steps=1), tmp_path / "run", dataset=ROWS, reward_funcs=[reversed_digits])
    with pytest.raises(ValueError, match="another config"):
        train(replace(config, steps=1), tmp_path / "run", resume=True, dataset=ROWS[:-1], reward_funcs=[reversed_digits])
    with pytest.raises(ValueError, match="another config"):
        train(replace(config, steps=1), tmp_path / "run", resume=True, dataset=ROWS, reward_funcs=[format_reward])
    run = train(replace(config, steps=1), tmp_path / "run", resume=True, dataset=ROWS, reward_funcs=[reversed_digits])
    assert run.start_step == 1


def test_datasets_dataset(model_dir):
    datasets = pytest.importorskip("datasets", reason="the `datasets` package is not installed")
    run = train(TrainConfig(model=model_dir, **SHORT | dict(steps=1)), dataset=datasets.Dataset.from_list(ROWS), reward_funcs=reversed_digits)
    assert run.task.describe()["rows"] == len(ROWS)


def test_cli_dataset_and_reward(model_dir, tmp_path, capsys):
    data, rewards = tmp_path / "reverse.jsonl", tmp_path / "my_rewards.py"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    rewards.write_text(textwrap.dedent('''
        def exact(prompts, completions, answer, **kwargs):
            return [float(a in c) for c, a in zip(completions, answer)]
        def bad(completions):
            return [0.0] * len(completions)
    '''))
    args = ["--model", model_dir, "--strategy", "bf16", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--dataset", str(data)]
    assert main(["train", *args, "--reward", f"{rewards}:exact", "--reward", "jetrl.tasks:format_reward",
                 "--reward-weights", "1,0.1", "--out", str(tmp_path / "run")]) == 0
    config, steps = read_metrics(tmp_path / "run")
    assert config["grpo"]["reward_weights"] == [1.0, 0.1] and "rewards/exact" in steps[0] and "rewards/format_reward" in steps[0]
    for extra, message in [(["--reward", f"{rewards}:bad"], "def bad(prompts, completions, **kwargs)"),
                           ([], "--dataset needs a reward"), (["--reward", f"{rewards}:exact", "--task", "countdown"], "one or the other"),
                           (["--reward", f"{rewards}:nope"], "has no function 'nope'")]:
        capsys.readouterr()
        assert main(["train", *args, *extra, "--out", str(tmp_path / "bad")]) == 2
        assert message in capsys.readouterr().err, message
    assert not (tmp_path / "bad").exists()


# The loop: the gradient of each optimizer step equals the gradient of one grpo_loss call on that step's rows.

def _one_rollout(model_dir, grpo, micro_batch_size):
    run = start_run(TrainConfig(model=model_dir, strategy="bf16", prompts_per_step=4, max_new_tokens=5, micro_batch_size=micro_batch_size,
                                max_grad_norm=1e9, grpo=grpo))
    rollout = run.engine.generate([r["prompt"] for r in run.batch(0)], run.sampling(0))
    rollout.finish_reasons = ["length" if i % 3 == 0 else "eos" for i in range(len(rollout))]   # some truncated, some not
    old_logp, entropy = trainer_log_probs(run.policy, rollout, 1.0, with_entropy=True)
    advantages = torch.randn(len(rollout), generator=torch.Generator().manual_seed(0))
    return run, rollout, old_logp, entropy, advantages


@pytest.mark.parametrize("grpo, micro_batch_size", [
    (GRPOConfig(num_generations=4, mask_truncated_completions=True), 3),                  # issue 13: N counts only kept tokens
    (GRPOConfig(num_generations=4, loss_type="grpo", mask_truncated_completions=True), 5),  # 1/G over every row, masked ones too
    (GRPOConfig(num_generations=4, steps_per_generation=2), 3),
    (GRPOConfig(num_generations=4, loss_type="cispo", epsilon_high=5.0, steps_per_generation=4, top_entropy_quantile=0.5), 0),
])
def test_each_optimizer_step_has_the_gradient_of_its_share(model_dir, grpo, micro_batch_size):
    run, rollout, old_logp, entropy, advantages = _one_rollout(model_dir, grpo, micro_batch_size)
    params = [p for p in run.policy.model.parameters() if p.requires_grad]
    captured = []
    run.optimizer.step = lambda: captured.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    stats = optimize(run, rollout, old_logp, advantages, entropy, step=0)
    # by hand: the kept tokens, the shares of a seeded shuffle, N = kept tokens / steps_per_generation
    kept = rollout.completion_mask.float()
    if grpo.mask_truncated_completions: kept = kept * torch.tensor([r != "length" for r in rollout.finish_reasons]).float()[:, None]
    S, P = grpo.steps_per_generation, rollout.prompt_ids.shape[1]
    order = torch.randperm(len(rollout), generator=torch.Generator().manual_seed(0 * SEED_STRIDE + 0)) if S > 1 else torch.arange(len(rollout))
    entropy_mask = high_entropy_mask(entropy, kept, grpo.top_entropy_quantile) if grpo.top_entropy_quantile < 1 else None
    assert len(captured) == S
    for share, grads in zip(order.chunk(S), captured):
        logp = token_log_probs(run.policy.model, rollout.input_ids[share], rollout.attention_mask[share])[:, P - 1:]
        loss, _ = grpo_loss(logp, old_logp[share], rollout.logprobs[share], advantages[share], kept[share], grpo,
                            loss_normalizer=float(kept.sum()) / S, entropy_mask=None if entropy_mask is None else entropy_mask[share])
        expected = torch.autograd.grad(loss, params, allow_unused=True)
        for got, want in zip(grads, expected):
            want = torch.zeros_like(got) if want is None else want
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), (got - want).abs().max()
    assert any(g.abs().sum() > 0 for g in captured[0])
    if S > 1: assert "reuse/ratio_mean" in stats
    if grpo.top_entropy_quantile < 1: assert "loss/entropy_kept_frac" in stats
