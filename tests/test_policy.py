"""Tests of `jetrl.policy`: what each precision strategy computes on each side (by inspecting the modules and by
spying on the FP8 GEMM), the weight sync (Jet-RL's byte-identical weights, the separate copy of `fp8-rollout`),
checkpoints (exact round trip, exact continuation, no pickle, errors), PrecisionSpec, loading a local model
folder, and per-token log-probs against a hand computation.

References: an unconverted copy of the model (the high-precision side), `quantize_weight` (the one weight
quantizer), `log_softmax` of the model's own logits, and the unpadded sequence (for left padding).
Models are small random `transformers` Llama / Qwen2 built offline, computed in fp32 on CPU."""
import copy, json, warnings
from dataclasses import replace
import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
import jetrl.linear
from jetrl.linear import RECIPES, FP8Linear, FP8InferenceLinear, FP8Recipe, fp8_modules, quantize_weight
from jetrl.policy import (STRATEGIES, PrecisionSpec, Policy, SyncReport, get_strategy, token_log_probs, train_log_probs,
                          rollout_log_probs, load_model_and_tokenizer, load_policy)
from jetrl.checkpoints import save_checkpoint, load_checkpoint

# ---- tiny models, a batch, a spy on the FP8 GEMM ----------------------------------------------------------------------

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
VOCAB, N_LAYERS = 384, 2
LINEARS_PER_LAYER = 7            # q, k, v, o, gate, up, down; lm_head stays high precision
N_LINEARS = LINEARS_PER_LAYER * N_LAYERS

def tiny_model(family="llama", tie=True, seed=0):
    "A random 2-layer model; intermediate 704 = 5.5 x 128, so down_proj has a partial 128-block."
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(hidden_size=256, intermediate_size=704, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tie)).eval()

# the two tying variants, across the two families (Qwen2 also has biases on q, k, v)
MODELS = [("llama", True), ("qwen2", False)]
MODEL_IDS = ["llama-tied", "qwen2-untied"]

def left_padded_batch(seed=0):
    "(3, 20) ids: row 0 full, row 1 left-padded by 5, row 2 by 9 (pad id 0, mask 0)."
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 5), (2, 9)): ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask

class GemmSpy:
    """Wraps `jetrl.linear.fp8_mm` (which fp8_fprop and the backward call) and records every call with the name
    of the linear whose forward was running (set by forward pre-hooks), and a copy of the `b` operand."""
    def __init__(self, monkeypatch, *models):
        self.real, self.calls, self.layer = jetrl.linear.fp8_mm, [], None
        monkeypatch.setattr(jetrl.linear, "fp8_mm", self)
        for model in models:
            for fqn, m in model.named_modules():
                if isinstance(m, (nn.Linear, FP8InferenceLinear)): m.register_forward_pre_hook(self._enter(fqn))
    def _enter(self, fqn):
        def hook(module, args): self.layer = fqn
        return hook
    def __call__(self, a, b, *args, **kwargs):
        self.calls.append(dict(layer=self.layer, b_ptr=b.data.data_ptr(), b_data=b.data.clone(), b_scale=b.scale.clone(),
                               b_block=b.block, b_fmt=b.fmt))
        return self.real(a, b, *args, **kwargs)
    def take(self):
        "The calls so far, and start afresh."
        calls, self.calls = self.calls, []
        return calls

def all_equal_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

def train_step(policy, opt, ids, mask):
    "One optimizer step on a simple loss (minus the mean log-prob of the real tokens)."
    opt.zero_grad()
    lp = train_log_probs(policy, ids, mask)
    (-(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    opt.step()

def masked_gap(a, b, mask):
    "|a - b| at the real (non-pad) predicted tokens."
    return (a - b).abs()[mask[:, 1:].bool()]

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These GEMMs are tiny ((60, 256) x (256, 704) at most): with two intra-op threads on busy cores, the threads
    wait on each other at every op (measured: 126 s for this file with 2 threads under load, 7 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ---- each strategy puts the right precision on each side --------------------------------------------------------------

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_modules(name, family, tie):
    "Inspect the modules: recipe of every FP8Linear, what the rollout side holds, lm_head kept as nn.Linear."
    policy = Policy(tiny_model(family, tie), strategy=name, device="cpu")
    spec = STRATEGIES[name]
    train_linears = fp8_modules(policy.model)
    assert len(train_linears) == N_LINEARS
    assert {m.recipe for m in train_linears.values()} == {spec.train_recipe}
    assert spec.train_recipe == {"jet": RECIPES["blockwise"], "jet-fp8kv": RECIPES["blockwise"],
                                 "jet-rowwise": RECIPES["rowwise"]}.get(name, RECIPES["bf16"])
    assert type(policy.model.lm_head) is nn.Linear
    assert policy.dtype == {"fp16": torch.float16}.get(name, torch.float32)          # CPU: fp32 unless asked
    assert {p.dtype for p in policy.model.parameters()} == {policy.dtype}
    if spec.shared_weights:
        assert policy.rollout_model is policy.model
    else:
        assert policy.rollout_model is not policy.model
        assert fp8_modules(policy.rollout_model) == {}
        engine = {fqn: m for fqn, m in policy.rollout_model.named_modules() if isinstance(m, FP8InferenceLinear)}
        assert engine.keys() == train_linears.keys()
        for m in engine.values():
            assert m.recipe == spec.rollout_recipe == RECIPES["rowwise" if name.endswith("-rowwise") else "blockwise"]
            assert m.weight_fp8.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
            assert list(m.parameters()) == []                        # FP8 only: no high-precision weight
        assert type(policy.rollout_model.lm_head) is nn.Linear
        # the rollout copy is tied exactly when the model is
        assert (policy.rollout_model.lm_head.weight is policy.rollout_model.model.embed_tokens.weight) == tie
        assert not any(p.requires_grad for p in policy.rollout_model.parameters())
    assert spec.tis_cap == (2.0 if name == "fp8-rollout-tis" else None)

def test_tis_strategy_is_fp8_rollout_plus_the_cap():
    assert STRATEGIES["fp8-rollout-tis"] == replace(STRATEGIES["fp8-rollout"], name="fp8-rollout-tis", tis_cap=2.0)

# FP8 GEMMs per forward (training forward with grad, rollout forward) and in the training backward
EXPECTED_GEMMS = {"bf16": (0, 0, 0), "fp16": (0, 0, 0), "fp8-rollout": (0, N_LINEARS, 0), "fp8-rollout-tis": (0, N_LINEARS, 0),
                  "fp8-rollout-rowwise": (0, N_LINEARS, 0), "jet-rowwise": (N_LINEARS, N_LINEARS, 2 * N_LINEARS),
                  "jet": (N_LINEARS, N_LINEARS, 2 * N_LINEARS), "jet-fp8kv": (N_LINEARS, N_LINEARS, 2 * N_LINEARS)}   # jet backward: Dgrad and Wgrad per linear

@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_gemms(name, monkeypatch):
    "Spy on fp8_mm: which side runs FP8 GEMMs, how many, and from which layers."
    policy = Policy(tiny_model("qwen2", tie=False), strategy=name, device="cpu")
    ids, mask = left_padded_batch()
    spy = GemmSpy(monkeypatch, policy.model, policy.rollout_model)
    lp = train_log_probs(policy, ids, mask); fwd = spy.take()
    lp.sum().backward(); bwd = spy.take()
    rollout_log_probs(policy, ids, mask); roll = spy.take()
    assert (len(fwd), len(roll), len(bwd)) == EXPECTED_GEMMS[name]
    for calls in (fwd, roll):
        if calls:   # one FP8 Fprop per converted linear, each once, none from lm_head
            assert sorted(c["layer"] for c in calls) == sorted(fp8_modules(policy.model))
    if name == "fp16":
        logits = policy.model(input_ids=ids, attention_mask=mask).logits
        assert logits.dtype == torch.float16 and lp.dtype == torch.float32

# ---- Jet-RL: the two sides are one graph ------------------------------------------------------------------------------

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_jet_rollout_weights_are_the_training_bytes(family, tie, monkeypatch):
    """After an optimizer step and sync_weights(): for every linear, the FP8 weight (data bytes and scales, the `b`
    operand = w_fp8.t()) of a rollout forward is byte-identical to the one of a training forward (grad enabled),
    both equal quantize_weight of the new master weight, and the per-token log-probs of both sides are equal."""
    policy = Policy(tiny_model(family, tie), strategy="jet", device="cpu")
    ids, mask = left_padded_batch()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    spy = GemmSpy(monkeypatch, policy.model)
    rollout_log_probs(policy, ids, mask); before = {c["layer"]: c for c in spy.take()}
    train_step(policy, opt, ids, mask); spy.take()
    report = policy.sync_weights()
    assert (report.quantized, report.copied) == (N_LINEARS, 0)

    train_lp = train_log_probs(policy, ids, mask); train = {c["layer"]: c for c in spy.take()}
    roll_lp = rollout_log_probs(policy, ids, mask); roll = {c["layer"]: c for c in spy.take()}
    linears = fp8_modules(policy.model)
    assert train.keys() == roll.keys() == before.keys() == linears.keys()
    changed = 0
    for fqn, m in linears.items():
        t, r = train[fqn], roll[fqn]
        assert torch.equal(t["b_data"].view(torch.uint8), r["b_data"].view(torch.uint8)), fqn
        assert torch.equal(t["b_scale"], r["b_scale"]), fqn
        assert (t["b_block"], t["b_fmt"]) == (r["b_block"], r["b_fmt"]) == ((128, 128), "e4m3")
        ref = quantize_weight(m.weight, "blockwise").t()                     # the one weight quantizer
        assert torch.equal(r["b_data"].view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(r["b_scale"], ref.scale)
        assert r["b_ptr"] == m.fp8_weight().data.data_ptr()                  # the rollout reads the sync's cache
        changed += not torch.equal(before[fqn]["b_data"].view(torch.uint8), r["b_data"].view(torch.uint8))
    assert changed == N_LINEARS                                              # the step did change every FP8 weight
    assert torch.equal(train_lp.detach(), roll_lp)

# ---- fp8-rollout: a high-precision trainer and a separate FP8 copy ---------------------------------------------------

def engine_linears(policy):
    return {fqn: m for fqn, m in policy.rollout_model.named_modules() if isinstance(m, FP8InferenceLinear)}

def assert_engine_matches(policy, train_weights):
    "Each rollout linear holds exactly quantize_weight(train weight, 'blockwise')."
    for fqn, m in engine_linears(policy).items():
        ref = quantize_weight(train_weights[fqn], "blockwise")
        assert torch.equal(m.weight_fp8.view(torch.uint8), ref.data.view(torch.uint8)), fqn
        assert torch.equal(m.weight_scale, ref.scale), fqn

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_fp8_rollout_training_side_is_the_unconverted_model(family, tie):
    model = tiny_model(family, tie)
    reference = copy.deepcopy(model)
    reference.jetrl_trainer_matches_engine = False       # a BF16 trainer's forward: rows moved left (jetrl.forward)
    policy = Policy(model, strategy="fp8-rollout", device="cpu")
    ids, mask = left_padded_batch()
    assert torch.equal(train_log_probs(policy, ids, mask), token_log_probs(reference, ids, mask))   # grad enabled
    with torch.no_grad():
        assert torch.equal(train_log_probs(policy, ids, mask), token_log_probs(reference, ids, mask))

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_fp8_rollout_reads_its_own_copy_until_the_next_sync(family, tie, monkeypatch):
    policy = Policy(tiny_model(family, tie), strategy="fp8-rollout", device="cpu")
    ids, mask = left_padded_batch()
    weights = lambda: {fqn: m.weight.detach().clone() for fqn, m in fp8_modules(policy.model).items()}
    assert_engine_matches(policy, weights())                      # Policy() syncs once

    # the rollout forward's `b` operand is the engine's own FP8 buffer
    spy = GemmSpy(monkeypatch, policy.rollout_model)
    lp_before = rollout_log_probs(policy, ids, mask)
    engine = engine_linears(policy)
    assert {c["layer"]: c["b_ptr"] for c in spy.take()} == {fqn: m.weight_fp8.data_ptr() for fqn, m in engine.items()}

    old_weights, old_rest = weights(), copy.deepcopy(policy.rollout_model.state_dict())
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    train_step(policy, opt, ids, mask)
    new_weights = weights()
    assert all(not torch.equal(old_weights[k], new_weights[k]) for k in new_weights)
    # no sync yet: FP8 buffers, high-precision rest (embeddings, norms, lm_head) and log-probs all unchanged
    assert_engine_matches(policy, old_weights)
    assert all(torch.equal(v, old_rest[k]) for k, v in policy.rollout_model.state_dict().items())
    assert torch.equal(rollout_log_probs(policy, ids, mask), lp_before)

    policy.sync_weights()
    assert_engine_matches(policy, new_weights)
    train_state = policy.model.state_dict()
    for k, v in policy.rollout_model.state_dict().items():
        if k in train_state and train_state[k].dtype == v.dtype: assert torch.equal(v, train_state[k]), k
    assert not torch.equal(rollout_log_probs(policy, ids, mask), lp_before)

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_fp8_rollout_gap_is_real_and_jet_gap_is_zero(family, tie):
    """Same weights under both strategies. fp8-rollout: the trainer computes in fp32, the rollout in FP8, so their
    per-token log-probs differ; measured mean |gap| over real tokens ~0.017-0.020 nats (max ~0.05-0.07). An E4M3
    GEMM has ~26 dB SQNR (~5% relative noise on each output), so the floor 1e-4 is two orders of magnitude below
    what FP8 must cause, and ~1000x above fp32 rounding (~1e-7). jet: exactly zero. And the fp8-rollout rollout
    computes the very function jet's two sides compute (same quantizer, same fp8_fprop): equal."""
    ids, mask = left_padded_batch()
    fp8r = Policy(tiny_model(family, tie), strategy="fp8-rollout", device="cpu")
    jet = Policy(tiny_model(family, tie), strategy="jet", device="cpu")
    fp8r_gap = masked_gap(train_log_probs(fp8r, ids, mask).detach(), rollout_log_probs(fp8r, ids, mask), mask)
    jet_gap = masked_gap(train_log_probs(jet, ids, mask).detach(), rollout_log_probs(jet, ids, mask), mask)
    assert fp8r_gap.mean() > 1e-4 and fp8r_gap.mean() < 0.5, fp8r_gap.mean()        # upper bound: not garbage
    assert jet_gap.max() == 0
    assert fp8r_gap.mean() > jet_gap.mean()
    assert torch.equal(rollout_log_probs(fp8r, ids, mask), rollout_log_probs(jet, ids, mask))

# ---- the sync report ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_sync_report_counts(name, family, tie):
    """quantized = number of FP8 linears (0 without an FP8 rollout); copied = the distinct high-precision tensors
    of the training model that are not part of a linear (embeddings, norms, lm_head; a tied lm_head/embedding is one
    tensor), only under a separate copy; bytes = the FP8 data + scales + the copied bytes."""
    policy = Policy(tiny_model(family, tie), strategy=name, device="cpu")
    report = policy.sync_weights()
    assert isinstance(report, SyncReport) and report is policy.last_sync and report.seconds >= 0
    spec = STRATEGIES[name]
    fp8_bytes = sum(quantize_weight(m.weight, spec.rollout_recipe).nbytes for m in fp8_modules(policy.model).values()) \
        if spec.rollout_recipe.quantizes else 0
    if spec.rollout_recipe.quantizes:
        linear_params = {p.data_ptr() for m in fp8_modules(policy.model).values() for p in m.parameters()}
        rest = {p.data_ptr(): p for p in policy.model.parameters() if p.data_ptr() not in linear_params}
        rest_bytes = sum(p.numel() * p.element_size() for p in rest.values())
        n_rest = 1 + (not tie) + 2 * N_LAYERS + 1         # embeddings, lm_head if untied, 2 norms per layer, final norm
        assert len(rest) == n_rest
        expected = (N_LINEARS, 0 if spec.shared_weights else n_rest)
        assert (report.quantized, report.copied) == expected, (report, f"expected quantized, copied = {expected}")
        assert report.bytes == fp8_bytes + (0 if spec.shared_weights else rest_bytes) > 0
    else:
        assert (report.quantized, report.copied, report.bytes) == (0, 0, 0)

# ---- checkpoints --------------------------------------------------------------------------------------------------------

def trained_jet(family, tie, steps=1, seed=0):
    policy = Policy(tiny_model(family, tie, seed=seed), strategy="jet", device="cpu")
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2, weight_decay=0.1)
    ids, mask = left_padded_batch()
    for _ in range(steps): train_step(policy, opt, ids, mask)
    return policy, opt

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_checkpoint_round_trip_and_exact_continuation(family, tie, tmp_path):
    ids, mask = left_padded_batch(seed=1)
    policy, opt = trained_jet(family, tie, steps=2)
    path = save_checkpoint(tmp_path / "step_2", policy, opt, step=2, extra={"note": "test"})
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint.json", "model.safetensors", "optimizer.safetensors"]
    assert all(p.suffix in (".safetensors", ".json") for p in path.rglob("*"))       # no pickle anywhere
    assert all(not p.read_bytes().startswith(b"\x80") for p in path.iterdir())        # nor a pickle's magic byte

    fresh = Policy(tiny_model(family, tie, seed=1), strategy="jet", device="cpu")
    fresh_opt = torch.optim.AdamW(fresh.model.parameters(), lr=0.5)                    # hyper-parameters come back too
    assert not all_equal_params(fresh.model, policy.model)
    meta = load_checkpoint(path, fresh, fresh_opt)
    assert meta["step"] == 2 and meta["extra"] == {"note": "test"}
    assert all_equal_params(fresh.model, policy.model)
    assert (fresh.model.lm_head.weight is fresh.model.model.embed_tokens.weight) == tie   # still tied (or not)
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    assert saved["state"].keys() == loaded["state"].keys() and len(saved["state"]) == len(list(policy.model.parameters()))
    for i in saved["state"]:
        assert saved["state"][i].keys() == loaded["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][i][key], loaded["state"][i][key]), (i, key)
    for g_saved, g_loaded in zip(saved["param_groups"], loaded["param_groups"]):
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in g_saved.items()} == \
               {k: list(v) if isinstance(v, tuple) else v for k, v in g_loaded.items()}
    # the rollout side was synced from the loaded weights
    assert torch.equal(rollout_log_probs(fresh, ids, mask), rollout_log_probs(policy, ids, mask))
    # one more step on each: bit-identical weights
    train_step(policy, opt, ids, mask); train_step(fresh, fresh_opt, ids, mask)
    assert all_equal_params(fresh.model, policy.model)

def test_interrupted_save_does_not_break_the_next_one(tmp_path):
    policy, opt = trained_jet("llama", True)
    target = tmp_path / "ckpt"
    save_checkpoint(target, policy, opt, step=1)                      # an older, complete checkpoint
    leftover = tmp_path / "ckpt.tmp"                                  # a save killed half-way
    leftover.mkdir(); (leftover / "model.safetensors").write_bytes(b"truncated"); (leftover / "junk.bin").write_bytes(b"x")
    save_checkpoint(target, policy, opt, step=7)
    assert not leftover.exists()
    assert sorted(p.name for p in target.iterdir()) == ["checkpoint.json", "model.safetensors", "optimizer.safetensors"]
    fresh = Policy(tiny_model("llama", True, seed=1), strategy="jet", device="cpu")
    assert load_checkpoint(target, fresh, torch.optim.AdamW(fresh.model.parameters()))["step"] == 7
    assert all_equal_params(fresh.model, policy.model)

def test_checkpoint_errors(tmp_path):
    policy, opt = trained_jet("llama", True)
    not_ckpt = tmp_path / "hf_model"
    tiny_model().save_pretrained(not_ckpt)                            # a model folder, not a jetrl checkpoint
    with pytest.raises(FileNotFoundError, match="not a jetrl checkpoint"): load_checkpoint(not_ckpt, policy)
    with pytest.raises(FileNotFoundError, match="not a jetrl checkpoint"): load_checkpoint(tmp_path / "missing", policy)
    weights_only = save_checkpoint(tmp_path / "weights_only", policy, None, step=3)
    assert sorted(p.name for p in weights_only.iterdir()) == ["checkpoint.json", "model.safetensors"]
    fresh = Policy(tiny_model(seed=1), strategy="jet", device="cpu")
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(weights_only, fresh, torch.optim.AdamW(fresh.model.parameters()))
    assert load_checkpoint(weights_only, fresh)["step"] == 3          # without an optimizer it loads
    assert all_equal_params(fresh.model, policy.model)

def test_failed_optimizer_load_leaves_the_policy_as_it_was(tmp_path):
    """A load that raises should not have changed anything: otherwise, under fp8-rollout, the caller keeps a policy
    whose training weights are the checkpoint's while its rollout copy still holds the old ones (no sync ran)."""
    policy, _ = trained_jet("llama", True)
    weights_only = save_checkpoint(tmp_path / "weights_only", policy, None, step=3)
    fresh = Policy(tiny_model(seed=1), strategy="fp8-rollout", device="cpu")
    before = copy.deepcopy(fresh.model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                               # jet -> fp8-rollout warns; not the point here
        with pytest.raises(ValueError, match="no optimizer state"):
            load_checkpoint(weights_only, fresh, torch.optim.AdamW(fresh.model.parameters()))
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items()), \
        "load_checkpoint raised, but only after loading the weights into the policy (rollout side not synced)"

def test_checkpoint_under_another_strategy_warns(tmp_path):
    policy, opt = trained_jet("llama", True)
    path = save_checkpoint(tmp_path / "ckpt", policy, opt, step=1)
    same = Policy(tiny_model(seed=1), strategy="jet", device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(path, same, torch.optim.AdamW(same.model.parameters()))
    assert not [w for w in caught if "strategy" in str(w.message)]
    other = Policy(tiny_model(seed=1), strategy="fp8-rollout", device="cpu")
    with pytest.warns(UserWarning, match="saved under strategy 'jet', loading into 'fp8-rollout'"):
        load_checkpoint(path, other, torch.optim.AdamW(other.model.parameters()))
    assert all_equal_params(other.model, policy.model)
    assert_engine_matches(other, {fqn: m.weight for fqn, m in fp8_modules(other.model).items()})   # synced after load

# ---- PrecisionSpec ---------------------------------------------------------------------------------------------------

CUSTOM = PrecisionSpec("rowwise-jet", train_recipe="rowwise", rollout_recipe="rowwise", keep_high_precision=("lm_head", "down_proj"))
ODD = PrecisionSpec("odd", train_recipe=FP8Recipe("mine", "blockwise", fp8_gemms=("fprop", "wgrad"), grad_fmt="e5m2",
                                                  group_size=64, pow2_scale=True),
                    rollout_recipe="tensorwise", shared_weights=False, hp_dtype="bfloat16", tis_cap=3.5)

@pytest.mark.parametrize("spec", [*STRATEGIES.values(), CUSTOM, ODD], ids=lambda s: s.name)
def test_spec_json_round_trip(spec):
    assert PrecisionSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert get_strategy(spec) is spec

def test_custom_spec_keeps_down_proj_high_precision(monkeypatch):
    policy = Policy(tiny_model(), strategy=CUSTOM, device="cpu")
    layers = policy.model.model.layers
    for layer in layers:
        assert type(layer.mlp.down_proj) is nn.Linear
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj):
            assert type(m) is FP8Linear and m.recipe == RECIPES["rowwise"]
    assert policy.rollout_model is policy.model
    ids, mask = left_padded_batch()
    spy = GemmSpy(monkeypatch, policy.model)
    rollout_log_probs(policy, ids, mask)
    calls = spy.take()
    assert len(calls) == (LINEARS_PER_LAYER - 1) * N_LAYERS
    assert not [c for c in calls if c["layer"].endswith(("down_proj", "lm_head"))]
    assert {c["b_block"] for c in calls} == {(256, 1)}                # rowwise W (N, 256): one scale per row, transposed

@pytest.mark.parametrize("kwargs, error", [
    (dict(train_recipe="blockwise", rollout_recipe="rowwise"), "shared_weights=True .* one recipe"),
    (dict(train_recipe="blockwise"), "one recipe"),                                 # rollout defaults to bf16
    (dict(shared_weights=False), "rollout_recipe must quantize Fprop"),             # separate copy, bf16 rollout
    (dict(shared_weights=False, rollout_recipe=FP8Recipe("wg", fp8_gemms=("wgrad",))), "must quantize Fprop"),
    (dict(tis_cap=0.5), "tis_cap .* at least 1"),
    (dict(tis_cap=0.0), "tis_cap"),
    (dict(hp_dtype="bf16"), "hp_dtype must be one of"),
    (dict(hp_dtype="float8"), "hp_dtype must be one of"),
    (dict(train_recipe="fp4", rollout_recipe="fp4"), "Unknown recipe 'fp4'"),
])
def test_spec_errors(kwargs, error):
    with pytest.raises(ValueError, match=error): PrecisionSpec("bad", **kwargs)

def test_spec_edge_values_are_accepted():
    assert PrecisionSpec("ok", tis_cap=1.0).tis_cap == 1.0          # C = 1 is allowed (a cap, not a weight)
    assert PrecisionSpec("ok", hp_dtype="float32").hp_dtype == "float32"

def test_unknown_strategy():
    with pytest.raises(ValueError, match=r"Unknown strategy 'fp4'.*'bf16'.*'jet'"): get_strategy("fp4")
    with pytest.raises(ValueError, match="Unknown strategy 'fp4'"): Policy(tiny_model(), strategy="fp4", device="cpu")

# ---- loading a local model folder --------------------------------------------------------------------------------------

def tiny_tokenizer():
    "A byte-level BPE (the kind Llama 3 and Qwen2 use) trained in memory on a few sentences, wrapped for transformers."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = ["the quick brown fox jumps over the lazy dog", "what is 12 + 30 ? the answer is 42",
             "reinforcement learning with fp8 rollouts", "a policy samples tokens and a trainer scores them"] * 4
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB - 40, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_load_policy_from_a_local_folder(family, tie, tmp_path):
    model, tokenizer = tiny_model(family, tie), tiny_tokenizer()
    model.save_pretrained(tmp_path); tokenizer.save_pretrained(tmp_path)
    loaded_model, loaded_tok = load_model_and_tokenizer(str(tmp_path))
    assert all_equal_params(loaded_model, model) and not loaded_model.training
    # transformers picks the tokenizer class from the model type (a Qwen2 folder gets Qwen2Tokenizer, whose own
    # pre-tokenizer splits digits one by one): the loaded tokenizer must still cut every text as the saved one does
    assert loaded_tok.get_vocab() == tokenizer.get_vocab()
    for text in ["the quick fox and the lazy trainer", "what is 12 + 30 ? the answer is 42"]:
        assert loaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"] and len(tokenizer(text)["input_ids"]) > 5
    text = "the quick fox and the lazy trainer"
    assert loaded_tok.decode(loaded_tok(text)["input_ids"]) == text
    policy = load_policy(str(tmp_path), strategy="jet", device="cpu")
    assert policy.spec is STRATEGIES["jet"] and policy.device == torch.device("cpu") and policy.dtype == torch.float32
    assert len(fp8_modules(policy.model)) == N_LINEARS
    assert all_equal_params(policy.model, model)                      # converted in place, weights untouched
    assert policy.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]

def test_local_folder_keeps_jetrls_digit_tokenizer(tmp_path):
    "A Qwen2 folder saved with jetrl's digit-by-digit BPE (the reproduction's SFT base) loads that BPE, not Qwen2's splitter."
    from jetrl.policy import tokenizer_file_mismatch
    from jetrl.tiny import build_tokenizer
    chains = ["Start with 13. Subtract 15. Add 90.\nAnswer: 13 - 15 = -2\n-2 + 90 = 88\n<answer>88</answer>",
              "Start with 7. Add 45. Put the final answer in <answer></answer>.\nAnswer: 7 + 45 = 52"] * 8
    tokenizer = build_tokenizer(chains, vocab_size=VOCAB)
    tiny_model("qwen2").save_pretrained(tmp_path); tokenizer.save_pretrained(tmp_path)
    _, loaded = load_model_and_tokenizer(str(tmp_path))
    assert tokenizer_file_mismatch(loaded, tmp_path) == []
    for text in chains[:2] + [" -2 - 90 = -92\n<answer>-92</answer>"]:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (tokenizer.eos_token_id, tokenizer.pad_token_id, "left")
    assert loaded.chat_template == tokenizer.chat_template
    from transformers import AutoTokenizer                                  # what transformers alone would have given
    assert "pre_tokenizer" in tokenizer_file_mismatch(AutoTokenizer.from_pretrained(tmp_path), tmp_path)

def test_load_policy_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    no_tokenizer = tmp_path / "no_tok"
    tiny_model().save_pretrained(no_tokenizer)
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"): load_policy(str(no_tokenizer), device="cpu")
    for missing in [str(tmp_path / "missing"), "./no/such/model", "no-such-org/no-such-model"]:
        with pytest.raises(FileNotFoundError, match="not a local model folder"): load_policy(missing, device="cpu")
    with pytest.raises(ValueError, match="Unknown strategy 'fp4'"): load_policy(str(no_tokenizer), strategy="fp4")

# ---- per-token log-probs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_by_hand(temperature):
    "log_softmax of the model's own logits, gathered at the next token: the same ops, so exactly equal."
    model = tiny_model("qwen2", tie=False)
    ids, _ = left_padded_batch()
    with torch.no_grad(): logits = model(ids).logits                                  # (B, T, V)
    hand = torch.stack([torch.stack([torch.log_softmax(logits[b, t].float() / temperature, -1)[ids[b, t + 1]]
                                     for t in range(ids.shape[1] - 1)]) for b in range(ids.shape[0])])   # (B, T-1)
    with torch.no_grad(): out = token_log_probs(model, ids, temperature=temperature)
    assert out.shape == (3, 19) and out.dtype == torch.float32
    torch.testing.assert_close(out, hand, rtol=0, atol=1e-6)   # measured: 0 (one fp32 ulp at |log p| ~ 6 is 5e-7)
    assert (out < 0).all()

@pytest.mark.parametrize("family, tie", MODELS, ids=MODEL_IDS)
def test_left_padding_changes_nothing(family, tie):
    """The log-probs of a left-padded row equal those of the same row alone. Tolerance 1e-5 (fp32): the padded and
    unpadded rows go through GEMMs and softmaxes of different lengths, so sums are reordered (measured max 5e-7,
    one ulp of a log-prob ~6); a pad leaking into attention moves them by > 1e-3 (checked below)."""
    model = tiny_model(family, tie)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        padded = token_log_probs(model, ids, mask)
        for row, pad in ((0, 0), (1, 5), (2, 9)):
            alone = token_log_probs(model, ids[row:row + 1, pad:])
            torch.testing.assert_close(padded[row:row + 1, pad:], alone, rtol=0, atol=1e-5)
        leaked = token_log_probs(model, ids)                                            # pads not masked
        assert (leaked[2:, 9:] - padded[2:, 9:]).abs().max() > 1e-3


@pytest.mark.parametrize("strategy, moves", [("bf16", True), ("fp8-rollout", True), ("jet", False), ("jet-fp8kv", False)])
def test_a_bf16_trainer_moves_rows_left_with_the_same_log_probs_and_gradients(strategy, moves, monkeypatch):
    """A trainer that need not give the engine's bits (BF16 linears) moves each row left to its first token and attends
    with plain causal kernels (`trainer_moves_rows_left`); a unified-FP8 one never does. Moved or not, the log-probs and
    the gradients of the real tokens are the same function (fp32 on the CPU: within 1e-5; a row moved by a wrong amount,
    or a pad seen as a key, moves them by > 1e-3, checked below)."""
    from jetrl.forward import trainer_moves_rows_left
    policy = Policy(tiny_model("qwen2", False), None, strategy, device="cpu")
    ids, mask = left_padded_batch()
    ids, mask = ids.clone(), mask.clone()
    ids[0, 17:], mask[0, 17:] = 0, 0                                     # right padding too, as a rollout's rows have
    assert trainer_moves_rows_left(policy.model, mask.bool()) == moves
    holes = mask.clone(); holes[0, 8] = 0                                 # a row that is not one run: never moved
    assert not trainer_moves_rows_left(policy.model, holes.bool())
    real = mask[:, 1:].bool() & mask[:, :-1].bool()                       # real tokens predicted from real ones
    def log_probs_and_grads(matches_engine):
        policy.model.jetrl_trainer_matches_engine = matches_engine
        policy.model.zero_grad()
        lp = train_log_probs(policy, ids, mask)
        (lp * real).sum().backward()
        return lp.detach(), [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
    matches = policy.model.jetrl_trainer_matches_engine
    moved, masked = log_probs_and_grads(matches), log_probs_and_grads(True)
    torch.testing.assert_close(moved[0][real], masked[0][real], rtol=0, atol=1e-5)
    for a, b in zip(moved[1], masked[1]): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    policy.model.jetrl_trainer_matches_engine = matches
    if moves:                                           # the check has teeth: rows moved one column too few
        import jetrl.forward as forward
        real_moves = forward.rows_moved_left
        one_short = lambda valid: tuple((m - 1) % m.shape[1] for m in real_moves(valid))
        monkeypatch.setattr(forward, "rows_moved_left", one_short)
        with torch.no_grad(): wrong = train_log_probs(policy, ids, mask)
        assert (wrong[real] - masked[0][real]).abs().max() > 1e-3


def test_graphed_log_probs_explain_what_they_need():
    "CUDA graphs need a GPU model: on the CPU a clear error that names the eager function to call instead."
    from jetrl.policy import GraphedLogProbs
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=64))
    with pytest.raises(ValueError, match="on cpu: call token_log_probs"):
        GraphedLogProbs(model)


def test_graphed_log_probs_drop_captures_whose_tensors_were_replaced():
    """A capture replays the addresses it was made with (simulated on the CPU: a capture here is a replay stub). An
    update in place keeps the captures, and so does an unpinned Dgrad copy (an eager backward's); a parameter assigned
    anew, a pinned Dgrad copy in another buffer or a recipe changed (new FP8 tensors) drops them all, and the next
    call captures again from the new tensors."""
    import weakref
    from jetrl.policy import GraphedLogProbs
    from jetrl.linear import set_recipe
    policy = Policy(tiny_model(), None, "jet", device="cpu")
    graphed = GraphedLogProbs.__new__(GraphedLogProbs)                 # GraphedLogProbs(model) wants a GPU model
    graphed._attach(policy.model, width_bucket=8, max_captures=4)
    captures = []
    def capture(ids, mask, grad, temperature, with_entropy):
        captures.append(graphed._addresses())                          # what this capture would read
        return lambda ids, mask, columns: token_log_probs(graphed.model, ids, mask)[:, :columns]
    graphed._capture = capture
    ids, mask = left_padded_batch()
    with torch.no_grad():
        first = graphed(ids, mask)
        # the stub runs the bucket's padded width: on the CPU another matmul shape, so fp32 roundings may differ
        torch.testing.assert_close(first, token_log_probs(policy.model, ids, mask), rtol=0, atol=1e-5)
        graphed(ids, mask)
        assert len(captures) == 1                                       # one shape, one capture
        for p in policy.model.parameters(): p.add_(1e-3)                # an optimizer step: in place
        graphed(ids, mask)
        assert len(captures) == 1 and graphed._addresses() == captures[0]
        layer = policy.model.model.layers[0].mlp.up_proj
        layer.weight = nn.Parameter(layer.weight.detach().clone())      # a parameter assigned anew
        graphed(ids, mask)
        assert len(captures) == 2 and captures[1] != captures[0]
        w = graphed._fp8[0]._synced[2].data                             # Dgrad's transposed copy cached on the bytes:
        w._jetrl_dgrad_bytes = (w._version, torch.empty(3), None)       # an eager backward's, unpinned: read by no capture
        graphed(ids, mask)
        assert len(captures) == 2
        w._jetrl_dgrad_bytes = (w._version, torch.empty(3), weakref.WeakSet([graphed]))   # pinned for these captures,
        graphed(ids, mask)                                                                # now in another buffer
        assert len(captures) == 3
        set_recipe(policy.model, "rowwise")                             # new FP8 weights and scales
        graphed(ids, mask)
        assert len(captures) == 4 and len(graphed._graphs) == 1


def test_graph_gradients_accumulate_over_micro_batches():
    """A graphed backward hands out its own gradient buffer (detached, as torch.cuda.make_graphed_callables does) and
    rewrites it at every replay. With `.grad` unset, autograd takes that buffer over as `.grad`, and two micro-batches
    of one capture summed to twice the second (found in review, on the H200's path). GraphedLogProbs allocates the
    gradients first (`_grads_allocated`): they must sum to g1 + g2."""
    from jetrl.logprobs import _grads_allocated
    weight = torch.nn.Parameter(torch.zeros(3))
    static_grad = torch.zeros(3)                         # the capture's gradient buffer, rewritten by every replay
    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w, g): ctx.g = g; return w.detach().sum()
        @staticmethod
        def backward(ctx, dy):
            static_grad.copy_(ctx.g); return static_grad.detach(), None
    for g in (torch.tensor([1., 2., 3.]), torch.tensor([10., 20., 30.])):
        _grads_allocated([weight])
        Replayed.apply(weight, g).backward()
    assert torch.equal(weight.grad, torch.tensor([11., 22., 33.])), weight.grad
    assert weight.grad.data_ptr() != static_grad.data_ptr()


def test_a_live_eager_graph_is_found_before_a_capture():
    """What GraphedLogProbs checks before a backward capture on torch < 2.12 (a capture that met the accumulators of a
    live eager graph failed on the H200 and broke the CUDA context): the parameters a live autograd graph holds, none
    once it is freed or detached, and none for the accumulators a capture holds (tagged after it)."""
    from jetrl.logprobs import _held_by_eager_graphs, _grad_accumulator
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    assert _held_by_eager_graphs(model) == []
    loss = model(torch.randn(3, 4)).square().sum()
    assert _held_by_eager_graphs(model) == ["0.weight", "0.bias", "1.weight"]
    loss.backward()
    assert _held_by_eager_graphs(model) == ["0.weight", "0.bias", "1.weight"]      # backward frees buffers, not nodes
    kept = loss.detach(); del loss
    assert _held_by_eager_graphs(model) == []
    captured = model(torch.randn(3, 4))                                           # as a capture's static outputs
    for p in model.parameters():
        if p.requires_grad: _grad_accumulator(p).metadata["jetrl_captured"] = True
    assert _held_by_eager_graphs(model) == [] and captured.grad_fn is not None


def test_graphed_log_probs_refuse_a_sharded_model():
    "FSDP2 gathers weights in hooks, which a replayed graph would skip: a clear error (run apart: it needs a process group)."
    import socket, subprocess, sys, textwrap
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]
    script = textwrap.dedent(f"""
        import os, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import Qwen2Config, Qwen2ForCausalLM
        from jetrl.policy import GraphedLogProbs
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
        fully_shard(model)
        try: GraphedLogProbs(model)
        except ValueError as e: print("REFUSED:", e)
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REFUSED:" in done.stdout and "sharded with FSDP" in done.stdout, done.stdout + done.stderr[-2000:]


def test_temperature_log_softmax_is_the_fp32_log_softmax():
    "The upcast-first formula, bit for bit; at temperature 1 without the division (x / 1 is x exactly)."
    from jetrl.kernels import temperature_log_softmax
    logits = (torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    got = temperature_log_softmax(logits)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.log_softmax(logits.float() / 1.0, -1))
    assert torch.equal(temperature_log_softmax(logits, 0.7), torch.log_softmax(logits.float() / 0.7, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampler_and_trainer_log_probs_are_the_same_bits(dtype, temperature):
    "sample_next's log-prob of the token it picks equals the trainer's head log-prob of that token, every bit."
    from jetrl.logprobs import _head_log_probs
    from jetrl.sampling import sample_next, SamplingParams
    logits = (torch.randn(6, 777, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    for params in (SamplingParams(temperature=temperature, seed=0), SamplingParams(temperature=temperature, seed=0, top_k=777)):
        tokens, sampled = sample_next(logits, params, torch.Generator().manual_seed(0))
        trainer, _ = _head_log_probs(nn.Identity(), logits, tokens, temperature, False)
        assert torch.equal(sampled, trainer), (dtype, temperature, params.top_k)


def test_padding_moves_wgrad_groups_not_bf16():
    """Why the trainer's CUDA graphs (which pad a call's width to a bucket) give jet other gradients than an unpadded
    eager call: Wgrad quantizes activations in groups of 128 tokens along the flattened batch, and padding each row moves
    the groups' edges. The log-probs stay the same (bits, on a GPU's row-invariant kernels); bf16's gradients move by
    float rounding only."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)
    base = Qwen2ForCausalLM(config).float()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 512, (4, 100), generator=g); mask = torch.ones_like(ids); mask[0, :13] = 0
    pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], 28)], dim=1)                 # 100 -> 128 tokens, masked out
    def run(strategy, ids, mask):
        model = Qwen2ForCausalLM(config).float(); model.load_state_dict(base.state_dict())
        policy = Policy(model, None, strategy, device="cpu"); policy.model.train()
        logp = token_log_probs(policy.model, ids, mask)[:, :99]
        weights = mask[:, 1:100].float()
        ((logp * weights).sum() / weights.sum()).backward()
        return logp.detach(), {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    worst = {}
    for strategy in ("bf16", "jet"):
        (logp, grads), (logp_padded, grads_padded) = run(strategy, ids, mask), run(strategy, pad(ids), pad(mask))
        assert (logp - logp_padded).abs().max() <= 1e-4, strategy     # the forward never reads the padding (the CPU's
                                                                         # matmuls may round other widths differently)
        worst[strategy] = max(((grads[n] - grads_padded[n]).norm() / grads[n].norm()).item() for n in grads)
    assert worst["bf16"] <= 1e-5, worst                                    # float rounding only
    assert 1e-3 <= worst["jet"] <= 6e-2, worst                            # FP8 noise: other tokens share a Wgrad scale
