"""The GRPO loop and the command line: a run, resume after a kill, output folders, errors."""
import os, signal, subprocess, sys, time
from pathlib import Path
import pytest
import torch
from safetensors.torch import load_file

from jetrl.cli import main
from jetrl.grpo import GRPOConfig
from jetrl.policy import Policy
from jetrl.train import TrainConfig, train, read_metrics

SMALL = ["--steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3"]


def test_train_writes_metrics_and_checkpoint(model_dir, tmp_path):
    assert main(["train", "--model", model_dir, "--strategy", "fp8-rollout-tis", *SMALL, "--out", str(tmp_path / "run")]) == 0
    config, steps = read_metrics(tmp_path / "run")
    assert config["strategy"] == "fp8-rollout-tis" and config["grpo"]["rollout_importance_sampling_mode"] == "token_truncate"   # the strategy turned TIS on
    assert config["grpo"]["rollout_importance_sampling_clip_max"] == 2.0
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    for key in ["reward", "accuracy", "entropy", "grad_norm", "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/logp_abs_diff_max",
                "mismatch/ess", "mismatch/tis_clip_frac", "drift/kl_to_prev_policy", "time/rollout", "time/train", "sync/seconds"]:
        assert key in steps[0], key
    assert steps[0]["mismatch/logp_abs_diff_mean"] > 1e-4                                    # BF16 train vs FP8 rollout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["checkpoint.json", "model.safetensors", "optimizer.safetensors"]


def test_jet_mismatch_far_below_fp8_rollout(model_dir, tmp_path):
    for strategy in ["jet", "fp8-rollout"]:
        assert main(["train", "--model", model_dir, "--strategy", strategy, *SMALL, "--steps", "2", "--out", str(tmp_path / strategy)]) == 0
    jet, common = (read_metrics(tmp_path / s)[1] for s in ["jet", "fp8-rollout"])
    jet_gap = sum(m["mismatch/logp_abs_diff_mean"] for m in jet) / 2
    common_gap = sum(m["mismatch/logp_abs_diff_mean"] for m in common) / 2
    assert jet_gap < common_gap / 10, (jet_gap, common_gap)


def test_existing_run_is_refused_then_resumed(model_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", out]) == 0
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", out]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--lr", "5e-4", "--out", out, "--resume"]) == 2
    assert "another config" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--strategy", "fp4"], "invalid choice"), (["--steps", "0"], "steps must be >= 1"),
    (["--model", "/no/such/model"], "not a local model folder"), (["--task", "sudoku"], "sudoku"),
    (["--task-knobs", "digits=0"], "digits")])
def test_bad_arguments(model_dir, tmp_path, capsys, args, message):
    argv = ["train", "--model", model_dir, *SMALL, "--out", str(tmp_path / "bad"), *args]
    try: code = main(argv)
    except SystemExit as e: code = e.code                                  # argparse's own errors
    assert code == 2 and message in capsys.readouterr().err


def test_compare_unknown_strategy(model_dir, tmp_path, capsys):
    assert main(["compare", "--model", model_dir, "--strategies", "bf16,fp3", *SMALL, "--out", str(tmp_path)]) == 2
    assert "fp3" in capsys.readouterr().err


def _final_weights(folder: Path) -> dict:
    return load_file(str(folder / "checkpoint" / "model.safetensors"))


def test_resume_after_kill_gives_the_same_weights(model_dir, tmp_path):
    "Kill -9 a run mid-way, resume it, and end with exactly the weights of an uninterrupted run."
    steps = ["--steps", "6"]
    command = [sys.executable, "-m", "jetrl.cli", "train", "--model", model_dir, "--strategy", "jet", *SMALL, *steps]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*command, "--out", str(tmp_path / "whole")], check=True, env=env, capture_output=True)
    killed = tmp_path / "killed"
    process = subprocess.Popen([*command, "--out", str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:                                            # wait for two finished steps
        metrics = killed / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3: break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL); process.wait()
    done_before = len(read_metrics(killed)[1])
    assert 2 <= done_before < 6, f"the kill came too late ({done_before} steps done)"
    subprocess.run([*command, "--out", str(killed), "--resume"], check=True, env=env, capture_output=True)
    assert [m["step"] for m in read_metrics(killed)[1]] == list(range(6))
    whole, resumed = _final_weights(tmp_path / "whole"), _final_weights(killed)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_callback_stops_cleanly_and_sees_every_step(model_dir, tmp_path):
    from jetrl.policy import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(model_dir)
    seen = []
    config = TrainConfig(model=model_dir, strategy="bf16", steps=5, prompts_per_step=2, grpo=GRPOConfig(num_generations=4), max_new_tokens=6)
    run = train(config, tmp_path / "cb", callbacks=[lambda m: seen.append(m["step"]) or len(seen) < 2],
                policy=Policy(model, tokenizer, "bf16"))
    assert seen == [0, 1] and len(run.history) == 2 and len(read_metrics(tmp_path / "cb")[1]) == 2


def test_custom_precision_spec(model_dir):
    "A user's own PrecisionSpec trains through the same loop; an unknown preset name without a policy is refused."
    from jetrl.policy import PrecisionSpec, load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(model_dir)
    spec = PrecisionSpec("rowwise-jet", train_recipe="rowwise", rollout_recipe="rowwise")
    config = TrainConfig(model=model_dir, strategy="rowwise-jet", steps=1, prompts_per_step=2, grpo=GRPOConfig(num_generations=4), max_new_tokens=6)
    run = train(config, policy=Policy(model, tokenizer, spec))
    assert run.history[0]["strategy"] == "rowwise-jet"
    with pytest.raises(ValueError, match="Unknown strategy"): train(config)


def test_bf16_weights_train_through_fp32_master_weights_and_resume_exactly(model_dir, tmp_path):
    """A BF16 policy (as on a GPU) steps fp32 master weights (MasterWeightAdamW), and a run stopped and resumed ends
    with the weights of an uninterrupted one: the masters travel in the checkpoint (a resume from the BF16 weights
    alone would round differently)."""
    from jetrl.train import MasterWeightAdamW
    from jetrl.tasks import ArithmeticTask
    rows = ArithmeticTask(digits=2).sample(16)
    def length_reward(prompts, completions, **kwargs): return [float(len(c) % 3) for c in completions]  # varies: gradients
    config = TrainConfig(model=model_dir, strategy="bf16", hp_dtype="bfloat16", steps=4, prompts_per_step=2, warmup_steps=0,
                         grpo=GRPOConfig(num_generations=4), max_new_tokens=6, lr=1e-3)
    from jetrl.policy import load_model_and_tokenizer
    first = {k: v.clone() for k, v in load_model_and_tokenizer(model_dir)[0].state_dict().items()}
    whole = train(config, tmp_path / "whole", dataset=rows, reward_funcs=[length_reward])
    assert isinstance(whole.optimizer, MasterWeightAdamW)
    masters = [whole.optimizer.state[p]["master"] for p in whole.policy.model.parameters() if p in whole.optimizer.state]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    stopped = []
    train(config, tmp_path / "resumed", dataset=rows, reward_funcs=[length_reward],
          callbacks=[lambda m: stopped.append(m["step"]) or len(stopped) < 2])
    train(config, tmp_path / "resumed", resume=True, dataset=rows, reward_funcs=[length_reward])
    a, b = _final_weights(tmp_path / "whole"), _final_weights(tmp_path / "resumed")
    assert any(not torch.equal(a[k], first[k].to(a[k].dtype)) for k in a if k in first)          # it trained
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_master_weights_keep_updates_that_bf16_drops():
    """50 AdamW steps of lr 1e-4 (a move of ~5e-3, below BF16's step of 7.8e-3 here): fp32 masters follow PyTorch's
    fp32 AdamW to 2e-5 (its fused formula rounds differently: ~30 fp32 ulps); AdamW straight on BF16 stays put."""
    from jetrl.train import MasterWeightAdamW
    torch.manual_seed(0)
    start_bf16 = (torch.rand(256) + 1).to(torch.bfloat16)                         # weights in [1, 2): a BF16 step is 2^-7
    reference = start_bf16.float().requires_grad_()                               # the same start, in fp32
    low, plain = (start_bf16.clone().requires_grad_() for _ in range(2))
    start = plain.detach().clone()
    opts = [torch.optim.AdamW([reference], lr=1e-4), MasterWeightAdamW([low], lr=1e-4), torch.optim.AdamW([plain], lr=1e-4)]
    for _ in range(50):
        grad = torch.rand(256) + 0.5                                              # one sign: Adam moves ~lr a step
        for p, opt in zip((reference, low, plain), opts): p.grad = grad.to(p.dtype); opt.step()
    master = opts[1].state[low]["master"]
    assert (master - reference).abs().max() < 2e-5 and (master - start_bf16.float()).abs().mean() > 4e-3
    assert torch.equal(low.detach(), master.to(torch.bfloat16)) and not torch.equal(low.detach(), start)
    assert torch.equal(plain.detach(), start)                                    # every update rounded away
    state = opts[1].state_dict()
    again = MasterWeightAdamW([low.detach().clone().requires_grad_()], lr=1e-4)
    again.load_state_dict(state)
    loaded = next(iter(again.state.values()))
    assert loaded["master"].dtype == loaded["exp_avg"].dtype == torch.float32 and torch.equal(loaded["master"], master)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU --cuda-graphs is valid")
def test_cuda_graphs_on_the_cpu_is_refused_before_anything_is_written(model_dir, tmp_path, capsys):
    "--cuda-graphs (TrainConfig.cuda_graphs) on a CPU: a clear error saying to drop it, and no run folder made."
    out = tmp_path / "graphs"
    assert main(["train", "--model", model_dir, *SMALL, "--out", str(out), "--cuda-graphs"]) == 2
    assert "(--no-cuda-graphs)" in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match="this run trains on the cpu"):
        train(TrainConfig(model=model_dir, steps=1, cuda_graphs=True))


def test_trainer_graphs_default_on_where_they_run_eager_elsewhere(model_dir, capsys):
    """TrainConfig.cuda_graphs None (the default): GraphedLogProbs where the model is on a GPU, the eager trainer on a
    CPU without a word (nothing to save there); True where they cannot run is GraphedLogProbs' error; False is off."""
    from jetrl.train import trainer_graphs
    from jetrl.logprobs import GraphedLogProbs
    assert TrainConfig().cuda_graphs is None
    model = torch.nn.Linear(2, 2)
    assert trainer_graphs(model, None) is None and trainer_graphs(model, False) is None
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="captures CUDA graphs, and this model is on cpu"):
        trainer_graphs(model, True)
    if torch.cuda.is_available():
        assert isinstance(trainer_graphs(model.cuda(), None), GraphedLogProbs) and trainer_graphs(model, False) is None


def test_cuda_graphs_under_torchrun_is_refused_first():
    "FSDP's hooks are not in a graph: train_distributed refuses cuda_graphs before making a process group."
    from jetrl.distributed import train_distributed
    with pytest.raises(ValueError, match="not FSDP's hooks"):
        train_distributed(TrainConfig(cuda_graphs=True))


def test_a_run_logged_before_cuda_graphs_existed_resumes(model_dir, tmp_path):
    """`cuda_graphs` is in RESUME_FREE_FIELDS (how fast a step runs, not what it computes): a run folder whose logged
    config lacks it (every run from before it existed) still resumes, where any other missing or changed field is refused."""
    import json
    out = tmp_path / "run"
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(out)]) == 0
    metrics = out / "metrics.jsonl"
    header, *rest = metrics.read_text().splitlines(keepends=True)
    logged = json.loads(header)
    del logged["config"]["cuda_graphs"]
    metrics.write_text(json.dumps(logged) + "\n" + "".join(rest))
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(out), "--resume"]) == 0
    del logged["config"]["exact"]                                    # a field that does count: refused
    metrics.write_text(json.dumps(logged) + "\n" + "".join(rest))
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(out), "--resume"]) == 2


def test_kernel_options_are_logged_and_a_log_without_them_resumes_with_the_defaults(tmp_path):
    """TrainConfig.kernels is written into the run header as a dict and read back; a header logged without it stands
    for the defaults (it resumes), while other options than the logged ones are refused."""
    import json
    from dataclasses import replace
    from jetrl.options import KernelOptions
    from jetrl.train import plan_run_folder, task_and_rewards, reward_record, METRICS_FILE
    chosen = TrainConfig(kernels=KernelOptions(fused_entropy=False))
    assert chosen.to_dict()["kernels"]["fused_entropy"] is False
    assert TrainConfig.from_dict(json.loads(json.dumps(chosen.to_dict()))) == chosen
    config, _, rewards = task_and_rewards(TrainConfig())
    header = {"config": {k: v for k, v in config.to_dict().items() if k != "kernels"}, "reward_funcs": reward_record(rewards)}
    (tmp_path / METRICS_FILE).write_text(json.dumps(header) + "\n")
    assert plan_run_folder(tmp_path, config, True, reward_record(rewards)).start_step == 0
    with pytest.raises(ValueError, match="kernels.fused_entropy"):
        plan_run_folder(tmp_path, replace(config, kernels=KernelOptions(fused_entropy=False)), True, reward_record(rewards))


def test_the_policy_train_builds_runs_the_config_kernels(model_dir):
    "start_run's policy carries config.kernels; a policy given with other options is refused, naming both."
    from jetrl.options import KernelOptions
    from jetrl.policy import load_model_and_tokenizer
    from jetrl.train import start_run
    chosen = KernelOptions(fused_entropy=False)
    assert start_run(TrainConfig(model=model_dir, kernels=chosen)).policy.kernel_options == chosen
    model, tokenizer = load_model_and_tokenizer(model_dir)
    with pytest.raises(ValueError, match="config.kernels is .*fused_entropy"):
        start_run(TrainConfig(model=model_dir, kernels=chosen), policy=Policy(model, tokenizer, "jet"))


def test_train_in_a_torchrun_rank_names_the_distributed_runner(monkeypatch):
    "train() runs one process: in a rank of a torchrun launch it says which function runs every rank."
    for key, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1").items(): monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="train_distributed"): train(TrainConfig())


def length_reward(completions, **kwargs) -> list[float]:
    "A reward every completion of a random model earns differently: its length (so advantages are not all 0)."
    return [float(len(c)) for c in completions]


def test_loss_statistics_are_the_whole_steps_not_the_last_micro_batchs(model_dir):
    """clip_ratio/* and the other loss statistics weigh every micro-batch by its tokens (merge_loss_stats), and loss/tokens
    counts the whole batch once: split into micro-batches of 4 rows, a step logs what one micro-batch of all rows logs."""
    from jetrl.train import merge_loss_stats
    parts = [{"clip_ratio/low_mean": 0.5, "loss/tokens": 10.0}, {"clip_ratio/low_mean": 0.0, "loss/tokens": 30.0}]
    assert merge_loss_stats(parts) == {"clip_ratio/low_mean": 0.125, "loss/tokens": 40.0}
    assert merge_loss_stats(parts + parts, passes=2)["loss/tokens"] == 40.0
    base = dict(model=model_dir, strategy="bf16", steps=1, prompts_per_step=4, max_new_tokens=8, lr=3e-2,
                grpo=GRPOConfig(num_generations=4, num_iterations=2))          # the second pass is off-policy: ratios move
    whole, split = (train(TrainConfig(**base, micro_batch_size=size), reward_funcs=length_reward).history[0] for size in (0, 4))
    tokens = whole["completions/mean_length"] * 16
    assert split["loss/tokens"] == whole["loss/tokens"] == pytest.approx(tokens)        # not the last micro-batch's ~tokens / 4
    assert whole["clip_ratio/region_mean"] > 0                                            # something is clipped
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert split[key] == pytest.approx(whole[key], abs=1.01 / tokens), key          # at most one token on the clip's edge


def test_kl_to_start_is_logged_when_asked_and_changes_nothing_else(model_dir, tmp_path):
    """log_kl_to_start adds drift/kl_to_start (0 at the first step, where the policy is the start; above 0 after updates)
    and changes no other number; the option is logged only when set, so a run logged without it resumes."""
    import json
    base = dict(model=model_dir, strategy="fp8-rollout", steps=3, prompts_per_step=2, max_new_tokens=6, lr=1e-2,
                grpo=GRPOConfig(num_generations=4))
    plain = train(TrainConfig(**base), tmp_path / "plain", reward_funcs=length_reward).history
    drift = train(TrainConfig(**base, log_kl_to_start=True), tmp_path / "drift", reward_funcs=length_reward).history
    assert "drift/kl_to_start" not in plain[0]
    assert drift[0]["drift/kl_to_start"] == 0.0 and 0 < drift[1]["drift/kl_to_start"] < drift[2]["drift/kl_to_start"]
    skip = {"drift/kl_to_start", "samples"} | {k for k in plain[0] if k.startswith(("time/", "sync/", "rollout/tokens_per_s"))}
    assert [{k: v for k, v in m.items() if k not in skip} for m in plain] == [{k: v for k, v in m.items() if k not in skip} for m in drift]
    assert "log_kl_to_start" not in read_metrics(tmp_path / "plain")[0] and read_metrics(tmp_path / "drift")[0]["log_kl_to_start"] is True
    assert TrainConfig.from_dict(json.loads(json.dumps(TrainConfig(log_kl_to_start=True).to_dict()))).log_kl_to_start
    assert len(train(TrainConfig(**base), tmp_path / "plain", resume=True, reward_funcs=length_reward).history) == 3   # no "(absent)" refused


def test_rollout_side_clip_fractions_are_logged_and_zero_without_a_mismatch(model_dir):
    "mismatch/clip_ratio/*: the tokens PPO would clip with the rollout's log-probs as pi_old; none where both sides agree."
    for strategy in ("bf16", "fp8-rollout"):
        m = train(TrainConfig(model=model_dir, strategy=strategy, steps=1, prompts_per_step=4, max_new_tokens=8,
                              grpo=GRPOConfig(num_generations=4))).history[0]
        assert 0 <= m["mismatch/clip_ratio/low_mean"] <= 1 and 0 <= m["mismatch/clip_ratio/high_mean"] <= 1
        if strategy == "bf16": assert m["mismatch/clip_ratio/low_mean"] == m["mismatch/clip_ratio/high_mean"] == 0.0


def test_released_rollout_memory_trains_the_same_steps_and_resumes_either_way(model_dir, tmp_path, capsys, monkeypatch):
    """--release-rollout-memory (TrainConfig.release_rollout_memory): the engine frees its cache after each rollout and
    allocates it again, so a run computes the same steps as one that keeps it; a resume may turn it on or off (it is
    how memory is held, not what is computed); with the vLLM backend it is refused in one line."""
    import jetrl.train as jt
    engines, factory = [], jt.rollout_engine
    monkeypatch.setattr(jt, "rollout_engine", lambda *a, **k: engines.append(factory(*a, **k)) or engines[-1])
    kept, released = tmp_path / "kept", tmp_path / "released"
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(kept)]) == 0
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(released), "--release-rollout-memory"]) == 0
    assert [e.release_after_generate for e in engines] == [False, True]
    assert engines[0]._static is not None and engines[1]._static is None          # held after the run, and released
    (_, a), (config, b) = read_metrics(kept), read_metrics(released)
    assert config["release_rollout_memory"] is True and "release_rollout_memory" not in read_metrics(kept)[0]
    for key in ("reward", "loss", "grad_norm", "mismatch/logp_abs_diff_mean"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    capsys.readouterr()
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(released), "--resume"]) == 0
    assert main(["train", "--model", model_dir, *SMALL, "--steps", "2", "--out", str(kept), "--resume",
                 "--release-rollout-memory"]) == 0
    assert "another config" not in capsys.readouterr().err                        # resumed with or without it: accepted
    with pytest.raises(ValueError, match="vLLM keeps its own"):
        TrainConfig(backend="vllm", release_rollout_memory=True)


def test_jet_gradient_norm_is_the_high_precision_ones_within_fp8_noise():
    """The emulated unified FP8 flow's gradient against the high-precision one (bf16's strategy computes in fp32 on the
    CPU) from the same random weights, on one rollout both train on, through `optimize` with micro-batches: every
    module's norm within JET_GRAD_NORM_RATIO (measured: within 3%). tests/test_gpu.py runs the same on a GPU, with
    jetrl's kernels, eager and from the trainer's CUDA graphs."""
    from transformers import Qwen2ForCausalLM
    from conftest import gradient_norms_on_one_rollout, gradient_ratio_problems
    from jetrl.tiny import load_tiny
    shipped, tokenizer = load_tiny()
    torch.manual_seed(0)
    weights = Qwen2ForCausalLM(shipped.config).state_dict()          # the shipped shape, random weights
    policies = {}
    for strategy in ("bf16", "jet"):
        model = Qwen2ForCausalLM(shipped.config); model.load_state_dict(weights)
        policies[strategy] = Policy(model, tokenizer, strategy, device="cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 500, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (4,), generator=g)]
    norms, step_norms = gradient_norms_on_one_rollout(policies, prompts, 48, 6)
    assert len(norms["jet"]) == len(norms["bf16"]) == len(list(shipped.parameters()))
    problems = gradient_ratio_problems(norms, step_norms)
    assert not problems, f"jet's gradient norm over bf16's outside the bounds: {problems[:8]}"
