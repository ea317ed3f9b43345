"The bandwidth a benchmark's decode bound divides by: the data sheet of the GPU that ran it, never another card's."
import pytest
import benchmarks.common as common


@pytest.mark.parametrize("name, expected", [("NVIDIA H200", 4.8e12), ("NVIDIA H200 NVL", 4.8e12),
                                            ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                                            ("NVIDIA H100 NVL", 3.9e12), ("NVIDIA GH200 480GB", None),
                                            ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA H100", None)])
def test_data_sheet_bandwidth_names_only_the_card_that_ran(name, expected):
    assert common.data_sheet_bandwidth(name) == expected


def test_the_longest_matching_name_wins(monkeypatch):
    monkeypatch.setitem(common.HBM_BYTES_PER_S, "H100", 1.0e12)                  # a shorter key that also matches
    assert common.data_sheet_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert common.data_sheet_bandwidth("NVIDIA H100") == 1.0e12


def test_a_named_card_takes_its_data_sheet_an_unnamed_one_a_measured_copy(monkeypatch):
    monkeypatch.setattr(common, "gpu_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert common.hbm_bytes_per_s("cuda") == (3.35e12, "data sheet (NVIDIA H100 80GB HBM3)")
    monkeypatch.setattr(common, "gpu_name", lambda device=None: "NVIDIA GH200 480GB")
    monkeypatch.setattr(common, "event_time_ms", lambda fn: (fn(), 0.5)[1])       # a copy of 1 GiB in 0.5 ms
    bandwidth, source = common.hbm_bytes_per_s("cpu")
    assert bandwidth == 2 * 2**30 / 0.5e-3 and source == "measured copy (NVIDIA GH200 480GB)"


def test_decode_gemm_benchmark_shapes_and_candidates():
    """`decode_gemm` times the linears a decode step runs (the fused q/k/v and gate/up projections as `jet` fuses
    them), and every candidate tile it tries is one the kernels build; bad options are refused before any GPU work."""
    from benchmarks import decode_gemm
    assert decode_gemm.linear_shapes("llama3-8b") == {"qkv": (6144, 4096), "o": (4096, 4096), "gate+up": (28672, 4096),
                                                      "down": (4096, 14336)}
    assert decode_gemm.linear_shapes("qwen2-7b") == {"qkv": (4608, 3584), "o": (3584, 3584), "gate+up": (37888, 3584),
                                                     "down": (3584, 18944)}
    for rows in (64, 128):
        tiles = decode_gemm.gluon_tiles(rows)
        assert tiles and all(decode_gemm.gluon_tile_fits(t) for t in tiles)
        assert any(t.cols == 128 for t in tiles) and {t.rows for t in tiles} == ({64} if rows == 64 else {64, 128})
        assert {t[0] for t in decode_gemm.triton_tiles(rows)} == ({64} if rows == 64 else {64, 128})
    for bad, message in (("--rows=64,x", "--rows takes whole numbers"), ("--rows=300", "--rows takes whole numbers"),
                         ("--linears=qkv,mlp", "unknown \\['mlp'\\]")):
        with pytest.raises(SystemExit, match=message):
            decode_gemm.main([bad])


@pytest.mark.parametrize("extra, says", [
    (["--warmup-new-tokens", "0"], "give 1 to --new-tokens"),
    (["--warmup-new-tokens", "9000"], "give 1 to --new-tokens"),
    (["--warmup-new-tokens", "256", "--release-rollout-memory"], "--no-cuda-graphs"),
    (["--warmup-new-tokens", "256", "--no-cuda-graphs"], "--release-rollout-memory"),
])
def test_grpo_step_refuses_a_warmup_that_would_time_a_capture(extra, says, capsys):
    from benchmarks import grpo_step
    with pytest.raises(SystemExit):
        grpo_step.main(["--new-tokens", "4096", *extra])
    assert says in capsys.readouterr().err


def test_process_counts_read_all_and_refuse_what_the_host_cannot_run():
    from benchmarks.grpo_step_torchrun import process_counts
    assert process_counts("8,1,all", 8) == [1, 8] and process_counts("2,1", 0) == [1, 2]
    for spec, devices, says in (("0", 8, "not a process count"), ("two", 8, "not a process count"),
                                ("16", 8, "this host has 8 GPUs"), ("all", 0, "no GPU is visible")):
        with pytest.raises(ValueError, match=says): process_counts(spec, devices)


def test_rank_errors_name_each_ranks_exception_once_qualified_or_not():
    from benchmarks.grpo_step_torchrun import rank_errors
    log = ("[rank1]: Traceback (most recent call last):\n[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n"
           "[rank0]: FileNotFoundError: 'x' is not a local model folder\n"
           "[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n"
           "E1207 torch/distributed/elastic: failed (exitcode: 1)\n")
    assert rank_errors(log) == ["[rank1]: torch.OutOfMemoryError: CUDA out of memory.",
                                "[rank0]: FileNotFoundError: 'x' is not a local model folder"]


def test_a_tile_setting_holds_for_its_run_and_is_undone_after_a_failure():
    """`long_rollout --tiles` sets the attention's constants that engine and trainer both read, for the run only: back
    to jetrl's after it, even when the run fails; a malformed setting, or two settings in one run, are refused."""
    import jetrl.kernels.attention as attention
    from benchmarks import attention_decode, long_rollout
    default = attention_decode.current_tiles()
    other = dict(default, KEY_SPLIT=2 * default["KEY_SPLIT"], ATTENTION_STAGES=2)
    with pytest.raises(RuntimeError, match="the run failed"):
        with attention_decode.attention_tiles(other):
            assert attention.KEY_SPLIT == other["KEY_SPLIT"] and attention_decode.current_tiles() == other
            raise RuntimeError("the run failed")
    assert attention_decode.current_tiles() == default
    assert attention_decode.tile_settings("64:1024:4:3:0") == [dict(KEY_BLOCK=64, KEY_SPLIT=1024, ATTENTION_WARPS=4,
                                                                    ATTENTION_STAGES=3, FP8_KV_MAX_REGISTERS=0)]
    with pytest.raises(SystemExit, match="one setting per run, got 2"):
        long_rollout.main(["--tiles", "64:512:4:3:128,64:1024:4:3:128"])
    with pytest.raises(SystemExit):
        long_rollout.main(["--tiles", "64:1024:4"])
