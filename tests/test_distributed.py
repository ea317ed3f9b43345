"""The distributed path on the CPU (gloo, 2 processes): a torchrun run of `jetrl train` equals the single-process run,
resumes after a kill to the same weights, keeps the trainer's FP8 bytes on every rank, and a rank that dies stops
the others with a message; a step whose every reward fails stops every rank as one process stops, after saving the
steps before it; a checkpoint given to the wrong launcher is one clear error; FSDP2 over one rank quantizes
the weights as often as one process. Each launch starts two Python processes: tens of seconds on 2 cores."""
import hashlib, json, os, shlex, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest
import torch

from jetrl.cli import main
from jetrl.distributed import check_divisible, choose_backend
from jetrl.runfolder import LOCK_FILE
from jetrl.train import read_metrics

REPO = Path(__file__).resolve().parents[1]
RUN = ["--model", "jetrl-tiny", "--strategy", "jet", "--steps", "2", "--prompts-per-step", "4", "--group-size", "4",
       "--max-new-tokens", "8", "--log-kl-to-start"]
LAUNCH_TIMEOUT_S = 300


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "JETRL_DIST_TIMEOUT": "60", "HF_HUB_OFFLINE": "1"} | extra


def _torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    "`torchrun --nproc-per-node 2 -m jetrl.cli train ...`: 2 steps of jet on jetrl-tiny, checkpoint every step."
    out = tmp_path_factory.mktemp("dist") / "run"
    done = subprocess.run(_torchrun("-m", "jetrl.cli", "train", *RUN, "--out", str(out)), env=_env(), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("strategy") == 1                                     # rank 0 alone prints the summary
    return out


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    "The same run in this process (`jetrl train ...`, no torchrun): safetensors checkpoints."
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(["train", *RUN, "--out", str(out)]) == 0
    return out


def _close(a: float, b: float, rel: float = 0.0, abs_: float = 0.0) -> bool: return abs(a - b) <= abs_ + rel * abs(a)


def test_two_ranks_match_one_process(two_rank_run, one_process_run):
    first_line = json.loads((two_rank_run / "metrics.jsonl").read_text().splitlines()[0])
    assert first_line["distributed"]["world_size"] == 2 and first_line["distributed"]["backend"] == "gloo"
    (one0, one1), (two0, two1) = read_metrics(one_process_run)[1], read_metrics(two_rank_run)[1]
    assert two0["dist/world_size"] == 2 and two0["dist/backend"] == "gloo" and "dist/world_size" not in one0
    for one, two in ((one0, two0), (one1, two1)):                                  # same prompts every step
        assert [s["prompt"] for s in one["samples"]] == [s["prompt"] for s in two["samples"]]
    # step 0: the same sampled tokens (per-row streams), so the same rewards, exactly
    assert [s["tokens"] for s in one0["samples"]] == [s["tokens"] for s in two0["samples"]]
    for key in ["reward", "reward_std", "accuracy", "rewards/format_reward", "rewards/number_reward", "frac_reward_zero_std",
                "completions/mean_length", "completions/max_length", "completions/truncated_frac", "loss/tokens",
                "mismatch/clip_ratio/low_mean", "mismatch/clip_ratio/high_mean", "drift/kl_to_start"]:
        assert one0[key] == two0[key], key
    assert one0["drift/kl_to_start"] == 0.0 and one1["drift/kl_to_start"] > 0             # the start itself, then a step away
    # computed before the update from the same tokens: equal up to summation order (rows padded per rank)
    for key in ["loss", "entropy", "clip_ratio/region_mean", "mismatch/is_ratio_mean"]:
        assert _close(one0[key], two0[key], rel=1e-5, abs_=1e-7), (key, one0[key], two0[key])
    for key in ["mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max", "mismatch/kl_k3"]:
        assert _close(one0[key], two0[key], abs_=1e-5), (key, one0[key], two0[key])          # both at the fp32 floor
    # jet's Wgrad quantizes in groups of 128 tokens, formed from each rank's own tokens: the gradient differs a little
    # (measured 1.2e-4 relative on the norm), and Adam's first step, ~lr * sign(g), spreads that to the drift (3.6e-2)
    assert _close(one0["grad_norm"], two0["grad_norm"], rel=1e-3), (one0["grad_norm"], two0["grad_norm"])
    assert _close(one0["drift/kl_to_prev_policy"], two0["drift/kl_to_prev_policy"], rel=0.1)
    assert _close(one1["drift/kl_to_start"], two1["drift/kl_to_start"], rel=0.1)     # the same spread, over every rank's tokens
    assert _close(one1["reward"], two1["reward"], abs_=0.2) and two1["dist/world_size"] == 2


def _final_weights(run_dir: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = run_dir.parent / f"{run_dir.name}.pt"
    dcp_to_torch_save(run_dir / "checkpoint", target)
    return torch.load(target, weights_only=False)["model"]


def test_resume_after_kill_on_two_ranks(two_rank_run, tmp_path):
    out = tmp_path / "killed"
    run = subprocess.Popen(_torchrun("-m", "jetrl.cli", "train", *RUN, "--out", str(out)), env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    meta, deadline = out / "checkpoint" / "checkpoint.json", time.time() + LAUNCH_TIMEOUT_S
    while not meta.exists() and run.poll() is None and time.time() < deadline: time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL); run.wait()                                  # the launcher and both ranks
    assert json.loads(meta.read_text())["step"] == 0, "the run finished before the kill: nothing was tested"
    done = subprocess.run(_torchrun("-m", "jetrl.cli", "train", *RUN, "--out", str(out), "--resume"), env=_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1]
    resumed, uninterrupted = _final_weights(out), _final_weights(two_rank_run)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), "resumed weights differ"


GRADED_REWARD = """\
import os
def graded(prompts, completions, trainer_state, **kwargs):
    "1 or 0 by position; from step FAIL_FROM on (when set) it raises: the grader is down."
    if trainer_state.global_step >= int(os.environ.get("FAIL_FROM", 10**9)): raise RuntimeError("the grader is down")
    return [float(i % 2) for i in range(len(completions))]
"""


def test_every_reward_failing_on_two_ranks_stops_like_one_process_and_resumes(tmp_path):
    "Rewards that all fail from step 2: one error line, steps 0-1 checkpointed although none was due, a resume goes on."
    out, reward = tmp_path / "run", tmp_path / "graded.py"
    reward.write_text(GRADED_REWARD)
    command = _torchrun("-m", "jetrl.cli", "train", *RUN, "--steps", "4", "--save-every", "10", "--reward", f"{reward}:graded",
                        "--out", str(out))
    done = subprocess.run(command, env=_env(FAIL_FROM="2"), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    errors = _error_lines(done.stderr)
    assert done.returncode != 0 and len(errors) == 1 and "jetrl/train.py" not in done.stderr, done.stderr[-3000:]
    assert "every reward of step 2 failed" in errors[0] and "the grader is down" in errors[0], errors[0]
    assert f"steps up to 1 are saved in {out}" in errors[0] and "--resume" in errors[0], errors[0]
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1]
    assert json.loads((out / "checkpoint" / "checkpoint.json").read_text())["step"] == 1      # saved on the stop (due at 9)
    done = subprocess.run(command + ["--resume"], env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1, 2, 3] and not (out / "metrics.superseded.jsonl").exists()


def _free_port() -> int:
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def test_fp8_sync_and_a_dying_rank():
    "Two processes without torchrun (as on two machines): the FP8 sync checks, then rank 1 dies at step 1."
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    script = [sys.executable, str(REPO / "tests" / "distributed_checks.py"), "--die-at-step", "1"]
    ranks = [subprocess.Popen(script, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    (out0, err0), _ = [rank.communicate(timeout=LAUNCH_TIMEOUT_S) for rank in ranks]
    assert ranks[0].returncode == 0 and ranks[1].returncode == 3, err0[-3000:]
    lines = [json.loads(l) for l in out0.splitlines() if l.startswith("{")]
    fp8, hp = (next(l for l in lines if l["sync_format"] == f) for f in ("fp8", "hp"))
    assert fp8["fp8_layers"] == hp["fp8_layers"] == 28                             # every FP8 layer: the trainer's bytes
    # jetrl-tiny trains in fp32 on the CPU: 4 bytes a weight gathered, or 1 (+ one fp32 scale per 128 x 128 block)
    assert fp8["layer_bytes"] < 0.26 * hp["layer_bytes"], (fp8, hp)
    assert fp8["sync_bytes"] - fp8["layer_bytes"] == hp["sync_bytes"] - hp["layer_bytes"]  # the rest: gathered alike
    lost = next(l for l in out0.splitlines() if l.startswith("RankLostError"))
    assert "another rank failed" in lost and float(lost.split()[2].rstrip("s:")) < 60, lost


def test_clear_errors_before_launching():
    with pytest.raises(ValueError, match="does not split among 3 processes.*--prompts-per-step 15 or 18"): check_divisible(16, 3)
    with pytest.raises(RuntimeError, match="no NCCL"): choose_backend(0, cuda_gpus=1, nccl_available=False)
    with pytest.raises(RuntimeError, match="--nproc-per-node 2"): choose_backend(3, cuda_gpus=2, nccl_available=True)


def _folder_digest(folder: Path) -> dict:
    "The run's files and their hashes; the folder's lock file (who last took the folder) aside."
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def _error_lines(stderr: str) -> list[str]: return [l for l in stderr.splitlines() if l.startswith("jetrl: error:")]


def test_resume_a_torchrun_checkpoint_in_one_process(two_rank_run):
    "A Distributed Checkpoint resumed without torchrun: one error line with the torchrun command, the folder untouched."
    before, args = _folder_digest(two_rank_run), ["train", *RUN, "--out", str(two_rank_run), "--resume"]
    done = subprocess.run([sys.executable, "-m", "jetrl.cli", *args], env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 2 and len(_error_lines(done.stderr)) == 1, done.stderr[-3000:]
    error = _error_lines(done.stderr)[0]
    assert "is a Distributed Checkpoint written by 2 torchrun process(es)" in error, error
    assert f"`torchrun --nproc-per-node 2 -m jetrl.cli {shlex.join(args)}`" in error, error
    assert _folder_digest(two_rank_run) == before


def test_resume_a_single_process_checkpoint_under_torchrun(one_process_run):
    "The converse: one error line (rank 0's; not one per rank) with the single-process command, the folder untouched."
    before, args = _folder_digest(one_process_run), ["train", *RUN, "--out", str(one_process_run), "--resume"]
    done = subprocess.run(_torchrun("-m", "jetrl.cli", *args), env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode != 0 and len(_error_lines(done.stderr)) == 1, done.stderr[-3000:]
    error = _error_lines(done.stderr)[0]
    assert "was written by a single-process run (safetensors)" in error and f"`jetrl {shlex.join(args)}`" in error, error
    assert _folder_digest(one_process_run) == before


def test_one_rank_fsdp_quantizes_each_weight_once_per_update(monkeypatch):
    """FSDP2 over one rank (`torchrun --nproc-per-node 1`) vs one process, jet: a step's old log-probs (no grad, in
    micro-batches), training micro-batches, update and weight sync quantize each FP8 weight once, in the sync, as one
    process does (a no-grad forward that missed the cache would quantize every weight in every micro-batch). After the update, the trainer's
    forward uses the rollout copy's bytes, which are the current weight's."""
    import jetrl.distributed as jd, jetrl.linear as jl
    from jetrl.policy import Policy, load_model_and_tokenizer, token_log_probs
    from jetrl.rollout import RolloutEngine, SamplingParams, micro_batches, recompute_log_probs
    calls, phase = [], ["setup"]
    def counting(fn):
        def wrapper(*args, **kwargs): calls.append(phase[0]); return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(jl, "quantize_weight", counting(jl.quantize_weight))
    monkeypatch.setattr(jd, "quantize_weight", counting(jd.quantize_weight))
    monkeypatch.setattr(jd, "quantize_row_shard", counting(jd.quantize_row_shard))
    micro_batch, steps = 2, 1

    def run_steps(world) -> list[dict]:
        torch.manual_seed(0)
        model, tokenizer = load_model_and_tokenizer("jetrl-tiny")
        policy = Policy(model.train(), tokenizer, "jet", device="cpu")
        if world: jd.shard_policy(policy, world); jd.sync_rollout_weights(policy, world)
        sync = (lambda: jd.sync_rollout_weights(policy, world)) if world else policy.sync_weights
        engine, optimizer = RolloutEngine(policy, chat_template=False), torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
        rollout = engine.generate([[5, 6, 7, 8]], SamplingParams(n=4, max_new_tokens=4, seed=0, ignore_eos=True))
        counts = []
        for _ in range(steps):
            calls.clear()
            phase[0] = "old_logp"; recompute_log_probs(policy.model, rollout, micro_batch_size=micro_batch)
            phase[0] = "train"
            parts = micro_batches(len(rollout), micro_batch)
            for i, rows in enumerate(parts):
                if world: world.before_backward(policy.model, i == len(parts) - 1)
                token_log_probs(policy.model, rollout.input_ids[rows], rollout.attention_mask[rows]).sum().backward()
            optimizer.step(); optimizer.zero_grad()
            phase[0] = "sync"; sync()
            counts.append({p: calls.count(p) for p in ("old_logp", "train", "sync")})
        assert counts == [{"old_logp": 0, "train": 0, "sync": layers}] * steps, counts
        return policy, rollout

    layers = 28                                                # jetrl-tiny's FP8 linears
    run_steps(None)
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    world = jd.init_world(timeout_s=60)
    try:
        policy, rollout = run_steps(world)
        with torch.no_grad(): token_log_probs(policy.model, rollout.input_ids[:1], rollout.attention_mask[:1])
        rollout_layers = dict(policy.rollout_model.named_modules())
        for fqn, m in jl.fp8_modules(policy.model).items():       # the trainer's FP8 bytes: the rollout copy's, and current
            cached = m._synced[2]
            assert cached.data.data_ptr() == rollout_layers[fqn].weight_fp8.data_ptr(), fqn
            assert torch.equal(cached.data.view(torch.uint8), jl.quantize_weight(m.weight, m.recipe).data.view(torch.uint8)), fqn
    finally: torch.distributed.destroy_process_group()


SCALING = ["--parts", "torchrun", "--strategies", "jet", "--prompts-per-gpu", "2", "--steps", "1"]
TINY_STEP = ["--", "--model", "jetrl-tiny", "--samples", "2", "--new-tokens", "8", "--micro-batch", "4"]


def _scaling(tmp_path, *args) -> tuple[subprocess.CompletedProcess, list[dict]]:
    "`python -m benchmarks grpo_step_torchrun ...` on the CPU: its process and the rows it wrote."
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "grpo_step_torchrun", *SCALING, "--logs", str(tmp_path / "logs"),
                           "--out", str(out), *args], env=_env(), capture_output=True, text=True, cwd=REPO,
                          timeout=LAUNCH_TIMEOUT_S)
    return done, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_scaling_benchmark_reports_every_rank_and_the_efficiency(tmp_path):
    done, rows = _scaling(tmp_path, "--nproc", "2,1", *TINY_STEP)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = rows                                                       # the 1-rank launch first, whatever the order given
    assert (one["gpus"], two["gpus"]) == (1, 2) and (one["prompts"], two["prompts"]) == (2, 4)    # weak scaling
    assert two["tokens"] == 2 * one["tokens"] and "scaling_efficiency" not in one
    assert two["scaling_efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]), rel=1e-5)
    assert two["tokens_per_s_per_gpu"] == pytest.approx(two["tokens_per_s"] / 2, rel=1e-6)
    by_rank = two["logp_abs_diff_max_by_rank"]                            # every rank's gap, the row's the largest
    assert len(by_rank) == 2 and two["logp_abs_diff_max"] == pytest.approx(max(by_rank), abs=1e-6)
    assert 0 < two["sync_bytes"] < two["sync_bytes_hp"]                   # the FP8 sync moves fewer bytes than BF16's
    assert two["command"].startswith("python -m benchmarks grpo_step_torchrun") and "--out" not in two["launch"]


def test_scaling_benchmark_keeps_a_failed_launch_as_a_row_with_its_log(tmp_path):
    done, rows = _scaling(tmp_path, "--nproc", "2", "--", "--model", "no-such-model")
    assert done.returncode == 1 and "failed" in done.stderr
    (row,) = rows
    assert row["failed"] and row["gpus"] == 2 and row["returncode"] not in (0, None) and not row["timed_out"]
    assert {e.split(":")[0] for e in row["rank_errors"]} == {"[rank0]", "[rank1]"} and "no-such-model" in row["rank_errors"][0]
    assert "no-such-model" in Path(row["log"]).read_text() and row["log_tail"]


def test_a_rank_leaves_with_its_status_and_its_output_flushed():
    """exit_rank skips the interpreter's C++ teardown (os._exit): the command's exit status and what it printed, unflushed,
    still come out."""
    code = "import sys; from jetrl.distributed import exit_rank; print('done', end=''); print('warned', end='', file=sys.stderr); exit_rank(3)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "done", "warned"), done
