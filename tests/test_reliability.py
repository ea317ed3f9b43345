"""Nothing lost, nothing cryptic (issue 12): crash-safe checkpoints, resume that keeps every metrics line, one clear
error line for each user error, refusals for accepted-but-wrong inputs, and verifiers with one definition of a
correct answer and bounded work (fuzzed over hostile strings with a per-call time limit)."""
import errno, json, math, os, random, re, shutil, time, warnings
from fractions import Fraction
from pathlib import Path
import pytest
import torch
import torch.nn as nn

import jetrl.checkpoints as checkpoints_module
import jetrl.train as train_module
from jetrl.cli import main
from jetrl.fp8 import quantize
from jetrl.grpo import GRPOConfig
from jetrl.linear import FP8Linear, convert_to_fp8
from jetrl.policy import Policy
from jetrl.checkpoints import CheckpointError, load_checkpoint, recover_checkpoint, save_checkpoint
from jetrl.rollout import RolloutEngine, SamplingParams
from jetrl.tasks import (MAX_COMPLETION_CHARS, chain_steps_reward, countdown_reward, countdown_score, format_reward,
                         number_reward, parse_number)
from jetrl.runfolder import LOCK_FILE, SUPERSEDED_FILE
from jetrl.train import RunFolderWarning, TrainConfig, read_metrics, train

SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3"]


def tiny_policy(seed: int) -> Policy:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=96, max_position_embeddings=64))
    return Policy(model, strategy="jet", device="cpu")


def trained(seed: int):
    "A policy and an optimizer with state, both distinct per seed."
    policy = tiny_policy(seed)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))
    policy.model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    return policy, optimizer


def weights(policy: Policy) -> dict: return {k: v.clone() for k, v in policy.model.state_dict().items()}


def same(a: dict, b: dict) -> bool: return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- a kill at every point of a checkpoint swap ----------------------------------------------------------------------

class Killed(BaseException):
    "A stand-in for kill -9: a BaseException, so no `except Exception` in the code under test can swallow it."


class FileOperations:
    """Wraps every file operation save_checkpoint performs; counts them, and 'kills' the save at operation number
    `kill_at`, either before it runs or half-way through (a file cut short, a folder partly deleted)."""

    def __init__(self, monkeypatch, kill_at: int | None = None, half_done: bool = False):
        self.count, self.kill_at, self.half_done, self.names = 0, kill_at, half_done, []
        real = {"save_model": checkpoints_module.save_model, "save_file": checkpoints_module.save_file, "write_text": Path.write_text,
                "mkdir": Path.mkdir, "replace": os.replace, "rmtree": shutil.rmtree}

        def wrap(name):
            def operation(*args, **kwargs):
                index = self.count; self.count += 1; self.names.append(name)
                if index != self.kill_at: return real[name](*args, **kwargs)
                if self.half_done: self._half(name, real, *args, **kwargs)
                raise Killed(f"{name} #{index}")
            return operation

        monkeypatch.setattr(checkpoints_module, "save_model", wrap("save_model"))
        monkeypatch.setattr(checkpoints_module, "save_file", wrap("save_file"))
        for cls, name in [(Path, "write_text"), (Path, "mkdir"), (os, "replace"), (shutil, "rmtree")]:
            monkeypatch.setattr(cls, name, wrap(name))

    @staticmethod
    def _half(name, real, *args, **kwargs):
        "Do half of the operation: the first half of a file's bytes, or one file of a folder deleted."
        if name in ("save_model", "save_file"):
            real[name](*args, **kwargs)
            path = Path(args[1]); path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif name == "write_text":
            path, text = args[0], args[1]
            with open(path, "w") as f: f.write(text[: len(text) // 2])
        elif name == "rmtree":
            first = sorted(Path(args[0]).iterdir())[0]
            first.unlink()


@pytest.mark.parametrize("half_done", [False, True], ids=["before", "half-way"])
def test_a_kill_at_every_file_operation_of_a_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, half_done):
    "Save step 1, then kill the save of step 2 at each of its file operations: the folder always loads, as step 1 or 2."
    old_policy, old_optimizer = trained(seed=1)
    new_policy, new_optimizer = trained(seed=2)
    expected = {1: weights(old_policy), 2: weights(new_policy)}
    save_checkpoint(tmp_path / "count" / "ckpt", old_policy, old_optimizer, step=1)
    with monkeypatch.context() as m:                                         # the operations of a save over an older one
        counter = FileOperations(m)
        save_checkpoint(tmp_path / "count" / "ckpt", new_policy, new_optimizer, step=2)
    operations = counter.names
    assert operations.count("replace") == 2 and operations.count("rmtree") == 1, operations
    seen = set()
    for kill_at in range(len(operations)):
        folder = tmp_path / f"kill{kill_at}"
        save_checkpoint(folder / "ckpt", old_policy, old_optimizer, step=1)
        with monkeypatch.context() as m:
            FileOperations(m, kill_at, half_done)
            with pytest.raises(Killed): save_checkpoint(folder / "ckpt", new_policy, new_optimizer, step=2)
        fresh = tiny_policy(seed=3)                                          # a new process, after the kill
        step = load_checkpoint(folder / "ckpt", fresh, torch.optim.AdamW(fresh.model.parameters()))["step"]
        assert same(weights(fresh), expected[step]), f"killed at {operations[kill_at]} #{kill_at}: wrong weights for step {step}"
        assert sorted(p.name for p in folder.iterdir()) == ["ckpt"], f"leftovers after recovery: {list(folder.iterdir())}"
        seen.add(step)
        save_checkpoint(folder / "ckpt", new_policy, new_optimizer, step=3)    # and the next save goes through
        assert load_checkpoint(folder / "ckpt", fresh)["step"] == 3
    assert seen == {1, 2}                                                    # kills before and after the new one took over


def test_recover_checkpoint_covers_every_state_the_swap_can_leave(tmp_path):
    policy, optimizer = trained(seed=1)
    source = save_checkpoint(tmp_path / "source", policy, optimizer, step=4)
    ckpt = tmp_path / "ckpt"
    tmp, old = tmp_path / "ckpt.tmp", tmp_path / "ckpt.old"
    # (ckpt, ckpt.tmp finished, ckpt.old) present -> expected survivor
    cases = [((True, False, False), "ckpt"), ((True, True, False), "ckpt"), ((False, True, True), "tmp"),
             ((True, False, True), "ckpt"), ((False, False, True), "old"), ((False, True, False), "tmp"), ((False, False, False), None)]
    for (has_ckpt, has_tmp, has_old), survivor in cases:
        for folder in (ckpt, tmp, old): shutil.rmtree(folder, ignore_errors=True)
        for present, folder, step in [(has_ckpt, ckpt, 1), (has_tmp, tmp, 2), (has_old, old, 0)]:
            if present:
                shutil.copytree(source, folder)
                meta = json.loads((folder / "checkpoint.json").read_text()); meta["step"] = step
                (folder / "checkpoint.json").write_text(json.dumps(meta))
        found = recover_checkpoint(ckpt)
        assert (found is None) == (survivor is None)
        if survivor: assert json.loads((ckpt / "checkpoint.json").read_text())["step"] == {"ckpt": 1, "tmp": 2, "old": 0}[survivor]
        assert not tmp.exists() and not old.exists()
    tmp.mkdir(); (tmp / "model.safetensors").write_bytes(b"cut")              # an unfinished first save: no checkpoint
    assert recover_checkpoint(ckpt) is None and not tmp.exists()


# ---- damaged checkpoints: one line naming the file, nothing loaded ----------------------------------------------------

@pytest.mark.parametrize("damage", ["model cut short", "model garbage", "model empty", "optimizer cut short",
                                    "json garbage", "json empty", "json not an object", "json without step", "model missing"])
def test_damaged_checkpoint_is_refused_naming_the_file_and_loading_nothing(tmp_path, damage):
    policy, optimizer = trained(seed=1)
    path = save_checkpoint(tmp_path / "ckpt", policy, optimizer, step=1)
    target, how = {"model": "model.safetensors", "optimizer": "optimizer.safetensors", "json": "checkpoint.json"}[damage.split()[0]], damage.split(" ", 1)[1]
    file = path / target
    if how == "cut short": file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "garbage": file.write_bytes(b"\x93NUMPY garbage " * 10)
    elif how == "empty": file.write_bytes(b"")
    elif how == "not an object": file.write_text("[1, 2]")
    elif how == "without step": file.write_text(json.dumps({k: v for k, v in json.loads(file.read_text()).items() if k != "step"}))
    elif how == "missing": file.unlink()
    fresh = tiny_policy(seed=3)
    before = weights(fresh)
    with pytest.raises(CheckpointError) as error: load_checkpoint(path, fresh, torch.optim.AdamW(fresh.model.parameters()))
    message = str(error.value)
    assert str(file) in message and "\n" not in message, message
    assert same(weights(fresh), before), "a refused checkpoint changed the policy"


def test_checkpoint_of_another_model_is_refused_before_loading(tmp_path):
    policy, optimizer = trained(seed=1)
    path = save_checkpoint(tmp_path / "ckpt", policy, optimizer, step=1)
    from transformers import LlamaConfig, LlamaForCausalLM
    other = Policy(LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=1, vocab_size=96)), strategy="jet", device="cpu")
    before = weights(other)
    with pytest.raises(CheckpointError, match="weights of another model"): load_checkpoint(path, other)
    assert same(weights(other), before)


# ---- resume: metrics never deleted, config checked, a cut line restored ---------------------------------------------

def cli(model_dir, out, *extra, steps=2):
    return main(["train", "--model", model_dir, "--strategy", "bf16", *SMALL, "--steps", str(steps), "--out", str(out), *extra])


def error_line(capsys) -> str:
    "The one `jetrl: error:` line on stderr (and no traceback)."
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("jetrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_checkpoint_never_costs_the_metrics(model_dir, tmp_path, capsys):
    "The state the issue found: checkpoint/ gone (moved away). Resume refuses, with any config, and changes nothing."
    out = tmp_path / "run"
    assert cli(model_dir, out) == 0
    metrics_before = (out / "metrics.jsonl").read_bytes()
    (out / "checkpoint").rename(tmp_path / "moved")
    assert cli(model_dir, out, "--resume", "--seed", "7", "--lr", "5e-4") == 2
    line = error_line(capsys)
    assert "another config" in line and "seed: 0 in the run, 7 now" in line and "lr: 0.001 in the run, 0.0005 now" in line, line
    assert cli(model_dir, out, "--resume") == 2
    assert "checkpoint is missing but metrics.jsonl logs steps up to 1" in error_line(capsys)
    assert (out / "metrics.jsonl").read_bytes() == metrics_before
    (tmp_path / "moved").rename(out / "checkpoint")                           # put back: it resumes
    assert cli(model_dir, out, "--resume", steps=3) == 2                      # but not with another --steps
    assert "steps: 2 in the run, 3 now" in error_line(capsys)
    assert cli(model_dir, out, "--resume") == 0 and (out / "metrics.jsonl").read_bytes() == metrics_before


def test_kill_between_the_renames_of_the_swap_resumes_to_the_same_run(model_dir, tmp_path):
    "checkpoint.old + a finished checkpoint.tmp (a kill after step 2 of the swap): the resume takes the new one."
    config = TrainConfig(model=model_dir, strategy="bf16", steps=3, prompts_per_step=2, grpo=GRPOConfig(num_generations=4),
                         max_new_tokens=6, lr=1e-3)
    whole = train(config, tmp_path / "whole").history
    out = tmp_path / "killed"
    train(config, out, callbacks=[lambda m: m["step"] < 1])                   # stops after step 1 (checkpoint of step 1)
    (out / "checkpoint").rename(out / "checkpoint.old")
    shutil.copytree(out / "checkpoint.old", out / "checkpoint.tmp")
    meta = json.loads((out / "checkpoint.old" / "checkpoint.json").read_text()); meta["step"] = 0  # the old one is older
    (out / "checkpoint.old" / "checkpoint.json").write_text(json.dumps(meta))
    resumed = train(config, out, resume=True).history
    assert [m["step"] for m in resumed] == [0, 1, 2] and sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) == ["checkpoint", "metrics.jsonl"]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]


def test_cut_last_line_of_a_saved_step_is_restored_from_the_checkpoint(model_dir, tmp_path):
    config = TrainConfig(model=model_dir, strategy="bf16", steps=2, prompts_per_step=2, grpo=GRPOConfig(num_generations=4), max_new_tokens=6)
    out = tmp_path / "run"
    train(config, out)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # step 1 cut short
    with pytest.warns(RunFolderWarning, match="line of step 1 was cut short; restored"):
        run = train(config, out, resume=True)
    assert (out / "metrics.jsonl").read_text().splitlines() == lines         # byte for byte, nothing lost
    assert [m["step"] for m in run.history] == [0, 1]
    assert (out / SUPERSEDED_FILE).read_text() == lines[-1][: len(lines[-1]) // 2] + "\n"    # the cut line is kept


def test_lines_after_the_checkpoint_are_moved_aside_and_redone(model_dir, tmp_path):
    "save_every=2: steps 2 and a cut line 3 logged after the checkpoint of step 1; resume redoes them, keeps the old lines."
    config = TrainConfig(model=model_dir, strategy="bf16", steps=4, prompts_per_step=2, grpo=GRPOConfig(num_generations=4),
                         max_new_tokens=6, save_every=2)
    out = tmp_path / "run"
    train(config, out, callbacks=[lambda m: m["step"] < 2])                   # steps 0-2 logged, checkpoint of step 1
    logged = (out / "metrics.jsonl").read_text()
    with open(out / "metrics.jsonl", "a") as f: f.write('{"step": 3, "reward": 0.')    # a line cut by a kill
    with pytest.warns(RunFolderWarning, match=r"resuming at step 2; logged steps \[2\] come after the checkpoint.*1 unreadable"):
        run = train(config, out, resume=True)
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1, 2, 3] and len(run.history) == 4
    superseded = (out / SUPERSEDED_FILE).read_text().splitlines()
    assert superseded == [logged.splitlines()[3], '{"step": 3, "reward": 0.']


def test_resume_of_an_empty_or_missing_folder_says_it_starts_a_new_run(model_dir, tmp_path, capsys):
    for out in [tmp_path / "missing", tmp_path / "empty"]:
        if out.name == "empty": out.mkdir()
        assert cli(model_dir, out, "--resume", steps=1) == 0
        err = capsys.readouterr().err
        assert f"jetrl: warning: resume: {out} holds no run" in err and "starting a new run" in err, err
        assert [m["step"] for m in read_metrics(out)[1]] == [0]


def test_resume_without_a_log_but_with_a_checkpoint_is_refused(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(model_dir, out, steps=1) == 0
    (out / "metrics.jsonl").unlink()
    assert cli(model_dir, out, "--resume", steps=1) == 2
    assert "has a checkpoint but no metrics.jsonl" in error_line(capsys)
    assert (out / "checkpoint" / "checkpoint.json").exists()


@pytest.mark.parametrize("damage, names", [
    ("empty metrics", "metrics.jsonl is empty"), ("garbage metrics", "metrics.jsonl is not a jetrl metrics log"),
    ("garbage checkpoint.json", "checkpoint.json is damaged"), ("cut model.safetensors", "model.safetensors is damaged"),
    ("garbage optimizer.safetensors", "optimizer.safetensors is damaged")])
def test_damaged_run_folder_is_one_error_line_naming_the_file(model_dir, tmp_path, capsys, damage, names):
    out = tmp_path / "run"
    assert cli(model_dir, out, steps=1) == 0
    capsys.readouterr()
    file = {"metrics": out / "metrics.jsonl"}.get(damage.split()[1], out / "checkpoint" / damage.split()[1])
    if damage.startswith("empty"): file.write_bytes(b"")
    elif damage.startswith("cut"): file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else: file.write_bytes(b"garbage\x00\xff" * 7)
    before = file.read_bytes()
    assert cli(model_dir, out, "--resume", steps=1) == 2
    line = error_line(capsys)
    assert names in line and str(out) in line, line
    assert file.read_bytes() == before                                         # the evidence is left as it was


def test_read_metrics_of_a_live_run_skips_the_line_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"config": {"steps": 3}}) + "\n" + json.dumps({"step": 0}) + "\n" + '{"step": 1, "rew')
    with warnings.catch_warnings(): warnings.simplefilter("error"); config, steps = read_metrics(path)
    assert config == {"steps": 3} and steps == [{"step": 0}]
    path.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{path} is empty")): read_metrics(path)
    with pytest.raises(FileNotFoundError, match="does not exist"): read_metrics(tmp_path / "nowhere")


# ---- unwritable output folder ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS], ids=["no permission", "read-only"])
def test_unwritable_out_is_one_error_line_before_the_model_loads(model_dir, tmp_path, capsys, monkeypatch, code):
    loaded = []
    monkeypatch.setattr(train_module, "load_model_and_tokenizer", lambda *a: loaded.append(a))
    real_write = Path.write_bytes
    def refuse(self, data):
        if self.parent == tmp_path / "out": raise OSError(code, os.strerror(code), str(self))
        return real_write(self, data)
    monkeypatch.setattr(Path, "write_bytes", refuse)
    assert cli(model_dir, tmp_path / "out") == 2
    line = error_line(capsys)
    assert f"cannot write to the output folder {tmp_path / 'out'} ({os.strerror(code)})" in line and not loaded


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_out_without_write_permission(model_dir, tmp_path, capsys):
    locked = tmp_path / "locked"; locked.mkdir(); locked.chmod(0o500)
    try:
        assert cli(model_dir, locked / "run") == 2
        assert "cannot write to the output folder" in error_line(capsys)
    finally: locked.chmod(0o700)


def test_out_that_is_a_file(model_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert cli(model_dir, tmp_path / "file") == 2
    assert "is a file: give a folder" in error_line(capsys)
    assert cli(model_dir, tmp_path / "file" / "run") == 2
    assert "cannot write to the output folder" in error_line(capsys)


def test_disk_full_mid_run_is_one_line_and_the_run_resumes(model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real, calls = train_module.append_line, []
    def full_on_second_step(path, line):
        calls.append(line)
        if len(calls) == 2: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, line)
    monkeypatch.setattr(train_module, "append_line", full_on_second_step)
    assert cli(model_dir, out) == 2
    assert "No space left on device" in error_line(capsys)
    monkeypatch.setattr(train_module, "append_line", real)
    assert cli(model_dir, out, "--resume") == 0
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1]


# ---- accepted-but-wrong arguments ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--group-size", "1"], "--group-size) must be >= 2"), (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "lr must be a finite number > 0, got nan"), (["--lr", "-1"], "lr must be a finite number > 0"),
    (["--epsilon-high", "nan"], "epsilon_high must be a finite number, got nan"),
    (["--reward-weights", "nan,1"], "reward_weights must be finite numbers"), (["--reward-weights", "1,inf"], "reward_weights must be finite numbers"),
    (["--task-knobs", "digits=1,digits=2"], "task knob 'digits' is given twice (digits=1, digits=2)"),
    (["--task-knobs", "digits=３"], "digits must be a whole number")])
def test_wrong_arguments_are_refused_with_one_line(model_dir, tmp_path, capsys, args, message):
    try: code = cli(model_dir, tmp_path / "run", *args)
    except SystemExit as e: code = e.code                                     # argparse's own check
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("bad", [dict(lr=float("inf")), dict(lr=float("nan")), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(grpo=GRPOConfig(num_generations=1)),
                                 dict(weight_decay=float("nan")), dict(max_grad_norm=float("nan")), dict(format_weight=float("inf"))])
def test_train_config_refuses_non_finite_and_degenerate_values(bad):
    with pytest.raises(ValueError, match=f"{next(iter(bad)).replace('grpo', 'num_generations')}"): TrainConfig(**bad)


# ---- rollout inputs --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(model_dir):
    from jetrl.policy import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(model_dir)
    return RolloutEngine(Policy(model, tokenizer, "bf16", device="cpu"))


def test_a_bare_string_is_one_prompt(engine):
    params = SamplingParams(n=2, max_new_tokens=2, seed=0)
    one = engine.generate("What is 1 + 2?", params)
    assert len(one) == 2 and one.prompts == ["What is 1 + 2?"] * 2
    listed = engine.generate(["What is 1 + 2?"], params)
    assert torch.equal(one.completion_ids, listed.completion_ids)
    ids = engine.tokenizer("What is 1 + 2?")["input_ids"]
    assert len(engine.generate(ids, params)) == 2                             # a bare list of ids too


@pytest.mark.parametrize("bad_id", [-1, "vocab", "vocab+100"])
def test_token_ids_outside_the_vocabulary_are_refused(engine, bad_id):
    vocab = engine.model.get_input_embeddings().num_embeddings
    token = {"vocab": vocab, "vocab+100": vocab + 100}.get(bad_id, bad_id)
    with pytest.raises(ValueError, match=rf"Prompt #1 holds token id\(s\) \[{token}\] outside the model's vocabulary \[0, {vocab}\)"):
        engine.generate([[5, 6], [5, token, 6]], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("params", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(temperature=float("nan"), do_sample=False), dict(top_p=float("nan"))])
def test_sampling_params_refuse_nan_and_inf(params):
    with pytest.raises(ValueError, match="temperature|top_p"): SamplingParams(**params)


# ---- FP8 inputs ------------------------------------------------------------------------------------------------------

def test_quantize_refuses_float64_beyond_the_float32_range():
    fp32_max = torch.finfo(torch.float32).max
    for value in [1e39, -1e300, fp32_max * 1.0001]:
        with pytest.raises(ValueError, match="beyond the float32 range"): quantize(torch.tensor([value, 1.0], dtype=torch.float64), None)
    at_the_edge = quantize(torch.tensor([fp32_max, 1.0], dtype=torch.float64), None).dequantize()
    assert torch.isfinite(at_the_edge).all() and at_the_edge[0] == fp32_max


def test_convert_to_fp8_converts_every_use_of_a_shared_linear():
    torch.manual_seed(0)
    shared = nn.Linear(128, 128)
    block = nn.Sequential(nn.Linear(128, 128), nn.ReLU())                    # a shared block holding a Linear
    model = nn.Sequential(shared, nn.ReLU(), shared, block, block)
    x = torch.randn(4, 128)
    reference = x
    for layer in [shared, None, shared, block[0], None, block[0], None]:       # what the model computes, each Linear in FP8
        reference = torch.relu(reference) if layer is None else FP8Linear.from_linear(layer, "blockwise")(reference)
    convert_to_fp8(model, "blockwise")
    assert type(model[0]) is FP8Linear and model[0] is model[2] and model[0].weight is shared.weight
    assert type(model[3][0]) is FP8Linear and model[3] is model[4]
    assert not [name for name, m in model.named_modules(remove_duplicate=False) if type(m) is nn.Linear]
    assert torch.equal(model(x), reference)


# ---- verifiers: one definition of a correct answer --------------------------------------------------------------------

DIGIT_SETS = {"ascii": "0123456789", "arabic-indic": "٠١٢٣٤٥٦٧٨٩", "full-width": "０１２３４５６７８９",
              "math bold": "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗", "devanagari": "०१२३४५६७८९"}


def spellings(value: int, rng: random.Random) -> list[tuple[str, bool]]:
    "Ways to write `value`, each with whether it is a number by jetrl's definition (ASCII digits, no prefix or '_')."
    ascii_digits = str(value)
    out = [(ascii_digits, True), ("00" + ascii_digits, True)]
    for name, digits in DIGIT_SETS.items():
        if name != "ascii": out.append(("".join(digits[int(d)] for d in ascii_digits), False))
    out += [(hex(value), False), (oct(value), False), (bin(value), False), (f"{value:_}" if value >= 1000 else ascii_digits[0] + "_" + ascii_digits[1:], False),
            ("+" + ascii_digits, False), (ascii_digits + "e0", False)]
    mixed = list(ascii_digits); i = rng.randrange(len(mixed)); mixed[i] = DIGIT_SETS["full-width"][int(mixed[i])]
    out.append(("".join(mixed), False))
    return out


def test_every_verifier_follows_one_definition_of_a_number():
    rng = random.Random(0)
    for value in [7, 12, 305, 1000, 4096, 98765]:
        for text, is_number in spellings(value, rng):
            assert (parse_number(text) == value) == is_number, text
            tagged = f"<answer>{text}</answer>"
            assert number_reward(None, [tagged], answer=[str(value)]) == [float(is_number)], text
            in_text = is_number or text.startswith("+")                       # in running text, '+7' is '+' then 7
            assert number_reward(None, [f"so {text}"], answer=[str(value)], answer_format=["last_number"]) == [float(in_text)], text
            assert countdown_score(text, [value], value) == float(is_number), text
            assert countdown_score(f"{text} + 0", [value, 0], value) == float(is_number), text
            assert countdown_reward(None, [tagged], numbers=[[value]], target=[value]) == [float(is_number)], text
            assert chain_steps_reward(None, [f"first {text} then"], intermediate=[[str(value)]]) == [float(in_text)], text


@pytest.mark.parametrize("answer, score", [
    ("3 + 4", 1.0), ("3 + 4 = 7", 1.0), ("3 + 4 =7", 1.0), ("(3 + 4) = 7.", 1.0), ("3 + 4 = 007", 1.0),
    ("3 + 4 = 7 = 8", 0.0), ("3 + 4 = 7 = 7", 0.0), ("3 + 4 = 8", 0.0), ("3 + 4 =", 0.0), ("7 = 3 + 4", 0.0),
    ("3 + 4 == 7", 0.0), ("= 7", 0.0), ("3 + 4 = seven", 0.0), ("3 + 4 = ７", 0.0), ("0x3 + 4", 0.0), ("3 + 0o4", 0.0),
    ("0b11 + 4", 0.0), ("3 + 4_0 - 36", 0.0), ("03 + 4", 1.0)])
def test_countdown_one_equals_sign_rule(answer, score):
    assert countdown_score(answer, [3, 4, 40, 36], 7) == score


# ---- verifiers: bounded work, fuzzed ---------------------------------------------------------------------------------

# Each verifier is linear in the completion's length below MAX_COMPLETION_CHARS and O(1) above it. The time limit per
# call: SECONDS_PER_CALL + SECONDS_PER_CHAR * length. Measured worst case at the bound (1M characters, '1 1 1 ...',
# chain_steps_reward) on a 2-core machine at load 10: 1.5-1.8 s, i.e. 1.8e-6 s per character; the limit allows 5x that.
SECONDS_PER_CALL, SECONDS_PER_CHAR = 0.25, 1e-5
PIECES = ["<answer>", "</answer>", "<answer>", "=", "==", "+", "-", "*", "/", "**", "(", ")", "((((", "))))", " ", "\n", "\t",
          "0x", "0o", "0b", "_", ".", ",", "$", "e", "E", "j", "nan", "inf", "\x00", "\u2028", "\ufeff", "'", '"', "\\",
          "__import__('os')", "9" * 50, "1,000", "7.5", "-0", "٣", "３", "𝟑", "२", "⁷", "½", "Ⅻ", "\U0010ffff", "\ud800"]
VERIFIERS = [
    ("number_reward tag", lambda c: number_reward(None, [c], answer=["7"])),
    ("number_reward last_number", lambda c: number_reward(None, [c], answer=["7"], answer_format=["last_number"])),
    ("format_reward tag", lambda c: format_reward(None, [c])),
    ("format_reward last_number", lambda c: format_reward(None, [c], answer_format=["last_number"])),
    ("countdown_reward tag", lambda c: countdown_reward(None, [c], numbers=[[3, 4, 7]], target=[7])),
    ("countdown_reward last_line", lambda c: countdown_reward(None, [c], numbers=[[3, 4, 7]], target=[7], answer_format=["last_line"])),
    ("chain_steps_reward", lambda c: chain_steps_reward(None, [c], intermediate=[["7", "1000", "-3", "7.5"]])),
]


def hostile(rng: random.Random, length: int) -> str:
    "A string of about `length` characters: random pieces, with long runs of one piece now and then."
    parts, size = [], 0
    while size < length:
        piece = rng.choice(PIECES)
        if rng.random() < 0.05: piece = piece * rng.randint(1, max(1, (length - size) // len(piece)))
        parts.append(piece); size += len(piece)
    return "".join(parts)[:length]


def timed(name, verifier, text):
    start = time.perf_counter()
    scores = verifier(text)
    elapsed = time.perf_counter() - start
    limit = SECONDS_PER_CALL + SECONDS_PER_CHAR * len(text)
    assert elapsed < limit, f"{name} took {elapsed:.2f} s on {len(text)} characters (limit {limit:.2f} s): {text[:80]!r}"
    assert len(scores) == 1 and 0.0 <= scores[0] <= 1.0 and math.isfinite(scores[0]), (name, scores)
    return scores[0]


def test_fuzz_verifiers_on_hostile_strings():
    rng = random.Random(12)
    lengths = [rng.choice([0, 1, 2, 5, 20, 100, 1_000]) for _ in range(300)] + [rng.randint(10_000, 100_000) for _ in range(6)]
    for length in lengths:
        text = hostile(rng, length)
        for name, verifier in VERIFIERS: timed(name, verifier, text)


def test_fuzz_right_answers_in_hostile_noise_still_score():
    "The noise must not hide a right answer, nor make a wrong one right."
    rng = random.Random(7)
    for _ in range(100):
        noise = hostile(rng, rng.choice([10, 100, 1_000])).replace("<answer>", "").replace("</answer>", "")
        assert timed("number_reward tag", VERIFIERS[0][1], noise + "<answer>7</answer>") == 1.0
        assert timed("number_reward tag", VERIFIERS[0][1], noise + "<answer>8</answer>") == 0.0
        assert timed("countdown_reward tag", VERIFIERS[4][1], noise + "<answer>3 + 4</answer>") == 1.0
        assert timed("countdown_reward tag", VERIFIERS[4][1], noise + "<answer>3 + 4 = 7 = 8</answer>") == 0.0


def test_completions_past_the_bound_score_zero_unread():
    answer = "<answer>7</answer>"
    past = "1 " * (MAX_COMPLETION_CHARS // 2) + answer                        # long past the bound, the answer at the end
    for name, verifier in VERIFIERS:
        start = time.perf_counter()
        assert verifier(past) == [0.0], name
        assert time.perf_counter() - start < SECONDS_PER_CALL, f"{name} read a completion past the bound"


def test_verifiers_at_the_bound_stay_within_the_time_limit():
    "The worst inputs measured, at the largest length a verifier reads."
    numbers = ("1 " * MAX_COMPLETION_CHARS)[:MAX_COMPLETION_CHARS]
    decimals = ("1.5 " * MAX_COMPLETION_CHARS)[:MAX_COMPLETION_CHARS]
    for name, verifier in VERIFIERS:
        if name in ("chain_steps_reward", "number_reward last_number"):
            for text in (numbers, decimals): timed(name, verifier, text)
