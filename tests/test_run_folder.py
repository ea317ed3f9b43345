"""One run per output folder (an OS lock naming its holder), a folder whose run never reached step 0 reusable, and
checkpoints that name the model that wrote them."""
import json, os, shutil, socket
from pathlib import Path
import pytest
import torch
from transformers import AutoModelForCausalLM

from jetrl.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from jetrl.cli import main
from jetrl.grpo import GRPOConfig
from jetrl.policy import Policy
from jetrl.train import TrainConfig, read_metrics, train


def small(model_dir, **changes) -> TrainConfig:
    return TrainConfig(**dict(model=str(model_dir), strategy="bf16", steps=2, prompts_per_step=2, grpo=GRPOConfig(num_generations=4),
                              max_new_tokens=6, lr=1e-3) | changes)


def snapshot(folder: Path) -> dict:
    "Every file of `folder` (the lock file aside) and its bytes."
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and "lock" not in p.name}


def test_a_second_run_on_a_busy_folder_fails_at_once_naming_the_holder(model_dir, tmp_path, capsys):
    out, attempts = tmp_path / "run", []

    def second_runs(metrics):
        if metrics["step"] != 0: return
        before = snapshot(out)
        for resume in (False, True):
            with pytest.raises(OSError) as error: train(small(model_dir), out, resume=resume)
            attempts.append(str(error.value))
        code = main(["train", "--model", str(model_dir), "--strategy", "bf16", "--prompts-per-step", "2", "--group-size", "4",
                     "--max-new-tokens", "6", "--lr", "1e-3", "--steps", "2", "--out", str(out), "--resume"])
        attempts.append((code, capsys.readouterr().err))
        assert snapshot(out) == before, "a refused run changed the folder"

    train(small(model_dir), out, callbacks=[second_runs])
    for message in attempts[:2]:
        assert "in use" in message and f"pid {os.getpid()}" in message and socket.gethostname() in message, message
        assert "\n" not in message
    code, err = attempts[2]
    assert code == 2 and "Traceback" not in err and f"pid {os.getpid()}" in err, err
    assert [m["step"] for m in read_metrics(out)[1]] == [0, 1]
    run = train(small(model_dir), out, resume=True)
    assert [m["step"] for m in run.history] == [0, 1]      # the lock was released when the first run ended


class Stop(BaseException):
    "A failure no `except Exception` swallows (a crash in the first step)."


def test_a_folder_whose_run_failed_before_its_first_step_is_reused(model_dir, tmp_path):
    out = tmp_path / "run"
    def crashing_reward(prompts, completions, **kwargs): raise Stop()
    with pytest.raises(Stop): train(small(model_dir), out, reward_funcs=crashing_reward)
    assert (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()
    run = train(small(model_dir, seed=3), out)                           # not "already holds a run"
    config, steps = read_metrics(out)
    assert config["seed"] == 3 and [m["step"] for m in steps] == [0, 1] and len(run.history) == 2


def test_a_folder_with_a_logged_step_is_still_refused(model_dir, tmp_path):
    out = tmp_path / "run"
    train(small(model_dir, steps=1), out)
    with pytest.raises(FileExistsError, match="already holds a run"): train(small(model_dir, steps=1), out)


def other_model(model_dir, tmp_path) -> Path:
    "A model of the same architecture and shapes as `model_dir`, with other weights, in its own folder."
    folder = tmp_path / "other-model"
    shutil.copytree(model_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters(): p.normal_(0, 0.02)
    model.save_pretrained(folder)
    return folder


def test_resume_refuses_a_checkpoint_of_another_model_of_the_same_shapes(model_dir, tmp_path):
    other = other_model(model_dir, tmp_path)
    train(small(model_dir, steps=3), tmp_path / "mine", callbacks=[lambda m: m["step"] < 0])     # stops after step 0
    train(small(other, steps=3), tmp_path / "theirs", callbacks=[lambda m: m["step"] < 0])
    shutil.rmtree(tmp_path / "mine" / "checkpoint")
    shutil.copytree(tmp_path / "theirs" / "checkpoint", tmp_path / "mine" / "checkpoint")    # a checkpoint copied across runs
    with pytest.raises(CheckpointError) as error: train(small(model_dir, steps=3), tmp_path / "mine", resume=True)
    message = str(error.value)
    assert str(other) in message and str(model_dir) in message and "another model" in message, message


def test_load_checkpoint_names_both_models_when_only_the_name_differs(model_dir, tmp_path):
    other = other_model(model_dir, tmp_path)
    mine = Policy(AutoModelForCausalLM.from_pretrained(model_dir), strategy="bf16", device="cpu")
    theirs = Policy(AutoModelForCausalLM.from_pretrained(other), strategy="bf16", device="cpu")
    path = save_checkpoint(tmp_path / "ckpt", theirs, step=0)
    meta = json.loads((path / "checkpoint.json").read_text())
    assert meta["model"]["name"] == str(other) and meta["model"]["parameters"] == sum(p.numel() for p in theirs.model.parameters())
    before = {k: v.clone() for k, v in mine.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="another model") as error: load_checkpoint(path, mine)
    assert str(other) in str(error.value) and str(model_dir) in str(error.value)
    assert all(torch.equal(before[k], v) for k, v in mine.model.state_dict().items())
    load_checkpoint(path, theirs)                                        # its own model loads it
