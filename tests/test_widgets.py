"""The views: dashboard figures on recorded runs, the live dashboard's clean stop, the token viewer, the mismatch explorer."""
import math, time
import pytest
import torch
import plotly.graph_objects as go

from jetrl.grpo import GRPOConfig
from jetrl.policy import load_model_and_tokenizer
from jetrl.rollout import RolloutEngine, SamplingParams
from jetrl.tasks import ArithmeticTask
from jetrl.train import TrainConfig, train, read_metrics
from jetrl.widgets import (LiveDashboard, MismatchExplorer, SIDES, TokenViewer, dashboard_figure, explore_mismatch,
                           explorer_figure, gap_color, strategy_color, token_html, token_table, update_dashboard)

STRATEGIES = ["bf16", "fp8-rollout", "jet"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    "The models here are tiny: one thread is fastest, and several fight over a busy machine's cores (10x slower)."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_config(model_dir, strategy, steps=3):
    return TrainConfig(model=model_dir, strategy=strategy, steps=steps, prompts_per_step=2, grpo=GRPOConfig(num_generations=4),
                       max_new_tokens=8, lr=1e-3, position_bucket=4)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    "Recorded metrics of three strategies, read back from their run folders."
    out = tmp_path_factory.mktemp("runs")
    for s in STRATEGIES: train(small_config(model_dir, s), out / s)
    return {s: read_metrics(out / s)[1] for s in STRATEGIES}


def traces(fig):
    return {(t.meta["strategy"], t.meta["series"]): t for t in fig.data}


def test_dashboard_figure_on_recorded_metrics(runs):
    fig = dashboard_figure(runs)
    assert len(fig.data) == 3 * 11 and {t.name for t in fig.data} == set(STRATEGIES)
    assert [t.name for t in fig.data if t.showlegend] == STRATEGIES
    by_key = traces(fig)
    for s, steps in runs.items():
        for metric in ["reward", "accuracy", "mismatch/kl_k3", "mismatch/logp_abs_diff_mean", "drift/kl_to_prev_policy"]:
            assert list(by_key[(s, metric)].x) == [m["step"] for m in steps]
            assert list(by_key[(s, metric)].y) == [m[metric] for m in steps], (s, metric)
        assert list(by_key[(s, "mismatch/kl_k1")].y) == [abs(m["mismatch/kl_k1"]) for m in steps]
        assert by_key[(s, "time/train")].y[0] == pytest.approx(sum(m["time/train"] for m in steps) / len(steps))
        assert list(by_key[(s, "by_position")].y) == steps[-1]["mismatch/by_position"]["logp_abs_diff_mean"]
        assert {t.marker.color if t.type == "bar" else t.line.color for t in fig.data if t.name == s} == {strategy_color(s)}
    kl_axis, drift_axis = by_key[("jet", "mismatch/kl_k3")].yaxis, by_key[("jet", "drift/kl_to_prev_policy")].yaxis
    assert fig.layout[kl_axis.replace("y", "yaxis")].type == "log" and fig.layout[drift_axis.replace("y", "yaxis")].type == "log"
    assert fig.layout[by_key[("jet", "reward")].yaxis.replace("y", "yaxis")].type != "log"
    gap = {s: sum(m["mismatch/logp_abs_diff_mean"] for m in steps) for s, steps in runs.items()}
    assert gap["jet"] < gap["fp8-rollout"] / 10                                  # what the figure is there to show


def test_update_dashboard_in_place(runs):
    fig = go.FigureWidget(dashboard_figure({"jet": runs["jet"][:1]}))
    first, n = fig.data[0], len(fig.data)
    update_dashboard(fig, {"jet": runs["jet"]})
    assert fig.data[0] is first and len(fig.data) == n
    assert list(traces(fig)[("jet", "reward")].y) == [m["reward"] for m in runs["jet"]]
    update_dashboard(fig, runs)                                                     # new strategies get traces
    assert len(fig.data) == 3 * n and fig.data[0] is first


def test_token_table_and_html_escaping_and_colours(runs):
    sample = {"tokens": ["<b>", "a&b", " ", "\n"], "train_logp": [-0.5, -1.0, -2.0, -0.1], "rollout_logp": [-0.5, -1.2, -1.0, -0.1]}
    table = token_table(sample)
    assert table[1]["ratio"] == pytest.approx(math.exp(0.2)) and table[2]["abs_diff"] == pytest.approx(1.0)
    assert table[1]["p_rollout"] == pytest.approx(math.exp(-1.2))
    h = token_html(sample)
    assert "<b>" not in h and "&lt;b&gt;" in h and "a&amp;b" in h and "·" in h and "↵" in h
    assert "log p_train = -1\nlog p_rollout = -1.2" in h and "ratio p_train/p_rollout = 1.2214" in h
    assert f"background:{gap_color(1.0, 1.0)}" in h                                  # the largest gap at the dark end
    lum = []
    for g in torch.linspace(0, 1, 40).tolist():
        r, gr, b = (int(v) for v in gap_color(g, 1.0)[4:-1].split(","))
        lum.append(0.2126 * r + 0.7152 * gr + 0.0722 * b)
    assert all(a >= b for a, b in zip(lum, lum[1:])) and lum[0] > lum[-1]           # monotone: darker as |gap| grows
    real = runs["fp8-rollout"][-1]["samples"][0]
    assert token_html(real).count('class="jetrl-token"') == len(real["tokens"])


def test_live_dashboard_stop_button_stops_training_cleanly(model_dir, tmp_path):
    dashboard = LiveDashboard(min_interval=60)                                     # throttled: only stop/last-step redraws
    def click_at_step_1(metrics):
        if metrics["step"] == 1: dashboard.stop_button.click()
    config = small_config(model_dir, "fp8-rollout", steps=6)
    run = train(config, tmp_path / "run", callbacks=[click_at_step_1, dashboard.callback("fp8-rollout", config.steps)])
    assert dashboard.stopped and len(run.history) == 2
    assert [m["step"] for m in read_metrics(tmp_path / "run")[1]] == [0, 1] and (tmp_path / "run" / "checkpoint").exists()
    assert list(traces(dashboard.figure)[("fp8-rollout", "reward")].x) == [0, 1]  # drawn on the stop despite the throttle


def test_live_dashboard_background_run_and_stop(model_dir):
    dashboard = LiveDashboard(min_interval=0.1)
    thread = dashboard.run({"jet": small_config(model_dir, "jet", steps=200), "bf16": small_config(model_dir, "bf16")})
    deadline = time.time() + 20
    while len(dashboard.runs.get("jet", [])) < 1 and time.time() < deadline: time.sleep(0.01)
    dashboard.stop_button.click()
    assert dashboard.wait(20) and not thread.is_alive()
    assert 1 <= len(dashboard.runs["jet"]) < 200 and "bf16" not in dashboard.results   # the next strategy never started
    assert dashboard.status.value == "stopped"


def test_token_viewer_constructs_and_updates(runs):
    viewer = TokenViewer(runs)
    assert viewer.strategy.options == tuple(STRATEGIES) and viewer.step.value == 2
    viewer.strategy.value = "fp8-rollout"; viewer.step.value = 0; viewer.sample_index.value = 1
    assert viewer.sample() == runs["fp8-rollout"][0]["samples"][1]
    assert viewer.tokens.value == token_html(viewer.sample(), viewer.vmax_all)
    viewer.same_scale.value = False
    assert viewer.tokens.value == token_html(viewer.sample())
    with pytest.raises(ValueError, match="record_samples"): TokenViewer({"jet": []})


@pytest.fixture(scope="module")
def model_and_rollout(model_dir):
    model, tokenizer = load_model_and_tokenizer(model_dir)
    prompts = [r["prompt"] for r in ArithmeticTask(digits=2).sample(3)]
    rollout = RolloutEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=10, seed=0))
    return model, tokenizer, prompts, rollout


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "tensorwise"])
def test_explorer_jet_has_no_gap_and_common_recipe_does(model_and_rollout, recipe):
    model, tokenizer, _, rollout = model_and_rollout
    args = dict(model=model, tokenizer=tokenizer, input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                recipe=recipe, prompt_len=rollout.prompt_ids.shape[1])
    jet = explore_mismatch(**args, train_side_fp8=True, rollout_side_fp8=True)
    common = explore_mismatch(**args, train_side_fp8=False, rollout_side_fp8=True)
    assert max(jet.gaps) == 0.0 and jet.metrics["mismatch/kl_k3"] == 0.0
    assert common.metrics["mismatch/logp_abs_diff_mean"] > 1e-5 and common.metrics["mismatch/kl_k3"] > 0
    assert len(common.gaps) == int(rollout.completion_mask.sum()) == sum(common.histogram["counts"])
    fig = explorer_figure(common)
    assert list(fig.data[0].y) == common.histogram["counts"] and list(fig.data[1].x) == common.by_position["positions"]


def test_mismatch_explorer_constructs_and_updates(model_and_rollout):
    model, tokenizer, prompts, _ = model_and_rollout
    explorer = MismatchExplorer(model, tokenizer, prompts, max_new_tokens=10)
    assert explorer.result.metrics["mismatch/logp_abs_diff_mean"] > 0
    assert explorer.tokens.value.count('class="jetrl-tokens"') == len(prompts)
    explorer.sides.value = next(label for label, sides in SIDES.items() if sides == (True, True))
    assert max(explorer.result.gaps) == 0.0 and explorer.figure.data[0].y[0] == len(explorer.result.gaps)
    explorer.sides.value = next(label for label, sides in SIDES.items() if sides == (False, True))
    explorer.lm_head.value = "fp8"; explorer.weight_fmt.value = "e5m2"
    assert explorer.result.settings == dict(recipe="blockwise", train_side_fp8=False, rollout_side_fp8=True, act_fmt="e4m3",
                                            weight_fmt="e5m2", lm_head="fp8")
    assert "e5m2" in explorer.figure.layout.title.text and max(explorer.result.gaps) > 0
