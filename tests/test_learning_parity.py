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


def test_the_committed_parity_file_matches_the_reproduction():
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    saved = [json.loads(line) for line in (results / "learning_parity_gpu.jsonl").read_text().splitlines()]
    runs = [L.run_row(json.loads(line)) for line in (results / "reproduce_gpu.jsonl").read_text().splitlines()]
    assert [s["gain_mean"] for s in L.summaries(runs)] == [s["gain_mean"] for s in saved if s.get("summary")]
