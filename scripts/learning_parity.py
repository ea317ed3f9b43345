"""Does `jet` learn as well as `bf16`? Seeds pooled with confidence intervals, from reproduce.py's results files.

    python scripts/learning_parity.py benchmarks/results/reproduce_gpu.jsonl [more.jsonl ...] \\
        --out benchmarks/results/learning_parity_gpu.jsonl [--figure DIR] [--strict-base] [--update-index]

Each input row is one finished (strategy, seed) run of `scripts/reproduce.py`. The output holds one row per run
(the held-out accuracy before and after, the diagnostics, the base it started from) and one summary row per
(preset, strategy):

- `gain_mean`, `gain_ci95`: the held-out gain (after - before) over seeds, with its 95% confidence interval
  (Student's t with n - 1 degrees of freedom: the seeds are few, and their spread is estimated from them);
- `diff_vs_bf16_mean`, `diff_vs_bf16_ci95`: the gain minus `bf16`'s gain *of the same seed* (a paired difference:
  both runs start from the same base, sample the same prompts and differ in the strategy alone), with its interval.

A pairing means something only between runs of one base policy: the runs of a preset are pooled only if they share
one `base_fingerprint` (reproduce.py's hash of the base's weights). Given runs of several bases, the majority base is
pooled and the others are named in a warning (`--strict-base`: an error instead). Runs written before rows carried
a fingerprint count as one base, "unknown".

An interval that excludes 0 is a difference the seeds can see; one that holds 0 is not evidence of parity either,
only of a difference smaller than the interval's half-width. `--update-index` redraws the text chart of the
intervals in nbs/index.ipynb (then `python tools/make_readme.py` writes it into the README).
"""
from __future__ import annotations

import argparse, datetime, json, math, os, shlex, subprocess, sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Student's t quantile 0.975 by degrees of freedom (1..30): the 95% two-sided interval's multiplier
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
Z975 = 1.960           # the normal quantile, for more than 30 degrees of freedom
UNKNOWN_BASE = "unknown"

RUN_FIELDS = ("preset", "strategy", "seed", "base_fingerprint", "completion_tokens_mean", "acc_before", "acc_after", "gain",
              "diverged", "clip_frac_pos_adv", "clip_frac_neg_adv", "rollout_clip_frac_pos_adv", "rollout_clip_frac_neg_adv",
              "entropy_last", "grad_norm_mean", "kl_to_start_last", "logp_abs_diff_mean", "date", "git_sha", "command")

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
    "One reproduce.py result row in this file's schema (fields a row lacks are None; no fingerprint: UNKNOWN_BASE)."
    before, after = r.get("eval_accuracy_before", r.get("acc_before")), r.get("eval_accuracy_after", r.get("acc_after"))
    if before is None or after is None:
        raise ValueError(f"{r.get('strategy')} seed {r.get('seed')}: no held-out accuracy before/after; learning parity "
                         "needs presets with eval_prompts > 0")
    return {"preset": r.get("preset"), "strategy": r["strategy"], "seed": r["seed"],
            "base_fingerprint": r.get("base_fingerprint") or UNKNOWN_BASE,
            "completion_tokens_mean": r.get("completion_length_mean", r.get("completion_tokens_mean")), "acc_before": before,
            "acc_after": after, "gain": after - before, "diverged": r.get("diverged"),
            **{k: r.get(k) for k in RUN_FIELDS if k not in ("preset", "strategy", "seed", "base_fingerprint", "completion_tokens_mean",
                                                             "acc_before", "acc_after", "gain", "diverged")}}

def one_base(runs: list[dict], strict: bool = False, warn=lambda message: print(message, file=sys.stderr)) -> list[dict]:
    """The runs of each preset's majority base (the fingerprint most runs share); the others are named in one warning
    line per preset, or (`strict`) a ValueError. A tie between bases is an error: no pairing would be meaningful."""
    kept = []
    for preset in dict.fromkeys(r["preset"] for r in runs):
        of = [r for r in runs if r["preset"] == preset]
        counts = {}
        for r in of: counts[r["base_fingerprint"]] = counts.get(r["base_fingerprint"], 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            raise ValueError(f"preset {preset}: no base holds most runs ({', '.join(f'{b}: {n}' for b, n in ranked)}); "
                             "give the results files of one base")
        base = ranked[0][0]
        others = [r for r in of if r["base_fingerprint"] != base]
        if others:
            named = "; ".join(f"base {b}: " + ", ".join(f"{r['strategy']} seed {r['seed']}" for r in others if r["base_fingerprint"] == b)
                              for b, _ in ranked[1:])
            message = (f"preset {preset}: runs of {len(ranked)} bases; pooled the {ranked[0][1]} runs of base {base}, left out {named}")
            if strict: raise ValueError(message + " (--strict-base): give the results files of one base")
            warn(f"learning_parity: warning: {message}")
        kept += [r for r in of if r["base_fingerprint"] == base]
    return kept

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
                        "seeds": sorted(r["seed"] for r in rows), "base_fingerprint": rows[0].get("base_fingerprint"),
                        "gain_mean": gain_mean, "gain_ci95": gain_ci,
                        "diff_vs_bf16_mean": diff_mean, "diff_vs_bf16_ci95": diff_ci, "n_pairs": len(pairs),
                        "acc_after_mean": sum(r["acc_after"] for r in rows) / len(rows),
                        "diverged": sum(bool(r["diverged"]) for r in rows),
                        "completion_tokens_mean": _mean_of(rows, "completion_tokens_mean"),
                        "clip_frac_neg_adv_mean": _mean_of(rows, "clip_frac_neg_adv"),
                        "clip_frac_pos_adv_mean": _mean_of(rows, "clip_frac_pos_adv"),
                        "rollout_clip_frac_neg_adv_mean": _mean_of(rows, "rollout_clip_frac_neg_adv"),
                        "rollout_clip_frac_pos_adv_mean": _mean_of(rows, "rollout_clip_frac_pos_adv"),
                        "entropy_last_mean": _mean_of(rows, "entropy_last"),
                        "kl_to_start_last_mean": _mean_of(rows, "kl_to_start_last")})
    return out

def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None

def _interval(ci) -> str: return "-" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"

def verdict(s: dict) -> str:
    "What the paired interval says, in words: a gap the seeds can see, or none they can see, or too few pairs."
    ci = s["diff_vs_bf16_ci95"]
    if s["strategy"] == "bf16": return "baseline"
    if ci is None: return "one pair: no interval"
    if ci[1] < 0: return "learns less than bf16"
    if ci[0] > 0: return "learns more than bf16"
    return f"no difference the seeds can see (could hide +-{max(-ci[0], ci[1]):.3f})"

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

CHART_WIDTH = 41        # characters of the text chart's axis
CHART_REACHES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)   # the axis runs from -reach to +reach, the first that holds every interval

def text_chart(summary_rows: list[dict]) -> str:
    """The paired differences to bf16 as a text chart, one line per (preset, strategy): `[` and `]` the 95% interval,
    `*` the mean, `|` zero, on one axis symmetric about 0 for every line; the numbers and the verdict beside it."""
    rows = [s for s in summary_rows if s["strategy"] != "bf16"]
    if not rows: return "(no strategy to compare with bf16)"
    widest = max(abs(v) for s in rows for v in (s["diff_vs_bf16_ci95"] or [s["diff_vs_bf16_mean"]]))
    reach = next((r for r in CHART_REACHES if r >= widest), widest)        # a round number past every interval
    column = lambda v: round((v + reach) / (2 * reach) * (CHART_WIDTH - 1))
    name = max(len(f"{s['preset']} {s['strategy']}") for s in rows)
    scale = f"-{reach:g}".ljust(CHART_WIDTH // 2) + "0" + f"+{reach:g}".rjust(CHART_WIDTH - CHART_WIDTH // 2 - 1)
    lines = [" " * (name + 2) + scale]
    for s in rows:
        axis = [" "] * CHART_WIDTH
        axis[column(0.0)] = "|"
        ci = s["diff_vs_bf16_ci95"]
        if ci is not None:
            for c in range(column(ci[0]), column(ci[1]) + 1): axis[c] = "-" if axis[c] == " " else axis[c]
            axis[column(ci[0])], axis[column(ci[1])] = "[", "]"
        axis[column(s["diff_vs_bf16_mean"])] = "*"
        lines.append(f"{s['preset'] + ' ' + s['strategy']:<{name}}  {''.join(axis)}  {s['diff_vs_bf16_mean']:+.3f} "
                     f"{_interval(ci)}, {s['n_pairs']} seed{'s' * (s['n_pairs'] != 1)}: {verdict(s)}")
    return "\n".join(lines)

INDEX = REPO / "nbs" / "index.ipynb"
CHART_START, CHART_END = "<!-- learning-parity-chart -->", "<!-- /learning-parity-chart -->"

def chart_block(summary_rows: list[dict], source: str) -> str:
    "The chart as nbs/index.ipynb holds it between its markers: a code block, then where it was drawn from."
    return f"{CHART_START}\n```\n{text_chart(summary_rows)}\n```\n\n(drawn from `{source}` by `scripts/learning_parity.py`)\n{CHART_END}"

def update_index(summary_rows: list[dict], source: str, index: Path = INDEX) -> bool:
    "Redraw the chart between the markers of index's markdown cell; True when it changed. The markers must be there."
    nb = json.loads(index.read_text())
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or CHART_START not in text: continue
        head, rest = text.split(CHART_START, 1)
        if CHART_END not in rest: raise ValueError(f"{index}: {CHART_START} without {CHART_END}: put the closing marker back")
        new = head + chart_block(summary_rows, source) + rest.split(CHART_END, 1)[1]
        if new == text: return False
        lines = new.split("\n")
        cell["source"] = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
        index.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        return True
    raise ValueError(f"{index} has no markdown cell with {CHART_START}: add the markers where the chart goes")

def figure(summary_rows: list[dict], runs: list[dict]):
    """Two panels a learner reads at a glance, one line per (preset, strategy): the held-out gain (each seed a dot, the
    mean with its 95% interval), and the gain minus bf16's of the same seed (each seed's pair a dot, the mean and
    interval; red when the interval excludes 0) against a line at 0, parity."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=["held-out accuracy gain (after - before)", "gain minus bf16's, same seed (0: learns as much)"])
    names = [f"{s['strategy']} ({s['preset']})" for s in summary_rows]
    for s, name in zip(summary_rows, names):
        seeds = [r for r in runs if r["strategy"] == s["strategy"] and r["preset"] == s["preset"]]
        base = {r["seed"]: r["gain"] for r in runs if r["strategy"] == "bf16" and r["preset"] == s["preset"]}
        fig.add_trace(go.Scatter(x=[r["gain"] for r in seeds], y=[name] * len(seeds), mode="markers", showlegend=False,
                                 marker=dict(color="#999", size=7), hovertext=[f"seed {r['seed']}" for r in seeds]), 1, 1)
        if s["strategy"] != "bf16":
            paired = [r for r in seeds if r["seed"] in base]
            fig.add_trace(go.Scatter(x=[r["gain"] - base[r["seed"]] for r in paired], y=[name] * len(paired), mode="markers",
                                     showlegend=False, marker=dict(color="#999", size=7),
                                     hovertext=[f"seed {r['seed']}" for r in paired]), 1, 2)
        for col, mean, ci in ((1, s["gain_mean"], s["gain_ci95"]), (2, s["diff_vs_bf16_mean"], s["diff_vs_bf16_ci95"])):
            if col == 2 and s["strategy"] == "bf16": continue
            seen = col == 2 and ci is not None and (ci[1] < 0 or ci[0] > 0)
            err = None if ci is None else dict(type="data", symmetric=False, array=[ci[1] - mean], arrayminus=[mean - ci[0]], thickness=3)
            fig.add_trace(go.Scatter(x=[mean], y=[name], error_x=err, mode="markers", showlegend=False,
                                     marker=dict(color="#d62728" if seen else "#1f77b4", size=13, symbol="diamond"),
                                     hovertext=[f"{mean:+.3f} {_interval(ci)}, {s['n_seeds']} seed{'s' * (s['n_seeds'] != 1)}: {verdict(s)}"]), 1, col)
    fig.add_vline(x=0, line_dash="dot", row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(height=160 + 45 * len(names), margin=dict(l=10, r=10, t=70, b=30),
                      title="Does jet learn as well as bf16? Each seed a dot; the diamond and bar: mean and 95% interval over seeds")
    return fig

def read_runs(paths: list[Path]) -> list[dict]:
    "The run rows of reproduce.py results files (or of an earlier output of this script), each (preset, strategy, seed) once."
    runs, seen = [], set()
    for path in paths:
        if not path.is_file(): raise FileNotFoundError(f"no results file {path}")
        for line in path.read_text().splitlines():
            if not line.strip() or json.loads(line).get("summary"): continue
            row = run_row(json.loads(line))
            key = (row["preset"], row["strategy"], row["seed"], row["base_fingerprint"])
            if key in seen: raise ValueError(f"{key[:3]} of base {key[3]} appears twice in the inputs: give each run once")
            seen.add(key); runs.append(row)
    return runs

def provenance() -> dict:
    """The date and the commit of the code that wrote a row: $JETRL_GIT_SHA where set (a copy of the tree without its
    .git, as on a GPU machine), else git's short sha ('unknown' outside a git checkout). scripts/reproduce.py's rows too."""
    if os.environ.get("JETRL_GIT_SHA"): return {"date": datetime.date.today().isoformat(), "git_sha": os.environ["JETRL_GIT_SHA"]}
    try: sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError): sha = "unknown"
    return {"date": datetime.date.today().isoformat(), "git_sha": sha}

def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="+", help="reproduce.py results files (JSONL, one row per finished run)")
    p.add_argument("--out", type=Path, help="write the run and summary rows here (JSONL)")
    p.add_argument("--figure", type=Path, help="write parity.html into this folder (needs plotly)")
    p.add_argument("--strict-base", action="store_true", help="runs of more than one base policy in a preset: an error, not a warning")
    p.add_argument("--update-index", action="store_true", help="redraw the text chart in nbs/index.ipynb (then: python tools/make_readme.py)")
    args = p.parse_args(argv)
    command = "python scripts/learning_parity.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        runs = one_base(read_runs(args.results), strict=args.strict_base)
        summary_rows = [s | {"sources": [_shown(f) for f in args.results], "command": command, **provenance()} for s in summaries(runs)]
        if args.update_index: update_index(summary_rows, _shown(args.out) if args.out else ", ".join(_shown(f) for f in args.results))
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"learning_parity: error: {e}", file=sys.stderr); return 2
    print(table(summary_rows)); print(); print(text_chart(summary_rows))
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
