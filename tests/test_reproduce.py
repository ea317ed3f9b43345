"Tests of scripts/reproduce.py: the FP4 rungs of the dose-response, the worked solutions, the report rules, pack / unpack, resume."
import io, json, math, re, sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import reproduce as R  # noqa: E402

from jetrl.tasks import ArithmeticChainTask, chain_steps_reward, format_reward, number_reward

E2M1_GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def test_e2m1_round_is_the_nearest_grid_value():
    x = torch.linspace(-7, 7, 2801)
    q = R.e2m1_round(x)
    grid = torch.cat([-E2M1_GRID, E2M1_GRID])
    assert torch.isin(q, grid).all()
    nearest_distance = (x.clamp(-6, 6)[:, None] - grid[None]).abs().min(1).values
    assert torch.allclose((x.clamp(-6, 6) - q).abs(), nearest_distance)          # nothing nearer on the grid
    assert R.e2m1_round(torch.tensor([1.75, 2.5, 5.0])).tolist() == [2.0, 2.0, 4.0]   # ties to the even mantissa


@pytest.mark.parametrize("block,pow2", [(16, False), (32, True), (0, False)])
def test_fake_quantize_fp4_error_is_bounded_by_the_group_scale(block, pow2):
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-3, 2, 64)                            # groups of very different sizes
    q = R.fake_quantize_fp4(x, block, pow2)
    b = block or 64
    amax = x.reshape(8, -1, b).abs().amax(-1, keepdim=True)
    scale = amax / R.E2M1_MAX
    if pow2: scale = torch.exp2(torch.ceil(torch.log2(scale)))
    error = (x - q).reshape(8, -1, b).abs()
    assert (error <= scale * 1.0 + 1e-12).all()                                    # half the widest spacing (2) in scaled units
    assert torch.equal(R.fake_quantize_fp4(q, block, pow2), q)                    # on the grid: unchanged


def test_fake_quantize_fp4_refuses_a_ragged_group():
    with pytest.raises(ValueError, match="multiple"):
        R.fake_quantize_fp4(torch.ones(2, 40), 16, False)


def test_worked_solution_is_correct_and_long():
    row = ArithmeticChainTask(steps=48, digits=2, operators="+-", seed=3).sample(1)[0]
    solution = R.worked_solution(row)
    lines = solution.strip().splitlines()
    assert len(lines) == 49                                                      # one line per step, then the answer
    for line in lines[:-1]:
        a, op, b, _, c = line.split()
        assert int(a) + (1 if op == "+" else -1) * int(b) == int(c)
    assert [number_reward, format_reward][0]([row["prompt"]], [solution], [row["answer"]]) == [1.0]
    assert format_reward([row["prompt"]], [solution]) == [1.0]
    assert chain_steps_reward([row["prompt"]], [solution], [row["intermediate"]]) == [1.0]


def test_the_sft_base_reads_grpo_prompts_as_it_was_trained(tmp_path, monkeypatch):
    "Token for token: GRPO's and the eval's prompts, the worked solutions and EOS are what SFT trained on."
    spec = R.SFTSpec(hidden_size=64, layers=1, heads=2, kv_heads=1, intermediate_size=128, max_positions=256,
                     chain_steps=(2, 3), steps=1, batch_size=2)
    assert R.train_base_policy(spec, tmp_path / "base", "cpu", math.inf, log=lambda *_: None)
    R.check_base_format(tmp_path / "base", spec)
    from transformers import AutoModelForCausalLM, AutoTokenizer      # what transformers alone loads: Qwen2's splitter
    monkeypatch.setattr(R, "load_model_and_tokenizer", lambda name: (AutoModelForCausalLM.from_pretrained(name),
                                                                      AutoTokenizer.from_pretrained(name)))
    with pytest.raises(RuntimeError, match="other token ids than SFT trained on"): R.check_base_format(tmp_path / "base", spec)


def test_gpu_preset_grpo_task_is_in_its_sft_mix_and_fits():
    "The GPU preset's GRPO chains are a length SFT taught, its worked solutions are long (>= 400 tokens) and fit the budget."
    from jetrl.tiny import build_tokenizer
    preset = R.PRESETS["gpu"]
    knobs, spec = dict(preset.train.task_knobs), preset.sft
    assert knobs["steps"] in spec.chain_steps and knobs["digits"] == spec.digits and knobs["operators"] == "+-"
    tokenizer = build_tokenizer([t for row in R.sft_rows(spec, 500) for t in (row["prompt"], R.worked_solution(row))])
    rows = R.eval_rows(R.replace(preset, eval_prompts=64))
    prompt = max(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows)
    worked = [len(tokenizer(R.worked_solution(r), add_special_tokens=False)["input_ids"]) + 1 for r in rows]   # + EOS
    assert 400 <= min(worked) and max(worked) <= preset.train.max_new_tokens
    assert prompt + preset.train.max_new_tokens <= spec.max_positions


def test_step_time_model_and_eval_seconds_recover_known_numbers(tmp_path):
    rows = [{"strategy": s, "completion_length_mean": x, "seconds_per_step": a + 0.002 * x}
            for s, a, xs in (("bf16", 0.5, (100, 300)), ("jet", 0.9, (50, 60)), ("tis", 0.7, (200,))) for x in xs]
    intercept, slope = R.step_time_model(rows)
    assert abs(slope - 0.002) < 1e-12 and all(abs(intercept[s] - a) < 1e-9 for s, a in (("bf16", 0.5), ("jet", 0.9), ("tis", 0.7)))
    log = tmp_path / "log.txt"
    log.write_text("sft: done\nbase policy: held-out accuracy 0.589 (256 prompts x 4 samples)\n"
                   "bf16 seed 0: 30/30 steps, 35 s this call\nbf16 seed 0: held-out accuracy 0.002\n"
                   "jet seed 0: 10/30 steps, 25 s this call\nstopped at the time budget: run again; 200 s; report: x\n")
    summary = [{"strategy": "bf16", "seed": 0, "seconds_per_step": 1.0}, {"strategy": "jet", "seed": 0, "seconds_per_step": 2.0}]
    call = R.measured_call_seconds(log, summary, sft_s=100)
    assert call["eval_s"] == (200 - 100 - 60) / 2                                          # the base's eval + one run's
    assert call["run_overhead_s"] == ((35 - 30 * 1.0) + (25 - 10 * 2.0)) / 2 and call["runs"] == 2


def test_gpu_preset_runs_whole_within_device_calls_even_at_full_length():
    """4 strategies x 2 seeds at >= 512 tokens: per-step times from the batch measured at the preset's 1024 rows (the
    reproduction in reproduce_gpu.jsonl), scaled linearly above it (an upper bound); each call holds whole runs (the first also the
    SFT and the base's eval), even at max_new_tokens; the estimate is within 10% of what that reproduction took."""
    assert len(R.PRESETS["gpu"].seeds) == 5 and set(R.PRESETS["gpu"].strategies) == {"bf16", "jet", "fp8-rollout", "fp8-rollout-tis"}
    preset = R.replace(R.PRESETS["gpu"], seeds=(0, 1))                 # the measured reproduction's two seeds
    assert preset.train.max_new_tokens >= 512
    rows = preset.train.rows_per_step
    small = R.gpu_call_estimate(R.replace(preset, train=R.replace(preset.train, prompts_per_step=16)), completion_tokens=500)
    typical = R.gpu_call_estimate(preset, completion_tokens=500)
    double = R.gpu_call_estimate(R.replace(preset, train=R.replace(preset.train, prompts_per_step=2 * preset.train.prompts_per_step)),
                                 completion_tokens=500)
    assert (small["measured_rows"], typical["measured_rows"], typical["rows_factor"]) == (128, rows, 1.0)
    measured = [json.loads(line) for line in (R.GPU_RESULTS / "reproduce_gpu" / "summary.jsonl").read_text().splitlines()]
    for s in preset.strategies:
        seconds = [r["seconds_per_step"] for r in measured if r["strategy"] == s]
        assert abs(typical["seconds_per_step"][s] - sum(seconds) / len(seconds)) < 0.05          # ~501 tokens measured
        assert abs(double["seconds_per_step"][s] - 2 * typical["seconds_per_step"][s]) < 0.02     # linear above it
        assert small["seconds_per_step"][s] < typical["seconds_per_step"][s] / 2                  # 128 rows: a batch measured apart
    assert abs(typical["sft_s"] - 123.0 * preset.sft.steps / 1500) < 0.1                  # its sft.json: 1500 x 32 rows in 123.0 s
    worst = R.gpu_call_estimate(preset, completion_tokens=preset.train.max_new_tokens)
    first_call = R.STARTUP_RESERVE_S + worst["sft_s"] + worst["eval_s_each"] + worst["run_s"][preset.strategies[0]]
    assert first_call <= R.DEVICE_CALL_S and max(worst["run_s"].values()) + R.STARTUP_RESERVE_S <= R.TARGET_CALL_S
    runs_s = len(preset.seeds) * sum(typical["run_s"].values())
    assert abs(typical["total_s"] - (R.STARTUP_RESERVE_S + typical["sft_s"] + typical["eval_s_each"] + runs_s)) < 0.5
    assert typical["total_s"] <= typical["calls"] * R.TARGET_CALL_S <= typical["total_s"] + len(preset.seeds) * len(preset.strategies) * R.TARGET_CALL_S
    assert small["calls"] <= typical["calls"] <= worst["calls"]
    logs = sorted((R.GPU_RESULTS / "reproduce_gpu").glob("log_*.txt"))      # its three device runs: "done; N s; report"
    took = sum(int(re.findall(r"; (\d+) s; report", log.read_text())[-1]) for log in logs)
    assert len(logs) == 3 and took == 267 + 393 + 519
    assert abs(typical["total_s"] - took) < 0.10 * took


def test_a_smoke_reproduction_runs_every_strategy_alike_and_reports(tmp_path):
    preset = R.replace(R.PRESETS["smoke"], train=R.replace(R.PRESETS["smoke"].train, steps=1), eval_prompts=4)
    assert R.run_all(preset, tmp_path / "out", "cpu", math.inf, log=lambda *_: None)
    logged = {s: R.read_metrics(R.run_dir(tmp_path / "out", s, 0)) for s in preset.strategies}
    configs = [{k: v for k, v in config.items() if k != "strategy"} for config, _ in logged.values()]
    assert all(c == configs[0] for c in configs)                                  # one config but the strategy name
    prompts = [[sample["prompt"] for sample in history[0]["samples"]] for _, history in logged.values()]
    assert all(p == prompts[0] for p in prompts)                                  # the same prompts
    results = tmp_path / "results.jsonl"
    table, rows = R.write_report(preset, tmp_path / "out", "cmd", results)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["strategy"], r["seed"]) for r in lines] == [(s, 0) for s in preset.strategies]
    assert all(set(R.RESULT_KEYS) <= set(r) and r["model_params"] > 3_000_000 for r in lines)
    assert lines[0]["logp_abs_diff_mean"] < 1e-5 < lines[1]["logp_abs_diff_mean"]   # bf16, then fp8-rollout
    assert json.loads((tmp_path / "results_curves.json").read_text()).keys() == {"bf16_seed0", "fp8-rollout_seed0"}
    assert (tmp_path / "out" / "report.html").stat().st_size > 0 and "| `fp8-rollout` |" in table


def test_a_budget_stopped_set_without_plotly_still_writes_its_finished_runs(tmp_path, monkeypatch):
    "The GPU machine has no plotly and a call may stop at the time budget: the numbers of finished runs come back anyway."
    preset = R.replace(R.PRESETS["smoke"], train=R.replace(R.PRESETS["smoke"].train, steps=1), eval_prompts=4)
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    assert R.run_all(R.replace(preset, strategies=("bf16",)), out, "cpu", math.inf, log=lambda *_: None)  # fp8-rollout never ran
    unfinished = R.run_dir(out, "fp8-rollout", 0)
    unfinished.mkdir(parents=True)                                    # a run cut after its first step: metrics, no done.json
    (unfinished / "metrics.jsonl").write_text((R.run_dir(out, "bf16", 0) / "metrics.jsonl").read_text())
    monkeypatch.setitem(sys.modules, "plotly", None)                 # `import plotly...` now raises ImportError
    monkeypatch.setitem(sys.modules, "plotly.subplots", None)
    said = []
    table, rows = R.write_report(preset, out, "cmd", results, log=said.append)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["strategy"], r["seed"], r["complete"]) for r in lines] == [("bf16", 0, False)]   # finished runs only
    assert lines[0]["eval_accuracy_after"] is not None and set(R.RESULT_KEYS) <= set(lines[0])
    assert lines[0]["software"]["torch"] == torch.__version__                    # what the numbers ran on, besides the commit
    assert [r["strategy"] for r in rows] == ["bf16", "fp8-rollout"] and "| `fp8-rollout` |" in table   # the table shows both
    assert len((out / "summary.jsonl").read_text().splitlines()) == 2 and "Incomplete: 1 of 2" in (out / "table.md").read_text()
    assert "plotly" in said[0] and "<pre>" in (out / "report.html").read_text()
    assert json.loads((tmp_path / "results_curves.json").read_text()).keys() == {"bf16_seed0"}


def test_a_run_that_fails_keeps_the_finished_runs_rows(tmp_path, monkeypatch, capsys):
    "A later run's error (on a GPU: CUDA out of memory) still writes the finished runs' rows, and says how to go on."
    real_train = R.train
    def train_then_fail(config, *args, **kwargs):
        if config.strategy == "fp8-rollout": raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 286.00 MiB.")
        return real_train(config, *args, **kwargs)
    monkeypatch.setattr(R, "train", train_then_fail)
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    assert R.main(["--preset", "smoke", "--steps", "1", "--out", str(out), "--results", str(results)]) == 2
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["strategy"], r["seed"]) for r in rows] == [("bf16", 0)] and rows[0]["eval_accuracy_after"] is not None
    err = capsys.readouterr().err
    assert "CUDA out of memory" in err and f"the finished runs are in {results}" in err and "run the same command again" in err


def test_fp4_rollout_policy_quantizes_only_the_rollout_side():
    policy = R.build_policy("rollout-nvfp4", "jetrl-tiny", "cpu")
    rollout_linears = [m for m in policy.rollout_model.modules() if isinstance(m, R.FP4RolloutLinear)]
    assert len(rollout_linears) == 4 * 7                                          # q k v o gate up down, 4 layers
    ids = policy.tokenizer(["What is 3 + 4? Put the final answer in <answer></answer>.\nAnswer: <answer>7"],
                           return_tensors="pt")["input_ids"]
    with torch.no_grad():
        train_logits, rollout_logits = policy.model(ids).logits, policy.rollout_model(ids).logits
        fp8 = R.build_policy("fp8-rollout", "jetrl-tiny", "cpu")
        fp8_gap = (fp8.model(ids).logits - fp8.rollout_model(ids).logits).abs().mean()
    fp4_gap = (train_logits - rollout_logits).abs().mean()
    assert torch.equal(train_logits, fp8.model(ids).logits)                      # the training side is the same
    assert fp4_gap > fp8_gap > 0 and fp4_gap < 1.0                                # coarser than FP8, still a model


def _history(accuracies, loss=0.1):
    return [{"step": i, "accuracy": a, "loss": loss, "grad_norm": 1.0, "mismatch/kl_k3": 1e-4, "mismatch/logp_abs_diff_mean": 1e-2,
             "mismatch/is_ratio_mean": 1.0, "mismatch/is_ratio_min": 0.9, "mismatch/is_ratio_max": 1.1, "mismatch/ess": 0.99,
             "mismatch/tis_clip_frac": 0.0, "mismatch/token_mult_prob_error": 1.01, "completions/mean_length": 10, "time/step": 1.0}
            for i, a in enumerate(accuracies)]


def _saved_run(strategy, seed, n_steps=6, gap=1e-3):
    "A finished run as the results file and its curves hold it: |dlogp| `gap` x (1 + position / 64), constant in time."
    history = _history([0.2 + 0.05 * k for k in range(n_steps)])
    for m in history:
        m["reward"], m["mismatch/logp_abs_diff_mean"] = m["accuracy"], gap
        m["mismatch/by_position"] = {"positions": [0, 64, 128], "tokens": [10, 10, 5],
                                     "logp_abs_diff_mean": [gap * (1 + q / 64) for q in (0, 64, 128)]}
    row = R.run_summary(R.PRESETS["smoke"], strategy, seed, history, 3, "cmd", (0.2, 0.3 + 0.01 * seed))
    return history, row | {"complete": True}


def test_report_figure_is_drawn_from_saved_curves(tmp_path):
    "Six traces per strategy from the curves() format alone; the position panel is the seeds' mean of the last span."
    pytest.importorskip("plotly")
    runs = {(s, seed): _saved_run(s, seed, gap=g * (1 + seed)) for s, g in (("bf16", 0.0), ("fp8-rollout", 1e-3)) for seed in (0, 1)}
    saved = json.loads(json.dumps(R.curves({k: h for k, (h, _) in runs.items()})))      # through JSON, as committed
    fig = R.report_figure(saved, [row for _, row in runs.values()], ("bf16", "fp8-rollout"))
    assert [t.name for t in fig.data] == ["bf16"] * 6 + ["fp8-rollout"] * 6
    by_panel = {(t.name, t.xaxis): t for t in fig.data}
    position = by_panel[("fp8-rollout", "x3")]
    assert list(position.x) == [0, 64, 128] and list(position.y) == pytest.approx([1.5e-3 * (1 + q / 64) for q in (0, 64, 128)])
    assert list(by_panel[("fp8-rollout", "x")].y) == pytest.approx([0.2 + 0.05 * k for k in range(6)])   # accuracy per step
    assert list(by_panel[("bf16", "x6")].y) == pytest.approx([0.1, 0.11])                                 # one dot per seed
    assert list(by_panel[("bf16", "x6")].x) == pytest.approx([1e-4] * 2)           # no mismatch: a decade left of the least
    assert list(by_panel[("fp8-rollout", "x6")].x) == pytest.approx([1e-3, 2e-3])


def test_report_from_results_redraws_and_names_a_missing_curves_file(tmp_path):
    pytest.importorskip("plotly")
    runs = {(s, 0): _saved_run(s, 0) for s in ("bf16", "fp8-rollout")}
    results = tmp_path / "reproduce_x.jsonl"
    results.write_text("".join(json.dumps({k: row[k] for k in R.RESULT_KEYS}) + "\n" for _, row in runs.values()))
    with pytest.raises(FileNotFoundError, match="reproduce_x_curves.json is missing"):
        R.report_from_results(results, tmp_path / "out")
    assert not (tmp_path / "out").exists()                                          # nothing written before the check
    R.curves_file(results).write_text(json.dumps(R.curves({k: h for k, (h, _) in runs.items()})))
    table = R.report_from_results(results, tmp_path / "out", plotlyjs="cdn")
    html = (tmp_path / "out" / "report.html").read_text()
    assert "| `fp8-rollout` |" in table and table in (tmp_path / "out" / "table.md").read_text()
    assert "plotly" in html and '"name":"fp8-rollout"' in html.replace(" ", "")
    assert R.main(["--report-from", str(tmp_path / "nothing.jsonl"), "--out", str(tmp_path / "o2")]) == 2


def test_diverged_rule():
    preset = R.replace(R.PRESETS["smoke"], window=2)
    row = lambda h: R.run_summary(preset, "bf16", 0, h, 3, "cmd")
    assert not row(_history([0.5, 0.5, 0.45, 0.45]))["diverged"]                 # a drop of 0.05 < 0.10
    assert row(_history([0.5, 0.5, 0.35, 0.35]))["diverged"]                     # a drop of 0.15
    assert row(_history([0.5, 0.5, 0.6, 0.6], loss=math.nan))["diverged"]       # a non-finite loss
    r = row(_history([0.2, 0.4, 0.6, 0.8]))
    assert (r["accuracy_first"], r["accuracy_last"]) == (pytest.approx(0.3), pytest.approx(0.7))
    assert set(R.RESULT_KEYS) <= set(r)


def test_pack_unpack_round_trip_and_budget(tmp_path):
    out = tmp_path / "out"
    (out / "runs" / "bf16_seed0" / "checkpoint").mkdir(parents=True)
    (out / "runs" / "bf16_seed0" / "metrics.jsonl").write_text('{"config": {}}\n')
    big = torch.randn(3 * 2**20).numpy().tobytes()                               # 12 MiB that gzip cannot shrink
    (out / "runs" / "bf16_seed0" / "checkpoint" / "model.safetensors").write_bytes(big)
    parts = R.pack(out, tmp_path / "packed", limit=64 * R.MiB)
    assert all(p.stat().st_size <= R.PART_BYTES for p in parts)
    R.unpack(tmp_path / "packed", tmp_path / "back")
    assert (tmp_path / "back" / "runs" / "bf16_seed0" / "checkpoint" / "model.safetensors").read_bytes() == big
    messages = []                                                                 # over the limit: the unfinished run stays behind,
    parts = R.pack(out, tmp_path / "small", limit=4 * R.MiB, log=messages.append)  # its metrics too (without a checkpoint they refuse to resume)
    assert "restart from step 0" in messages[0] and sum(p.stat().st_size for p in parts) < R.MiB
    R.unpack(tmp_path / "small", tmp_path / "back_small")
    assert (tmp_path / "back_small" / "runs").is_dir() and not (tmp_path / "back_small" / "runs" / "bf16_seed0").exists()
    (out / "runs" / "bf16_seed0" / "done.json").write_text("{}")                 # a finished run's files are never left out
    with pytest.raises(RuntimeError, match="largest files"):
        R.pack(out, tmp_path / "small", limit=4 * R.MiB)
    assert (out / "runs" / "bf16_seed0" / "checkpoint" / "model.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="partNN"):
        R.unpack(tmp_path / "nothing", tmp_path / "x")


@pytest.mark.slow
def test_a_run_stopped_by_the_time_budget_resumes_to_the_same_metrics(tmp_path, monkeypatch):
    import time, types
    preset = R.replace(R.PRESETS["smoke"], strategies=("fp8-rollout",), train=R.replace(R.PRESETS["smoke"].train, steps=3))
    assert R.run_all(preset, tmp_path / "whole", "cpu", math.inf)
    clock = iter([0.0, 0.0] + [1e9] * 100)                   # the budget check, the start, then past the deadline
    monkeypatch.setattr(R, "time", types.SimpleNamespace(time=lambda: next(clock), perf_counter=time.perf_counter))
    assert not R.run_all(preset, tmp_path / "cut", "cpu", deadline=100.0)
    run = R.run_dir(tmp_path / "cut", "fp8-rollout", 0)
    assert len(R.read_metrics(run)[1]) == 1 and (run / "checkpoint").exists()   # stopped after one step, saved
    monkeypatch.setattr(R, "time", time)
    assert R.run_all(preset, tmp_path / "cut", "cpu", math.inf)                 # the second invocation finishes it
    whole = R.read_metrics(R.run_dir(tmp_path / "whole", "fp8-rollout", 0))[1]
    cut = R.read_metrics(run)[1]
    keys = ("accuracy", "reward", "mismatch/kl_k3", "mismatch/logp_abs_diff_mean", "loss")
    assert [[m[k] for k in keys] for m in whole] == [[m[k] for k in keys] for m in cut]


# ---------------------------------------------------------------- the carried base
SMOKE_SFT = R.PRESETS["smoke-sft"]
REPRODUCE = str(Path(R.__file__))


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory) -> Path:
    "The smoke-sft preset's base, built here (deterministic SFT) and saved as parts with its base.json."
    folder = tmp_path_factory.mktemp("base")
    R.build_base(SMOKE_SFT, folder / "scratch", "cpu", math.inf, folder / "saved", "cmd", log=lambda *_: None)
    return folder / "saved"


def test_the_deterministic_sft_gives_one_fingerprint_in_another_process(saved_base, tmp_path):
    """The base of a second process, built from scratch, has the same bits (fingerprint) as this process's; a wrong
    --expect-fingerprint is one error line; the fingerprint is of the weights, so any weight changed changes it."""
    import subprocess
    record = json.loads((saved_base / "base.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{16}", record["base_fingerprint"]) and record["sft"]["deterministic"] is True
    env = {"PYTHONPATH": str(Path(R.__file__).parents[1]), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, REPRODUCE, "--preset", "smoke-sft", "--device", "cpu", "--base-only", "--base",
                           str(tmp_path / "again"), "--out", str(tmp_path / "scratch"), "--expect-fingerprint", "0" * 16],
                          capture_output=True, text=True, env=env, timeout=300)
    again = json.loads((tmp_path / "again" / "base.json").read_text())["base_fingerprint"]
    assert again == record["base_fingerprint"]                                   # another process: the same bits
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and f"fingerprint {again}, not {'0' * 16}" in done.stderr
    from safetensors.torch import load_file, save_file
    weights = load_file(tmp_path / "scratch" / "base" / "model.safetensors")
    name = sorted(weights)[0]; weights[name][0] += 1e-3
    save_file(weights, tmp_path / "scratch" / "base" / "model.safetensors", metadata={"format": "pt"})
    assert R.base_fingerprint(str(tmp_path / "scratch" / "base")) != again


def test_a_carried_base_is_restored_checked_and_named_in_every_row(saved_base, tmp_path, capsys):
    """--base restores OUT/base from the parts (fingerprint checked), every results row names it, --pack leaves the base out
    (the next call restores it), and an OUT whose runs started from another base is refused in one line."""
    record = json.loads((saved_base / "base.json").read_text())
    out, results = tmp_path / "out", tmp_path / "results.jsonl"
    args = ["--preset", "smoke-sft", "--device", "cpu", "--seeds", "0", "--steps", "1", "--base", str(saved_base),
            "--out", str(out), "--results", str(results), "--pack", str(tmp_path / "packed")]
    assert R.main(args) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["strategy"] for r in rows] == ["bf16", "jet"] and {r["base_fingerprint"] for r in rows} == {record["base_fingerprint"]}
    assert json.loads((out / "eval_base.json").read_text()) == record["eval_base"]        # the base's eval comes with it
    import tarfile
    packed = b"".join(p.read_bytes() for p in sorted((tmp_path / "packed").glob("reproduce.tgz.part*")))
    names = tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz").getnames()
    assert "./base.json" in names and not any(n.startswith("./base/") for n in names)
    assert R.main(["--preset", "smoke-sft", "--device", "cpu", "--seeds", "0", "--steps", "1", "--base", str(saved_base),
                   "--out", str(tmp_path / "next"), "--unpack", str(tmp_path / "packed")]) == 0     # a next call: restored again
    other = R.replace(SMOKE_SFT, sft=R.replace(SMOKE_SFT.sft, seed=1))
    R.build_base(other, tmp_path / "scratch", "cpu", math.inf, tmp_path / "other", "cmd", log=lambda *_: None)
    capsys.readouterr()
    assert R.main([*args[:-2], "--base", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds runs of base {record['base_fingerprint']}" in err and "another --out" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "base.json").write_text(json.dumps(record | {"base_fingerprint": "f" * 16}))
    for part in saved_base.glob("base.tgz.part*"): (tmp_path / "bad" / part.name).write_bytes(part.read_bytes())
    with pytest.raises(ValueError, match="not ffff"):
        R.use_base(tmp_path / "bad", tmp_path / "fresh", log=lambda *_: None)              # parts that are not the named base
    with pytest.raises(ValueError, match="built for the smoke-sft preset, not gpu"):
        R.run_all(R.PRESETS["gpu"], tmp_path / "g", "cpu", math.inf, base=saved_base, log=lambda *_: None)
    with pytest.raises(ValueError, match="--base is for the presets that train their base"):
        R.run_all(R.PRESETS["smoke"], tmp_path / "s", "cpu", math.inf, base=saved_base)
    with pytest.raises(SystemExit):
        R.main(["--preset", "smoke-sft", "--base-only", "--out", str(tmp_path / "x")])          # --base-only needs --base DIR
    assert "--base-only needs --base DIR" in capsys.readouterr().err


def test_a_base_below_the_presets_floor_is_refused_and_not_saved(tmp_path):
    """--base-only measures the base's held-out accuracy and refuses to save a base below the preset's floor (GRPO from
    it sees a reward in too few groups to learn), naming the accuracy, the floor and the options that change the SFT."""
    assert R.PRESETS["gpu"].min_base_accuracy == R.GPU_MIN_BASE_ACCURACY == 0.1
    assert R.PRESETS["gpu-long"].min_base_accuracy == 0.1
    strict = R.replace(SMOKE_SFT, min_base_accuracy=1.01)               # no base reaches it
    with pytest.raises(RuntimeError) as refused:
        R.build_base(strict, tmp_path / "scratch", "cpu", math.inf, tmp_path / "saved", "cmd", log=lambda *_: None)
    accuracy = json.loads((tmp_path / "scratch" / "eval_base.json").read_text())["accuracy"]
    assert f"solves {accuracy:.3f} of the held-out prompts, below the smoke-sft preset's floor of 1.01" in str(refused.value)
    assert "--sft-steps, now 3" in str(refused.value) and "--sft-seed, now 0" in str(refused.value)
    assert "in a fresh --out" in str(refused.value)
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())
    assert (tmp_path / "scratch" / "base" / "config.json").exists()    # the SFT's work is kept in OUT
    longer = R.replace(strict, sft=R.replace(strict.sft, steps=4))      # the same OUT, asked for another SFT: refused
    with pytest.raises(ValueError, match="SFT'd with other settings \\(steps 3 there, 4 now\\).*another --out"):
        R.build_base(longer, tmp_path / "scratch", "cpu", math.inf, tmp_path / "saved", "cmd", log=lambda *_: None)
    R.build_base(SMOKE_SFT, tmp_path / "ok", "cpu", math.inf, tmp_path / "saved_ok", "cmd", log=lambda *_: None)
    with pytest.raises(RuntimeError, match="no run was started"):     # a saved base below the floor: no run starts on it
        R.run_all(strict, tmp_path / "runs", "cpu", math.inf, base=tmp_path / "saved_ok", log=lambda *_: None)
    assert not (tmp_path / "runs" / "runs").exists()


def test_sft_steps_and_seed_options_change_the_base_sft_only_where_there_is_one():
    args = R.parse_args(["--preset", "gpu", "--out", "x", "--sft-steps", "2500", "--sft-seed", "3"])
    preset = R.preset_from_args(args)
    assert (preset.sft.steps, preset.sft.seed, preset.sft.deterministic) == (2500, 3, True)
    assert preset.train == R.PRESETS["gpu"].train and R.PRESETS["gpu"].sft.steps == R.GPU_SFT_STEPS
    with pytest.raises(ValueError, match="--sft-steps must be at least 1, not 0"):
        R.preset_from_args(R.parse_args(["--preset", "gpu", "--out", "x", "--sft-steps", "0"]))
    with pytest.raises(ValueError, match="smoke starts from"):
        R.preset_from_args(R.parse_args(["--preset", "smoke", "--out", "x", "--sft-seed", "1"]))
    with pytest.raises(SystemExit):                                    # runs on a saved base: its SFT is not this command's
        R.parse_args(["--preset", "gpu", "--out", "x", "--base", "b", "--sft-steps", "2500"])


def test_results_rows_carry_the_diagnostics_and_the_report_draws_them(tmp_path):
    "Each row: clipping by advantage sign (loss and rollout side), entropy, gradient norm, KL to the start, |dlogp| by position."
    preset = R.replace(R.PRESETS["smoke"], eval_prompts=4)
    assert R.run_all(preset, tmp_path / "out", "cpu", math.inf, log=lambda *_: None)
    _, rows = R.write_report(preset, tmp_path / "out", "cmd", tmp_path / "results.jsonl")
    from jetrl.tiny import TINY_DIR
    for r in rows:
        assert r["base_fingerprint"] == R.base_fingerprint("jetrl-tiny") == R.base_fingerprint(str(TINY_DIR))
        for key in ("clip_frac_neg_adv", "clip_frac_pos_adv", "rollout_clip_frac_neg_adv", "rollout_clip_frac_pos_adv",
                    "entropy_last", "grad_norm_mean", "grad_norm_max", "kl_to_start_last"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
        profile = r["logp_abs_diff_by_position"]
        assert profile["positions"][0] == 0 and len(profile["positions"]) == len(profile["logp_abs_diff_mean"]) >= 1
        assert r["eval_seconds"] > 0 and r["overhead_s"] >= 0 and r["rows_per_step"] == 8
    fp8 = next(r for r in rows if r["strategy"] == "fp8-rollout")
    assert max(fp8["logp_abs_diff_by_position"]["logp_abs_diff_mean"]) > 1e-5              # the FP8 rollout's gap, by position
    saved = json.loads((tmp_path / "results_curves.json").read_text())
    assert all(len(c["drift/kl_to_start"]) == preset.train.steps and c["drift/kl_to_start"][0] == 0.0 for c in saved.values())
    fig = R.diagnostics_figure(saved, preset.strategies)
    assert len(fig.layout.annotations) == 6 and {t.name for t in fig.data} == set(preset.strategies)
    assert R.diagnostics_figure({k: {kk: v for kk, v in c.items() if kk not in R.DIAGNOSTIC_KEYS} for k, c in saved.items()},
                                preset.strategies) is None                                 # curves saved before them: no figure


def test_deterministic_algorithms_is_on_inside_restored_after_and_names_a_missing_kernel():
    assert not torch.are_deterministic_algorithms_enabled()
    with R.deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cuda.matmul.allow_tf32
    assert not torch.are_deterministic_algorithms_enabled() and R.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with pytest.raises(RuntimeError, match=r"^the deterministic SFT met an op .*--nondeterministic-sft") as e:
        with R.deterministic_algorithms(): raise RuntimeError("foo_cuda does not have a deterministic implementation\nmore")
    assert "\n" not in str(e.value) and not torch.are_deterministic_algorithms_enabled()
    with R.deterministic_algorithms(False): assert not torch.are_deterministic_algorithms_enabled()


def test_plan_lists_the_device_calls_from_measured_rows(tmp_path):
    """--plan --measured FILE: per-step, eval and run seconds from the file's rows; the calls after the base's hold whole
    runs in run_all's order within one call's time budget; a run longer than a call is refused."""
    preset = R.PRESETS["gpu"]
    rows = [{"strategy": s, "seed": k, "preset": "gpu", "seconds_per_step": 1.0 + i, "completion_length_mean": 500.0,
             "rows_per_step": 1024, "overhead_s": 5.0, "eval_seconds": 4.0} for i, s in enumerate(preset.strategies) for k in (0, 1)]
    est = R.gpu_call_estimate(preset, completion_tokens=500.0, measured_rows=rows)
    assert est["seconds_per_step"] == {s: 1.0 + i for i, s in enumerate(preset.strategies)}
    assert est["run_s"] == {s: 5.0 + 4.0 + preset.train.steps * (1.0 + i) for i, s in enumerate(preset.strategies)}
    calls = R.parity_calls(preset, est)
    assert [r for c in calls for r in c["runs"]] == [f"{s} seed {k}" for k in preset.seeds for s in preset.strategies]
    room = R.PARITY_TIME_BUDGET_S - R.RESTORE_RESERVE_S
    for c in calls:
        work = sum(est["run_s"][r.split(" seed ")[0]] for r in c["runs"])
        assert work <= room and c["seconds"] == pytest.approx(R.STARTUP_RESERVE_S + R.RESTORE_RESERVE_S + work + R.REPORT_RESERVE_S)
        assert c["seconds"] <= R.DEVICE_CALL_S
    for a, b in zip(calls, calls[1:]):                                  # a call ends only when the next run does not fit
        assert sum(est["run_s"][r.split(" seed ")[0]] for r in a["runs"]) + est["run_s"][b["runs"][0].split(" seed ")[0]] > room
    with pytest.raises(ValueError, match="cannot be carried"):
        R.parity_calls(preset, est | {"run_s": dict.fromkeys(preset.strategies, 1000.0)})
    measured = tmp_path / "measured.jsonl"
    measured.write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = R.plan(preset, "cpu", measured=measured, log=lambda *_: None)
    assert info["h200_call"]["seconds_per_step"]["jet"] == pytest.approx(2.0, abs=0.01) and str(measured) in info["h200_call"]["source"]
    assert info["device_calls"][0]["what"].startswith("the base") and len(info["device_calls"]) == 1 + len(calls)
    assert info["carried"]["total_MiB"] <= info["carried"]["limit_MiB"]
    assert R.main(["--preset", "gpu", "--plan", "--measured", str(tmp_path / "none.jsonl")]) == 2
    assert R.measured_on(None) == "H200 (the committed measurements)"
    assert R.measured_on([{"device_name": "NVIDIA H100 80GB HBM3"}, {}]).startswith("NVIDIA H100 80GB HBM3 for the GRPO steps")


def test_the_long_preset_writes_over_2048_tokens_and_every_run_fits_a_call():
    "gpu-long: worked solutions of >= 2,048 tokens on average, under its limit; each run and each base build fits one call."
    preset = R.PRESETS["gpu-long"]
    assert set(preset.strategies) == {"bf16", "jet", "fp8-rollout"} and len(preset.seeds) >= 3
    est = R.gpu_call_estimate(preset)
    assert 2048 <= est["completion_tokens"] and est["completion_tokens"] * 1.1 < preset.train.max_new_tokens
    assert all(c["seconds"] <= R.DEVICE_CALL_S for c in R.parity_calls(preset, est) + R.base_calls(est))
    assert est["sft_s"] > R.gpu_call_estimate(R.PRESETS["gpu"], completion_tokens=500)["sft_s"]   # longer sequences: a longer SFT
    assert R.carried_sizes(preset, est["completion_tokens"])["total_MiB"] <= 64


def test_the_fp8_kv_strategy_runs_on_the_gpu_base():
    "jet-fp8kv is a strategy of the runner: two seeds of it on the gpu preset's base pair with that preset's bf16 and jet."
    args = R.parse_args(["--preset", "gpu", "--strategies", "jet-fp8kv", "--seeds", "0,1", "--out", "x"])
    preset = R.preset_from_args(args)
    assert preset.strategies == ("jet-fp8kv",) and preset.seeds == (0, 1) and preset.sft == R.PRESETS["gpu"].sft
    assert R.build_policy("jet-fp8kv", "jetrl-tiny", "cpu").spec.kv_fp8 and "jet-fp8kv" in R.DESCRIPTIONS


def test_a_run_that_cannot_fit_a_call_is_refused_not_started_again_and_again(tmp_path):
    """expected_run_seconds: finished runs (steps x s/step, their overhead and eval), else the s/step a cut run measured
    (OUT/step_seconds.json, which --pack carries), else the plan's prior. A run expected to outlast a call's whole budget
    is one error, where it would otherwise be started and cut in every call."""
    out = tmp_path / "out"
    out.mkdir()
    assert R.expected_run_seconds(out, "jet", 30, prior={"bf16": 100.0, "jet": 120.0}) == 120.0
    assert R.expected_run_seconds(out, "fp8-rollout", 30, prior={"bf16": 100.0, "jet": 120.0}) == 120.0   # the largest
    R.record_step_seconds(out, "jet", 20.0)
    assert R.expected_run_seconds(out, "jet", 30, prior={"jet": 120.0}) == 600.0 == R.expected_run_seconds(out, "bf16", 30)
    finished = R.run_dir(out, "bf16", 0)
    finished.mkdir(parents=True)
    (finished / "metrics.jsonl").write_text(json.dumps({"config": {}}) + "\n" + "".join(json.dumps({"step": i, "time/step": 2.0}) + "\n" for i in range(3)))
    (finished / "done.json").write_text(json.dumps({"overhead_s": 5.0, "eval_seconds": 4.0}))
    assert R.expected_run_seconds(out, "bf16", 30) == 30 * 2.0 + 5.0 + 4.0
    smoke = R.replace(R.PRESETS["smoke"], strategies=("jet",), eval_prompts=0)
    with pytest.raises(RuntimeError, match=r"jet run takes about 60 s, more than a call's whole --time-budget \(50 s\)"):
        R.run_all(R.replace(smoke, train=R.replace(smoke.train, steps=3)), out, "cpu", math.inf, log=lambda *_: None, budget_s=50)
    assert not R.run_dir(out, "jet", 0).exists()                                # nothing started


def test_results_from_several_outs_are_merged_not_overwritten(tmp_path):
    """Two reproduce calls with their own OUT folders and one --results file (as the README's commands run them): the
    second keeps the first's rows and curves, a rerun of the same run replaces its row, and a damaged file is refused
    before anything is written."""
    results = tmp_path / "reproduce_gpu_parity.jsonl"
    row = lambda s, seed, acc: {"preset": "gpu", "strategy": s, "seed": seed, "base_fingerprint": "b", "eval_accuracy_after": acc}
    R.merge_results(results, [row("bf16", 0, 0.8), row("jet", 0, 0.8)], {"bf16_seed0": {"a": 1}, "jet_seed0": {"a": 2}})
    R.merge_results(results, [row("bf16", 4, 0.9), row("jet", 0, 0.7)], {"bf16_seed4": {"a": 3}, "jet_seed0": {"a": 4}})
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["strategy"], r["seed"], r["eval_accuracy_after"]) for r in rows] == [("bf16", 0, 0.8), ("bf16", 4, 0.9), ("jet", 0, 0.7)]
    assert json.loads(R.curves_file(results).read_text()) == {"bf16_seed0": {"a": 1}, "jet_seed0": {"a": 4}, "bf16_seed4": {"a": 3}}
    results.write_text(results.read_text() + "{cut short\n")
    before = results.read_text()
    with pytest.raises(ValueError, match="line 4, is not JSON"):
        R.merge_results(results, [row("jet", 1, 0.8)], {"jet_seed1": {}})
    assert results.read_text() == before and "jet_seed1" not in R.curves_file(results).read_text()
    results.write_text(before.splitlines(keepends=True)[0]); R.curves_file(results).write_text("{cut")
    with pytest.raises(ValueError, match="_curves.json is not JSON"):
        R.merge_results(results, [row("jet", 1, 0.8)], {"jet_seed1": {}})
    assert len(results.read_text().splitlines()) == 1                              # nothing written
