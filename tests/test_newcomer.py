"""What a new user meets first: threads on a shared machine, conversational prompts, one-line errors, the help, the
checks `compare` makes before it trains, and the test run's and the vLLM script's defaults."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
import torch

import jetrl.cli as cli_module
from jetrl.cli import COMPARE_SAVE_EVERY, CpuUse, _parser, default_threads, main, summary
from jetrl.data import MAX_SEED, dataset_rows, read_jsonl
from jetrl.policy import Policy, load_model_and_tokenizer
from jetrl.rollout import RolloutEngine
from jetrl.sampling import SamplingParams
from jetrl.tasks import ArithmeticTask, to_chat
from jetrl.train import TrainConfig, read_metrics, train
from jetrl.grpo import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4"]


def one_error_line(capsys) -> str:
    "The one `jetrl: error:` (or argparse `jetrl ...: error:`) line on stderr, with no traceback."
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- threads on a shared machine -------------------------------------------------------------------------------------

@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_threads_option_sets_torchs_threads(model_dir, tmp_path, capsys, restore_threads):
    assert main(["train", "--model", model_dir, "--strategy", "bf16", *SMALL, "--threads", "1", "--out", str(tmp_path / "run")]) == 0
    assert torch.get_num_threads() == 1
    out = capsys.readouterr().out
    assert "threads" in out and "others" in out and "s/step = wall seconds" in out, out


def test_default_threads_is_half_the_cores_unless_omp_says(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == torch.get_num_threads()
    with pytest.raises(SystemExit): _parser().parse_args(["train", "--threads", "0", "--out", "x"])


def test_summary_marks_the_seconds_of_a_busy_machine():
    step = {"accuracy": 0.5, "reward": 0.6, "mismatch/kl_k3": 0.0, "mismatch/logp_abs_diff_mean": 0.0, "time/step": 0.9}
    text = summary({"bf16": [step], "jet": [step]}, cpu={"bf16": CpuUse(2, 10.0, 19.0, 0.0), "jet": CpuUse(2, 10.0, 12.0, 10.0)})
    assert "jet (*): the machine was busy" in text and "bf16 (*)" not in text and "fewer --threads" in text
    assert text.splitlines()[1].endswith(" 0.0") and text.splitlines()[2].endswith(" 1.0*")


# ---- conversational prompts ------------------------------------------------------------------------------------------

CHAT_ROWS = to_chat(ArithmeticTask(digits=1).sample(12))


def test_dataset_check_and_rollout_agree_on_what_a_prompt_is():
    assert dataset_rows(CHAT_ROWS)[0]["prompt"] == [{"role": "user", "content": CHAT_ROWS[0]["prompt"][0]["content"]}]
    with pytest.raises(ValueError, match="one kind of prompt"): dataset_rows([CHAT_ROWS[0], dict(CHAT_ROWS[0], prompt="text")])
    with pytest.raises(ValueError, match="chat messages"): dataset_rows([{"prompt": [{"role": "user", "content": 3}]}])


def test_conversational_prompts_go_through_the_tiny_policys_chat_template():
    model, tokenizer = load_model_and_tokenizer("jetrl-tiny")
    engine = RolloutEngine(Policy(model, tokenizer, "bf16", device="cpu"))
    messages = CHAT_ROWS[0]["prompt"]
    rollout = engine.generate([messages], SamplingParams(n=2, max_new_tokens=4, seed=0))
    expected = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    row = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    assert row == expected and rollout.prompts[0] == tokenizer.decode(expected)
    assert row == tokenizer(messages[0]["content"], add_special_tokens=False)["input_ids"]                   # the tiny template: the user text as it is
    # a last assistant message is continued, as TRL does: no EOS after it
    partial = messages + [{"role": "assistant", "content": "1"}]
    continued = engine.generate([partial], SamplingParams(n=1, max_new_tokens=2, seed=0))
    ids = continued.prompt_ids[0][continued.prompt_mask[0].bool()].tolist()
    assert ids[-1] != tokenizer.eos_token_id and tokenizer.decode(ids).endswith("1")


def test_conversation_without_a_chat_template_is_one_clear_error(model_dir):
    model, tokenizer = load_model_and_tokenizer(model_dir)
    engine = RolloutEngine(Policy(model, tokenizer, "bf16", device="cpu"))
    with pytest.raises(ValueError, match="prompt 0 is a conversation, and the tokenizer has no chat template"):
        engine.generate([CHAT_ROWS[0]["prompt"]], SamplingParams(n=1, max_new_tokens=2))


def test_conversational_run_end_to_end_rewards_get_trls_arguments(tmp_path):
    calls = []
    def spy(prompts, completions, answer, **kwargs):
        calls.append((prompts, completions))
        return [float(c[0]["content"].strip().startswith(a)) for c, a in zip(completions, answer)]
    config = TrainConfig(model="jetrl-tiny", strategy="bf16", steps=2, prompts_per_step=2, max_new_tokens=6,
                         grpo=GRPOConfig(num_generations=2))
    train(config, tmp_path / "run", dataset=CHAT_ROWS, reward_funcs=[spy])
    prompts, completions = calls[0]
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts) and prompts[0] == prompts[1]
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    steps = read_metrics(tmp_path / "run")[1]
    assert len(steps) == 2 and all(s["mismatch/logp_abs_diff_mean"] < 1e-5 for s in steps)   # trainer and rollout read one prompt


def test_conversational_jsonl_through_the_cli(tmp_path, capsys):
    data, rewards = tmp_path / "chat.jsonl", tmp_path / "rewards.py"
    data.write_text("".join(json.dumps(row) + "\n" for row in CHAT_ROWS))
    rewards.write_text("def first(prompts, completions, answer, **kwargs):\n"
                       "    return [float(c[0]['content'].strip().startswith(a)) for c, a in zip(completions, answer)]\n")
    assert main(["train", "--dataset", str(data), "--reward", f"{rewards}:first", "--strategy", "bf16", *SMALL,
                 "--out", str(tmp_path / "run")]) == 0
    assert read_metrics(tmp_path / "run")[0]["task"]["rows"] == len(CHAT_ROWS)


# ---- one line instead of a traceback ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("def first(prompts, completions\n", "line 1: SyntaxError"),
                                            ("import no_such_package_anywhere\n", "line 1: ModuleNotFoundError"),
                                            ("x = 1 / 0\n", "line 1: ZeroDivisionError")])
def test_reward_file_that_fails_to_load_is_one_line(tmp_path, capsys, text, expected):
    data, rewards = tmp_path / "rows.jsonl", tmp_path / "rewards.py"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    rewards.write_text(text)
    assert main(["train", "--dataset", str(data), "--reward", f"{rewards}:first", *SMALL, "--out", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert "rewards.py" in line and expected in line, line


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "train", "--out", str(tmp_path / "run")], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)                                                     # inside the imports (torch, transformers)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in err and "jetrl: interrupted" in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_ctrl_c_before_the_first_step_does_not_promise_a_resume(model_dir, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs): raise KeyboardInterrupt
    monkeypatch.setattr(cli_module, "train", interrupted)
    assert main(["train", "--model", model_dir, *SMALL, "--out", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert "before the first step" in err and "--resume" not in err and "Traceback" not in err, err


def test_a_meta_model_is_refused_by_policy():
    model, tokenizer = load_model_and_tokenizer("jetrl-tiny")
    with torch.device("meta"): hollow = type(model)(model.config)
    with pytest.raises(ValueError, match="meta device"): Policy(hollow, tokenizer, "bf16", device="cpu")


def test_non_utf8_dataset_names_the_file_and_line(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    assert main(["train", "--dataset", str(data), "--reward", "jetrl.tasks:number_reward", *SMALL, "--out", str(tmp_path / "r")]) == 2
    line = one_error_line(capsys)
    assert f"{data}, line 2: not UTF-8" in line, line


def test_missing_dataset_file_is_named_without_errno(tmp_path, capsys):
    assert main(["train", "--dataset", str(tmp_path / "nope.jsonl"), "--reward", "jetrl.tasks:number_reward", *SMALL,
                 "--out", str(tmp_path / "r")]) == 2
    line = one_error_line(capsys)
    assert "nope.jsonl does not exist" in line and "Errno" not in line, line
    with pytest.raises(FileNotFoundError, match="does not exist"): read_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("args, expected", [(["--seed", str(2**64)], "--seed: must be from 0 to 4294967295"),
                                            (["--seed", "-1"], "--seed: must be from 0 to"),
                                            (["--task", ""], "invalid choice: ''"),
                                            (["--task", "arith"], "arithmetic_chain")])
def test_seed_and_task_are_refused_with_their_range(tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exit_: main(["train", *args, "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    line = one_error_line(capsys)
    assert expected in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64])
def test_train_config_refuses_the_seeds_the_cli_refuses_with_the_same_message(seed, tmp_path, capsys):
    with pytest.raises(ValueError) as error: TrainConfig(seed=seed)
    reason = str(error.value).removeprefix("seed ").removesuffix(" (TrainConfig).")
    assert reason == f"must be from 0 to {MAX_SEED} (2**32 - 1), got {seed}", error.value
    with pytest.raises(SystemExit): main(["train", "--seed", str(seed), "--out", str(tmp_path / "run")])
    assert one_error_line(capsys).endswith(f"--seed: {reason}")
    assert TrainConfig(seed=MAX_SEED).seed == MAX_SEED


def test_train_config_refuses_a_seed_that_is_not_a_whole_number():
    for seed in (1.5, "3", True, None):
        with pytest.raises(ValueError, match="seed must be a whole number"): TrainConfig(seed=seed)


def test_max_seed_is_defined_once():
    defined = [path.name for path in sorted((ROOT / "jetrl").glob("*.py")) if "\nMAX_SEED = " in path.read_text()]
    assert defined == ["data.py"] and cli_module.MAX_SEED == MAX_SEED == 2**32 - 1, defined


def test_compare_refuses_a_strategy_given_twice(tmp_path, capsys):
    assert main(["compare", "--strategies", "jet,bf16,jet", "--out", str(tmp_path)]) == 2
    assert "['jet'] more than once" in one_error_line(capsys)


def test_compare_checks_every_strategys_backend_before_training_any(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_module, "vllm_missing", lambda: None)
    monkeypatch.setattr(cli_module, "vllm_unsupported", lambda policy: "no AMX-FP8 here" if policy.spec.name == "jet" else None)
    assert main(["compare", "--model", model_dir, "--backend", "vllm", "--strategies", "bf16,jet", *SMALL, "--out", str(tmp_path)]) == 2
    assert "vLLM cannot run strategy 'jet' here: no AMX-FP8 here" in one_error_line(capsys)
    assert not any(tmp_path.iterdir())                                  # bf16 did not train


# ---- the newcomer's gaps ---------------------------------------------------------------------------------------------

def test_help_describes_the_commands_and_shows_defaults(capsys):
    with pytest.raises(SystemExit): main(["--help"])
    top = capsys.readouterr().out
    assert "Train one precision strategy" in top and "Train several precision strategies" in top
    with pytest.raises(SystemExit): main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 60)" in text and "(default: jet)" in text and "(default: 0.0002)" in text
    assert "arithmetic, arithmetic_chain, countdown, gsm8k" in text and "--threads" in text


def test_compare_keeps_fewer_checkpoints_by_default():
    assert _parser().parse_args(["compare", "--out", "x"]).save_every == COMPARE_SAVE_EVERY > 1
    assert _parser().parse_args(["train", "--out", "x"]).save_every == 1


def test_compare_says_where_the_checkpoints_are(model_dir, tmp_path, capsys):
    assert main(["compare", "--model", model_dir, "--strategies", "bf16", *SMALL, "--out", str(tmp_path)]) == 0
    assert f"checkpoints: {tmp_path / '<strategy>' / 'checkpoint'}" in capsys.readouterr().out


def test_pytest_lists_skip_reasons():
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-rs" in addopts.split()


def test_readme_says_the_browser_test_needs_chromium():
    readme = (ROOT / "README.md").read_text()
    assert "Chromium" in readme and "tests/test_browser.py" in readme


def test_readme_states_the_main_jobs_time_idle_and_beside_a_busy_process():
    "The README's numbers are the one-thread rows of the results file it names, and busy stays within 1.5x of idle."
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "results" / "cli_threads_cpu.jsonl").read_text().splitlines()]
    idle, busy = (next(r for r in rows if r["threads"] == 1 and r["load"] == load) for load in ("idle", "busy"))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"took {idle['wall_s']} s idle and {busy['wall_s']} s beside one busy process" in readme
    assert idle["command"].replace("--threads T", "--threads 1") in readme and busy["busy"] in readme
    assert f"cli_threads_cpu.jsonl` ({idle['date']}, {idle['git_sha']})" in readme
    assert busy["wall_s"] <= 1.5 * idle["wall_s"] and idle["cores"] == busy["cores"] == 2


def test_vllm_script_keeps_its_venv_and_results_in_the_repository():
    script = (ROOT / "scripts" / "vllm_cpu.sh").read_text()
    assert "/work/" not in script and "$PWD/.venv-vllm" in script and "| bc" not in script
    assert "PYTHON=${PYTHON:-python3.11}" in script and "python3.11 -m" not in script          # another interpreter can be given
    assert subprocess.run(["git", "check-ignore", "-q", ".venv-vllm/"], cwd=ROOT).returncode == 0
    assert 'RESULTS=runs/vllm_cpu.jsonl' in script and "--record) RESULTS=benchmarks/results/vllm_cpu.jsonl" in script
    assert subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu.sh"), "--bogus"], cwd=ROOT, capture_output=True).returncode == 2


def test_main_runs_outside_the_main_thread(tmp_path, capsys):
    import threading
    codes = []
    thread = threading.Thread(target=lambda: codes.append(main(["compare", "--strategies", "jet,jet", "--out", str(tmp_path)])))
    thread.start(); thread.join()
    assert codes == [2]
