"""Does `jet` learn as well as `bf16`? Seeds pooled with confidence intervals, from reproduce.py's results files.

    python scripts/learning_parity.py benchmarks/results/reproduce_gpu.jsonl [more.jsonl ...] \\
        --out benchmarks/results/learning_parity_gpu.jsonl [--figure DIR]

Each input row is one finished (strategy, seed) run of `scripts/reproduce.py`. The output holds one row per run
(the held-out accuracy before and after, the diagnostics) and one summary row per (preset, strategy):

- `gain_mean`, `gain_ci95`: the held-out gain (after - before) over seeds, with its 95% confidence interval
  (Student's t with n - 1 degrees of freedom: the seeds are few, and their spread is estimated from them);
- `diff_vs_bf16_mean`, `diff_vs_bf16_ci95`: the gain minus `bf16`'s gain *of the same seed* (a paired difference:
  both runs start from the same base, sample the same prompts and differ in the strategy alone), with its interval.

An interval that excludes 0 is a difference the seeds can see; one that holds 0 is not evidence of parity either,
only of a difference smaller than the interval's half-width.
"""
from __future__ import annotations

import argparse, json, math, sys
from pathlib import Path

# Student's t quantile 0.975 by degrees of freedom (1..30): the 95% two-sided interval's multiplier
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
Z975 = 1.960           # the normal quantile, for more than 30 degrees of freedom

RUN_FIELDS = ("preset", "strategy", "seed", "completion_tokens_mean", "acc_before", "acc_after", "gain", "diverged",
              "clip_frac_pos_adv", "clip_frac_neg_adv", "entropy_last", "grad_norm_mean", "logp_abs_diff_mean",
              "date", "git_sha", "command")

def t_quantile(dof: int) -> float:
    if dof < 1: raise ValueError(f"an interval needs at least two values (degrees of freedom >= 1), got {dof}")
    return T975[dof - 1] if dof <= len(T975) else Z975

def mean_ci95(values: list[float]) -> tuple[float, list[float] | None]:
    "The mean and its 95% t-interval [low, high] (None with fewer than two values)."
    n = len(values)
    if n == 0: return math.nan, None
    mean = sum(values) / n
    if n < 2: return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return mean, [mean - half, mean + half]

def run_row(r: dict) -> dict:
    "One reproduce.py result row in this file's schema (fields a row lacks are None)."
    before, after = r.get("eval_accuracy_before"), r.get("eval_accuracy_after")
    if before is None or after is None:
        raise ValueError(f"{r.get('strategy')} seed {r.get('seed')}: no held-out accuracy before/after; learning parity "
                         "needs presets with eval_prompts > 0")
    return {"preset": r.get("preset"), "strategy": r["strategy"], "seed": r["seed"],
            "completion_tokens_mean": r.get("completion_length_mean"), "acc_before": before, "acc_after": after,
            "gain": after - before, "diverged": r.get("diverged"),
            **{k: r.get(k) for k in ("clip_frac_pos_adv", "clip_frac_neg_adv", "entropy_last", "grad_norm_mean",
                                     "logp_abs_diff_mean", "date", "git_sha", "command")}}

def summaries(runs: list[dict], baseline: str = "bf16") -> list[dict]:
    "One summary row per (preset, strategy): the gain's mean and interval, and the paired difference to `baseline`."
    out = []
    for preset in dict.fromkeys(r["preset"] for r in runs):
        of = {(r["strategy"], r["seed"]): r for r in runs if r["preset"] == preset}
        base = {seed: r["gain"] for (s, seed), r in of.items() if s == baseline}
        for strategy in dict.fromkeys(s for s, _ in of):
            rows = [r for (s, _), r in of.items() if s == strategy]
            gain_mean, gain_ci = mean_ci95([r["gain"] for r in rows])
            pairs = [r["gain"] - base[r["seed"]] for r in rows if r["seed"] in base]
            diff_mean, diff_ci = mean_ci95(pairs) if strategy != baseline else (0.0, None)
            out.append({"summary": True, "preset": preset, "strategy": strategy, "n_seeds": len(rows),
                        "seeds": sorted(r["seed"] for r in rows), "gain_mean": gain_mean, "gain_ci95": gain_ci,
                        "diff_vs_bf16_mean": diff_mean, "diff_vs_bf16_ci95": diff_ci, "n_pairs": len(pairs),
                        "acc_after_mean": sum(r["acc_after"] for r in rows) / len(rows),
                        "diverged": sum(bool(r["diverged"]) for r in rows),
                        "clip_frac_neg_adv_mean": _mean_of(rows, "clip_frac_neg_adv"),
                        "clip_frac_pos_adv_mean": _mean_of(rows, "clip_frac_pos_adv"),
                        "entropy_last_mean": _mean_of(rows, "entropy_last")})
    return out

def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None

def _interval(ci) -> str: return "-" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"

def table(summary_rows: list[dict]) -> str:
    "Markdown: one line per (preset, strategy)."
    lines = ["| preset | strategy | seeds | held-out gain: mean [95% CI] | minus bf16, paired by seed: mean [95% CI] | "
             "clip frac neg / pos adv |", "|---|---|---|---|---|---|"]
    for s in summary_rows:
        clip = "-" if s["clip_frac_neg_adv_mean"] is None else f"{s['clip_frac_neg_adv_mean']:.2e} / {s['clip_frac_pos_adv_mean']:.2e}"
        diff = "(baseline)" if s["strategy"] == "bf16" else f"{s['diff_vs_bf16_mean']:+.3f} {_interval(s['diff_vs_bf16_ci95'])}"
        lines.append(f"| {s['preset']} | `{s['strategy']}` | {s['n_seeds']} | {s['gain_mean']:+.3f} {_interval(s['gain_ci95'])} | "
                     f"{diff} | {clip} |")
    return "\n".join(lines)

def figure(summary_rows: list[dict], runs: list[dict]):
    "Two panels: each strategy's gain (seeds as dots, the mean with its interval), and its paired difference to bf16."
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, subplot_titles=["held-out accuracy gain (after - before)",
                                                        "gain minus bf16's, same seed (0: parity)"])
    for s in summary_rows:
        name = f"{s['strategy']} ({s['preset']})"
        seeds = [r for r in runs if r["strategy"] == s["strategy"] and r["preset"] == s["preset"]]
        fig.add_trace(go.Scatter(x=[name] * len(seeds), y=[r["gain"] for r in seeds], mode="markers", showlegend=False,
                                 marker=dict(color="#999", size=7), text=[f"seed {r['seed']}" for r in seeds]), 1, 1)
        for col, mean, ci in ((1, s["gain_mean"], s["gain_ci95"]), (2, s["diff_vs_bf16_mean"], s["diff_vs_bf16_ci95"])):
            if col == 2 and s["strategy"] == "bf16": continue
            err = None if ci is None else dict(type="data", symmetric=False, array=[ci[1] - mean], arrayminus=[mean - ci[0]])
            fig.add_trace(go.Scatter(x=[name], y=[mean], error_y=err, mode="markers", showlegend=False,
                                     marker=dict(color="#1f77b4", size=12, symbol="diamond")), 1, col)
    fig.add_hline(y=0, line_dash="dot", row=1, col=2)
    fig.update_layout(height=420, title="Does jet learn as well as bf16? Means with 95% intervals over seeds")
    return fig

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="+", help="reproduce.py results files (JSONL, one row per finished run)")
    p.add_argument("--out", type=Path, help="write the run and summary rows here (JSONL)")
    p.add_argument("--figure", type=Path, help="write parity.html into this folder (needs plotly)")
    args = p.parse_args(argv)
    try:
        runs, seen = [], set()
        for path in args.results:
            if not path.is_file(): raise FileNotFoundError(f"no results file {path}")
            for line in path.read_text().splitlines():
                if not line.strip() or json.loads(line).get("summary"): continue
                row = run_row(json.loads(line))
                key = (row["preset"], row["strategy"], row["seed"])
                if key in seen: raise ValueError(f"{key} appears twice in the inputs: give each run once")
                seen.add(key); runs.append(row)
        summary_rows = summaries(runs)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"learning_parity: error: {e}", file=sys.stderr); return 2
    print(table(summary_rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps({k: r.get(k) for k in RUN_FIELDS}) + "\n" for r in runs)
                            + "".join(json.dumps(s) + "\n" for s in summary_rows))
    if args.figure:
        args.figure.mkdir(parents=True, exist_ok=True)
        figure(summary_rows, runs).write_html(args.figure / "parity.html", include_plotlyjs="cdn")
    return 0

if __name__ == "__main__":
    sys.exit(main())
