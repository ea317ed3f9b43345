"""One run per output folder (an OS lock naming its holder, never an ended run in its place): two `jetrl train`
processes on one --out, or a resume of a run still going, leave one run going and the other refused in one line; a
folder whose run never reached step 0 reusable; checkpoints that name the model that wrote them."""
import json, os, shutil, socket, subprocess, sys, textwrap, threading, time
from pathlib import Path
import pytest
import torch
from transformers import AutoModelForCausalLM

import jetrl.runfolder as runfolder
from jetrl.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from jetrl.cli import main
from jetrl.grpo import GRPOConfig
from jetrl.policy import Policy
from jetrl.runfolder import LOCK_FILE, RunFolderInUse, lock_run_folder
from jetrl.train import TrainConfig, read_metrics, train

ROOT = Path(__file__).resolve().parents[1]


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


def ended_pid() -> int:
    "The pid of a process that has ended (and been reaped)."
    process = subprocess.Popen([sys.executable, "-c", "pass"]); process.wait()
    return process.pid


def test_a_holder_that_has_not_written_its_name_yet_is_waited_for(tmp_path, monkeypatch):
    out, ended = tmp_path / "run", ended_pid()
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": ended, "host": socket.gethostname(), "started": "earlier"}))  # the last run's
    write, taken, locks = runfolder._write_holder, threading.Event(), []
    def a_moment_later(fd):
        taken.set(); time.sleep(0.5); write(fd)
    monkeypatch.setattr(runfolder, "_write_holder", a_moment_later)
    holder = threading.Thread(target=lambda: locks.append(lock_run_folder(out)))
    holder.start(); taken.wait()
    with pytest.raises(RunFolderInUse) as error: lock_run_folder(out)          # the lock is taken, the file names `ended`
    holder.join()
    message = str(error.value)
    assert f"pid {os.getpid()}" in message and f"pid {ended}" not in message, message
    locks[0].release()


def test_a_holder_that_never_writes_its_name_is_not_named_after_an_ended_run(tmp_path, monkeypatch):
    out, ended = tmp_path / "run", ended_pid()
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": ended, "host": socket.gethostname(), "started": "earlier"}))
    monkeypatch.setattr(runfolder, "_write_holder", lambda fd: None)
    monkeypatch.setattr(runfolder, "HOLDER_WAIT_S", 0.2)
    lock = lock_run_folder(out)
    with pytest.raises(RunFolderInUse, match="has not written its name") as error: lock_run_folder(out)
    assert f"pid {ended}" not in str(error.value)
    lock.release()


HELD_REWARD = textwrap.dedent("""\
    import os, time
    from pathlib import Path
    def held(prompts, completions, trainer_state, **kwargs):
        "1 or 0; at step HOLD_AT it touches HELD, then waits for the file GO: the run stays alive while the test acts."
        if trainer_state.global_step == int(os.environ["HOLD_AT"]):
            Path(os.environ["HELD"]).touch()
            while not Path(os.environ["GO"]).exists(): time.sleep(0.05)
        return [float(i % 2) for i in range(len(completions))]
    """)


def train_command(model_dir, tmp_path, out: Path, hold_at: int, *extra) -> tuple[list[str], dict]:
    "A `jetrl train` process of 2 steps whose reward waits at step `hold_at` until tmp_path/go exists."
    (tmp_path / "held_reward.py").write_text(HELD_REWARD)
    command = [sys.executable, "-m", "jetrl.cli", "train", "--model", str(model_dir), "--strategy", "bf16", "--prompts-per-step", "2",
               "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3", "--steps", "2", "--threads", "1",
               "--reward", f"{tmp_path / 'held_reward.py'}:held", "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HOLD_AT=str(hold_at), HELD=str(tmp_path / "held"),
               GO=str(tmp_path / "go"))
    return command, env


def start(command, env) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def error_lines(err: str) -> list[str]: return [line for line in err.splitlines() if "error:" in line]


def test_two_train_commands_started_at_once_on_one_out(model_dir, tmp_path):
    out = tmp_path / "run"
    command, env = train_command(model_dir, tmp_path, out, hold_at=0)
    processes = [start(command, env), start(command, env)]
    deadline = time.time() + 300
    while all(p.poll() is None for p in processes) and time.time() < deadline: time.sleep(0.1)
    [loser] = [p for p in processes if p.poll() is not None]                     # one ended; the other still runs
    [winner] = [p for p in processes if p is not loser]
    _, err = loser.communicate()
    try:
        assert winner.poll() is None, "both ended"
        assert loser.returncode == 2 and "Traceback" not in err and len(error_lines(err)) == 1, err
        line = error_lines(err)[0]
        assert "is in use by a run that is still going" in line and f"pid {winner.pid} on host {socket.gethostname()}" in line, line
    finally: (tmp_path / "go").touch()
    _, err = winner.communicate(timeout=300)
    assert winner.returncode == 0, err[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and "config" in json.loads(lines[0]) and [json.loads(l)["step"] for l in lines[1:]] == [0, 1]


def test_resume_of_a_folder_whose_run_is_alive_is_refused_and_the_run_goes_on(model_dir, tmp_path):
    out = tmp_path / "run"
    command, env = train_command(model_dir, tmp_path, out, hold_at=1)
    running = start(command, env)
    try:
        deadline = time.time() + 300                                           # step 0 logged and saved, step 1 under way
        while not (tmp_path / "held").exists() and running.poll() is None and time.time() < deadline: time.sleep(0.1)
        assert running.poll() is None, running.communicate()[1][-3000:]
        before = snapshot(out)
        resumed = subprocess.run(command + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 2 and "Traceback" not in resumed.stderr and len(error_lines(resumed.stderr)) == 1, resumed.stderr
        assert f"pid {running.pid}" in error_lines(resumed.stderr)[0], resumed.stderr
        assert running.poll() is None and snapshot(out) == before, "the refused resume touched the running job"
    finally: (tmp_path / "go").touch()
    _, err = running.communicate(timeout=300)
    assert running.returncode == 0, err[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines[1:]] == [0, 1] and not (out / "metrics.superseded.jsonl").exists()


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
