"Tests of scripts/learning_parity.py: the t-interval, the pairing by seed, the refusals."
import json, math, sys
from pathlib import Path
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import learning_parity as L  # noqa: E402


def row(strategy, seed, before, after, preset="gpu"):
    return {"strategy": strategy, "seed": seed, "preset": preset, "eval_accuracy_before": before, "eval_accuracy_after": after}


def test_mean_ci95_is_the_student_t_interval():
    mean, (low, high) = L.mean_ci95([1.0, 2.0, 3.0])           # sd 1, n 3: half-width t(2) / sqrt(3)
    assert mean == 2.0 and math.isclose(high - mean, 4.303 / math.sqrt(3)) and math.isclose(mean - low, high - mean)
    assert L.mean_ci95([0.5]) == (0.5, None)                   # one value: no interval
    assert L.mean_ci95([0.1] * 40)[1] == [pytest.approx(0.1), pytest.approx(0.1)]


def test_the_difference_to_bf16_is_paired_by_seed():
    # jet is exactly 0.01 below bf16 in every seed, while the seeds' gains spread widely: the paired interval is a point
    rows = [row("bf16", s, 0.2, 0.2 + g) for s, g in enumerate((0.3, 0.5, 0.4))]
    rows += [row("jet", s, 0.2, 0.19 + g) for s, g in enumerate((0.3, 0.5, 0.4))]
    jet = next(s for s in L.summaries([L.run_row(r) for r in rows]) if s["strategy"] == "jet")
    assert jet["n_pairs"] == 3 and math.isclose(jet["diff_vs_bf16_mean"], -0.01, abs_tol=1e-12)
    assert jet["diff_vs_bf16_ci95"][1] - jet["diff_vs_bf16_ci95"][0] < 1e-9      # no spread in the differences
    assert jet["gain_ci95"][1] - jet["gain_ci95"][0] > 0.3                         # the unpaired gains spread


def test_refusals(tmp_path, capsys):
    with pytest.raises(ValueError, match="no held-out accuracy"):
        L.run_row({"strategy": "jet", "seed": 0, "eval_accuracy_before": None, "eval_accuracy_after": 0.5})
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(row("bf16", 0, 0.2, 0.5)) + "\n" for _ in range(2)))
    assert L.main([str(f)]) == 2 and "appears twice" in capsys.readouterr().err
    assert L.main([str(tmp_path / "missing.jsonl")]) == 2


REPO = Path(__file__).resolve().parents[1]
PARITY = REPO / "benchmarks" / "results" / "learning_parity_gpu.jsonl"


def test_the_committed_parity_file_matches_its_sources():
    "Its summaries are what the script computes from the results files they name (one base, as pooled), every field of them."
    saved = [json.loads(line) for line in PARITY.read_text().splitlines()]
    saved_summaries = [s for s in saved if s.get("summary")]
    sources = {tuple(s["sources"]) for s in saved_summaries}
    assert len(sources) == 1 and all((REPO / f).is_file() for f in next(iter(sources)))
    runs = L.one_base(L.read_runs([REPO / f for f in next(iter(sources))]), warn=lambda _: None)
    assert [r for r in saved if not r.get("summary")] == [{k: r.get(k) for k in L.RUN_FIELDS} for r in runs]
    computed = L.summaries(runs)
    assert [{k: s[k] for k in c} for s, c in zip(saved_summaries, computed)] == computed and len(computed) == len(saved_summaries)
    assert all(s["command"].startswith("python scripts/learning_parity.py") for s in saved_summaries)


def test_the_readme_chart_is_drawn_from_the_committed_parity_file():
    "nbs/index.ipynb (and so the README) holds the chart of the committed summaries, as --update-index draws it."
    summary = [json.loads(line) for line in PARITY.read_text().splitlines() if json.loads(line).get("summary")]
    block = L.chart_block(summary, "benchmarks/results/learning_parity_gpu.jsonl")
    index = "".join("".join(c["source"]) for c in json.loads(L.INDEX.read_text())["cells"])
    assert block in index and block in (REPO / "README.md").read_text()


def test_runs_of_one_base_are_pooled_and_the_others_named():
    """A preset's majority base is pooled and the runs of other bases are named in one warning line; --strict-base makes
    that an error; a tie between bases is an error (no pairing would mean anything)."""
    rows = [dict(row("bf16", s, 0.2, 0.5), base_fingerprint="a" * 16) for s in range(3)]
    rows += [dict(row("jet", s, 0.2, 0.45), base_fingerprint="a" * 16) for s in range(3)]
    rows += [dict(row("jet", 3, 0.1, 0.9), base_fingerprint="b" * 16), dict(row("bf16", 3, 0.1, 0.2), base_fingerprint="b" * 16)]
    said = []
    kept = L.one_base([L.run_row(r) for r in rows], warn=said.append)
    assert {r["base_fingerprint"] for r in kept} == {"a" * 16} and len(kept) == 6
    assert len(said) == 1 and "pooled the 6 runs of base aaaa" in said[0] and "base bbbbbbbbbbbbbbbb: jet seed 3, bf16 seed 3" in said[0]
    jet = next(s for s in L.summaries(kept) if s["strategy"] == "jet")
    assert jet["n_pairs"] == 3 and math.isclose(jet["diff_vs_bf16_mean"], -0.05)
    with pytest.raises(ValueError, match="strict-base"):
        L.one_base([L.run_row(r) for r in rows], strict=True)
    with pytest.raises(ValueError, match="no base holds most runs"):
        L.one_base([L.run_row(r) for r in rows[:2] + rows[-2:]])
    unknown = L.run_row(row("bf16", 0, 0.2, 0.5))
    assert unknown["base_fingerprint"] == L.UNKNOWN_BASE                      # rows from before the fingerprint: one base


def test_the_command_pools_one_base_and_refuses_a_mixed_file_when_strict(tmp_path, capsys):
    f = tmp_path / "r.jsonl"
    rows = [dict(row(s, k, 0.2, 0.5 - 0.01 * (s == "jet")), base_fingerprint="a" * 16) for s in ("bf16", "jet") for k in range(2)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows + [dict(row("jet", 5, 0.2, 0.9), base_fingerprint="c" * 16)]))
    out = tmp_path / "parity.jsonl"
    assert L.main([str(f), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and "jet seed 5" in err
    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert len([r for r in saved if not r.get("summary")]) == 4 and all(r["base_fingerprint"] == "a" * 16 for r in saved)
    assert L.main([str(f), "--strict-base"]) == 2 and capsys.readouterr().err.startswith("learning_parity: error: preset gpu")


def test_text_chart_places_the_interval_the_mean_and_zero():
    s = {"preset": "gpu", "strategy": "jet", "diff_vs_bf16_mean": -0.05, "diff_vs_bf16_ci95": [-0.08, -0.02], "n_pairs": 5}
    lines = L.text_chart([{"strategy": "bf16", "preset": "gpu"} | {k: None for k in ("diff_vs_bf16_ci95",)}, s]).splitlines()
    assert len(lines) == 2 and "-0.1" in lines[0] and "+0.1" in lines[0]                 # the first round reach past 0.08
    axis = lines[1][len("gpu jet  "):len("gpu jet  ") + L.CHART_WIDTH]
    col = lambda v: round((v + 0.1) / 0.2 * (L.CHART_WIDTH - 1))
    assert axis[col(-0.08)] == "[" and axis[col(-0.02)] == "]" and axis[col(-0.05)] == "*" and axis[col(0)] == "|"
    assert "learns less than bf16" in lines[1] and "5 seeds" in lines[1]
    wide = dict(s, diff_vs_bf16_ci95=[-0.3, 0.2], diff_vs_bf16_mean=-0.05)
    assert "could hide +-0.300" in L.text_chart([wide]) and "-0.5" in L.text_chart([wide]).splitlines()[0]
