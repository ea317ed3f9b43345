"""The embedded rollout engine: against transformers.generate, against the trainer, and its errors."""
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import jetrl.rollout as rollout_module
from jetrl.policy import Policy
from jetrl.rollout import (RolloutEngine, SamplingParams, StaticDecoder, recompute_log_probs, sample_next,
                           static_decode_unsupported)

CORPUS = ["What is 12 + 34? 46. The cat sat on the mat. Stop here. Answer: 7"] * 10
PROMPTS = ["What is 12 + 34?", "The cat", "sat on the mat. The cat sat on", "Answer:"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["<pad>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def make_model(tokenizer, seed=0, eos_boost=1.0, context=256):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=context,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    with torch.no_grad(): model.lm_head.weight[tokenizer.eos_token_id] *= eos_boost
    return model


def hf_greedy(model, tokenizer, prompts, max_new_tokens):
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return out[:, batch["input_ids"].shape[1]:]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("eos_boost", [1.0, 2.5])
def test_greedy_equals_transformers_generate(tokenizer, eos_boost, cache):
    "Exactly HF's tokens, ragged prompts (left padding), with (2.5) and without (1.0) early EOS, both caches."
    model = make_model(tokenizer, eos_boost=eos_boost)
    engine = RolloutEngine(model, tokenizer, chat_template=False, cache_implementation=cache)
    assert engine.cache_implementation == cache
    ours = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=16))
    theirs = hf_greedy(model, tokenizer, PROMPTS, 16)
    for i in range(len(PROMPTS)):
        n = int(ours.completion_lengths[i])
        assert ours.completion_ids[i, :n].tolist() == theirs[i, :n].tolist()
        if ours.finish_reasons[i] == "eos": assert ours.completion_ids[i, n - 1] == tokenizer.eos_token_id
        else: assert n == 16 and ours.finish_reasons[i] == "length"
    if eos_boost > 1: assert "eos" in ours.finish_reasons


def test_padded_batch_widths_give_the_same_rollout(tokenizer):
    "With CUDA graphs, finished rows ride along masked until the live rows fit a power-of-two width: same result."
    words = CORPUS[0].split()
    prompts = [" ".join(words[i:i + 3]) for i in range(9)]
    model = make_model(tokenizer, eos_boost=12)                                    # 9 rows, 4 of them end early
    params = SamplingParams(do_sample=False, max_new_tokens=16)    # greedy: sampling draws depend on the batch width
    exact = RolloutEngine(model, tokenizer, chat_template=False).generate(prompts, params)
    padded_engine = RolloutEngine(model, tokenizer, chat_template=False)
    padded_engine._static = StaticDecoder(model, rows=9, capacity=256)
    padded_engine._static.pad_widths = True
    widths = []
    step = padded_engine._static.step
    padded_engine._static.step = lambda tokens: widths.append(tokens.shape[0]) or step(tokens)
    padded = padded_engine.generate(prompts, params)
    assert torch.equal(exact.completion_ids, padded.completion_ids) and exact.finish_reasons == padded.finish_reasons
    assert torch.allclose(exact.logprobs, padded.logprobs, atol=1e-6)
    assert widths[0] == 9 and set(widths) == {9, 8}                   # narrowed to 8 slots, then dead slots rode along
    assert padded.finish_reasons.count("eos") >= 4


def test_static_and_dynamic_cache_agree_when_sampling(tokenizer):
    model = make_model(tokenizer, eos_boost=2.5)
    params = SamplingParams(n=4, max_new_tokens=20, seed=0)
    static, dynamic = (RolloutEngine(model, tokenizer, chat_template=False, cache_implementation=c).generate(PROMPTS, params)
                       for c in ("static", "dynamic"))
    assert torch.equal(static.completion_ids, dynamic.completion_ids)
    assert (static.logprobs - dynamic.logprobs).abs().max() < 1e-5


def test_unsupported_model_falls_back_to_the_dynamic_cache(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                                      eos_token_id=tokenizer.eos_token_id)).eval()
    assert "gpt2" in static_decode_unsupported(gpt2)
    engine = RolloutEngine(gpt2, tokenizer, chat_template=False)
    assert engine.cache_implementation == "dynamic"
    assert len(engine.generate(PROMPTS[:2], SamplingParams(do_sample=False, max_new_tokens=4))) == 2
    with pytest.raises(ValueError, match="'static' cannot run this model: model_type 'gpt2'"):
        RolloutEngine(gpt2, tokenizer, chat_template=False, cache_implementation="static")
    with pytest.raises(ValueError, match="cache_implementation must be one of"):
        RolloutEngine(gpt2, tokenizer, cache_implementation="paged")


def test_jet_rollout_follows_weight_updates(tokenizer):
    "Under jet the engine reuses its cache (and graphs) across calls; a weight update must reach the next rollout."
    policy = Policy(make_model(tokenizer), tokenizer, "jet")
    engine = RolloutEngine(policy, chat_template=False)
    params = SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    with torch.no_grad():
        for p in policy.model.parameters(): p.mul_(1.5)                          # an in-place update, as an optimizer step
    after = engine.generate(PROMPTS, params)
    fresh = RolloutEngine(Policy(policy.model, tokenizer, "jet"), chat_template=False).generate(PROMPTS, params)
    assert torch.equal(after.completion_ids, fresh.completion_ids) and torch.equal(after.logprobs, fresh.logprobs)
    assert not torch.equal(before.logprobs, after.logprobs)


def test_rows_do_not_influence_each_other(tokenizer):
    "A prompt's greedy completion is the same alone and in a batch where other rows finish early."
    model = make_model(tokenizer, eos_boost=2.5)
    engine = RolloutEngine(model, tokenizer, chat_template=False)
    batch = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=12))
    for i, p in enumerate(PROMPTS):
        alone = engine.generate([p], SamplingParams(do_sample=False, max_new_tokens=12))
        n = int(alone.completion_lengths[0])
        assert batch.completion_ids[i, :n].tolist() == alone.completion_ids[0, :n].tolist()


def test_data_object_layout(tokenizer):
    model = make_model(tokenizer)
    r = RolloutEngine(model, tokenizer, chat_template=False).generate(PROMPTS[:2], SamplingParams(n=3, max_new_tokens=8, seed=0))
    assert len(r) == 6 and r.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.prompts == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert r.input_ids.shape == (6, r.prompt_ids.shape[1] + 8) and r.attention_mask.shape == r.input_ids.shape
    assert (r.logprobs[r.completion_mask == 0] == 0).all() and (r.logprobs[r.completion_mask == 1] <= 0).all()
    assert (r.completion_ids[r.completion_mask == 0] == tokenizer.pad_token_id).all()
    assert r.timing["generated_tokens"] == int(r.completion_mask.sum()) and r.timing["tokens_per_s"] > 0
    assert len(r.completions) == 6 and all(isinstance(t, str) for t in r.completions)


def test_seeded_sampling_is_reproducible(tokenizer):
    engine = RolloutEngine(make_model(tokenizer), tokenizer, chat_template=False)
    a, b = (engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, seed=7)) for _ in range(2))
    c = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, seed=8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_stop_strings_and_ignore_eos(tokenizer):
    model = make_model(tokenizer, eos_boost=2.5)
    engine = RolloutEngine(model, tokenizer, chat_template=False)
    free = engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=16, ignore_eos=True))
    assert free.completion_lengths.tolist() == [16] * len(PROMPTS) and set(free.finish_reasons) == {"length"}
    # stop on a piece of text the first row really generates
    text = free.completions[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"degenerate completion {text!r}"
    stopped = engine.generate(PROMPTS[:1], SamplingParams(do_sample=False, max_new_tokens=16, stop=(stop,), ignore_eos=True))
    assert stopped.finish_reasons == ["stop"] and stop in stopped.completions[0]
    assert int(stopped.completion_lengths[0]) < 16 and text.startswith(stopped.completions[0])


def test_top_k_and_top_p_truncate():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, SamplingParams(top_k=5), gen)
    top5 = logits.topk(5, -1).indices
    assert (top5 == tokens[:, None]).any(-1).all()
    renormalised = torch.log_softmax(logits.gather(-1, top5), -1)                  # log-prob under the truncated distribution
    assert torch.allclose(logp, renormalised[(top5 == tokens[:, None])])
    tokens, _ = sample_next(logits, SamplingParams(top_p=0.5), gen)
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = (order == tokens[:, None]).float().argmax(-1)
    mass_before = torch.stack([sorted_probs[i, :rank[i]].sum() for i in range(64)])
    assert (mass_before < 0.5).all()                                                # only the nucleus is ever sampled


def test_log_probs_match_trainer_per_strategy(tokenizer):
    "bf16: summation order only; jet: median 0, rare FP8 rounding flips; fp8-rollout: every token differs."
    stats = {}
    for strategy in ["bf16", "jet", "fp8-rollout"]:
        policy = Policy(make_model(tokenizer), tokenizer, strategy)
        r = RolloutEngine(policy, chat_template=False).generate(PROMPTS, SamplingParams(n=4, max_new_tokens=20, seed=0))
        with torch.no_grad(): gap = (recompute_log_probs(policy.model, r) - r.logprobs).abs()[r.completion_mask.bool()]
        stats[strategy] = gap
    assert stats["bf16"].max() < 1e-5
    assert stats["jet"].median() < 1e-6 and stats["jet"].mean() < stats["fp8-rollout"].mean() / 20
    assert stats["fp8-rollout"].median() > 1e-3


def test_chat_template_prompts(tokenizer):
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}Q: {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
    engine = RolloutEngine(make_model(tokenizer), tokenizer, chat_template=True)
    r = engine.generate(["What is 12 + 34?"], SamplingParams(do_sample=False, max_new_tokens=2))
    expected = tokenizer("Q: What is 12 + 34? A:", add_special_tokens=False)["input_ids"]
    assert r.prompt_ids[0, r.prompt_mask[0].bool()].tolist() == expected


@pytest.mark.parametrize("bad, message", [
    (dict(n=0), "n \\(samples per prompt\\)"), (dict(temperature=0.0), "temperature must be > 0 when sampling"),
    (dict(temperature=-1.0, do_sample=False), "temperature must be > 0"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_sampling_params(bad, message):
    with pytest.raises(ValueError, match=message): SamplingParams(**bad)


def test_bad_prompts(tokenizer):
    engine = RolloutEngine(make_model(tokenizer, context=24), tokenizer, chat_template=False)
    with pytest.raises(ValueError, match="No prompts"): engine.generate([])
    with pytest.raises(ValueError, match="exceed the model's context of 24"):
        engine.generate(["The cat sat on the mat. " * 3], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="no tokens"): engine.generate([""])
    with pytest.raises(ValueError, match="needs a tokenizer"): RolloutEngine(make_model(tokenizer))


@pytest.mark.parametrize("strategy", ["bf16", "jet"])
def test_decode_step_traces_as_one_graph(tokenizer, strategy):
    "compile=True: the decode step, FP8 linears included, must trace without a graph break (one graph to capture)."
    from jetrl.linear import assume_synced_fp8_weights
    from jetrl.rollout import refresh_fp8_weights
    policy = Policy(make_model(tokenizer), tokenizer, strategy)
    decoder = StaticDecoder(policy.model, rows=4, capacity=128)
    refresh_fp8_weights(policy.model)
    ids = torch.randint(2, len(tokenizer), (4, 8))
    with torch.no_grad():
        decoder.prefill(ids, torch.ones_like(ids), 1)
        with assume_synced_fp8_weights(): explained = torch._dynamo.explain(StaticDecoder._forward_step)(decoder, 4)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def test_stale_fp8_weights_are_never_used_outside_the_engine(tokenizer):
    "Outside the engine's vouching context a changed master weight is re-quantized, never served stale."
    from jetrl.linear import assume_synced_fp8_weights, fp8_modules
    policy = Policy(make_model(tokenizer), tokenizer, "jet")
    layer = next(iter(fp8_modules(policy.model).values()))
    synced = layer.sync_fp8_weight()
    with torch.no_grad(): layer.weight.mul_(2)
    assert not torch.equal(layer.fp8_weight().scale, synced.scale)               # re-quantized: the new scales
    with assume_synced_fp8_weights(): assert layer.fp8_weight() is synced         # the caller vouched: cached
    with pytest.raises(RuntimeError):
        with assume_synced_fp8_weights(): raise RuntimeError("a failing step")
    assert layer.fp8_weight() is not synced                                     # the vouch ended with the block


def test_sliding_window_models_use_the_dynamic_cache(tokenizer):
    "Mistral's window lives in its config: the static forward (full attention) must refuse it, and accept no window."
    from transformers import MistralConfig, MistralForCausalLM
    def mistral(window):
        torch.manual_seed(0)
        return MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, vocab_size=len(tokenizer), sliding_window=window,
                                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    windowed = mistral(4)
    assert "sliding-window" in static_decode_unsupported(windowed)
    assert RolloutEngine(windowed, tokenizer, chat_template=False).cache_implementation == "dynamic"
    full = mistral(None)
    assert static_decode_unsupported(full) is None
    ours = RolloutEngine(full, tokenizer, chat_template=False).generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=8))
    theirs = hf_greedy(full, tokenizer, PROMPTS, 8)
    for i in range(len(PROMPTS)):
        n = int(ours.completion_lengths[i])
        assert ours.completion_ids[i, :n].tolist() == theirs[i, :n].tolist()


def make_qwen(tokenizer, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()


@pytest.mark.parametrize("strategy", ["bf16", "jet", "fp8-rollout"])
def test_fused_projections_match_separate_linears(tokenizer, strategy):
    "q/k/v (with biases) and gate/up as one GEMM each: the same rollout as the separate linears, also after an update."
    from jetrl.rollout import FusedProjection
    policy = Policy(make_qwen(tokenizer), tokenizer, strategy)
    fused, separate = (RolloutEngine(policy, chat_template=False, fuse_projections=f) for f in (True, False))
    params = SamplingParams(do_sample=False, max_new_tokens=10, ignore_eos=True)
    for update in range(2):
        a, b = fused.generate(PROMPTS, params), separate.generate(PROMPTS, params)
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert (a.logprobs - b.logprobs).abs().max() < 1e-4
        with torch.no_grad():
            for p in policy.model.parameters(): p.mul_(1.2)                        # an in-place update, as an optimizer step
    layers = policy.rollout_model.model.layers
    made = sum(hasattr(l.self_attn, "jetrl_fused_qkv") + hasattr(l.mlp, "jetrl_fused_gate_up") for l in layers)
    assert made == 2 * len(layers)                                               # fp8-rollout: its FP8 copy's layers
    if strategy == "jet":                                                         # one GEMM's FP8 weight: the caches side by side
        attn = layers[0].self_attn
        assert torch.equal(attn.jetrl_fused_qkv.weight.view(torch.uint8),
                           torch.cat([m.fp8_weight().data for m in (attn.q_proj, attn.k_proj, attn.v_proj)]).view(torch.uint8))


def test_fused_projections_default_by_device(tokenizer):
    "Fused by default only for FP8 projections on a GPU (measured faster there); on the CPU the engine keeps the separate linears."
    policy = Policy(make_qwen(tokenizer), tokenizer, "jet")
    engine = RolloutEngine(policy, chat_template=False)
    assert engine.fuse_projections is None and engine.fuses_projections() is False
    engine.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=2, ignore_eos=True))
    assert not any(hasattr(l.self_attn, "jetrl_fused_qkv") for l in policy.rollout_model.model.layers)
    assert RolloutEngine(policy, chat_template=False, fuse_projections=True).fuses_projections() is True


def test_fused_projection_refuses_what_cannot_be_laid_side_by_side():
    from jetrl.rollout import FusedProjection
    from jetrl.linear import FP8Linear
    lin = lambda i, o, bias=True: torch.nn.Linear(i, o, bias=bias)
    assert FusedProjection.why_not([lin(8, 8), lin(8, 4)]) is None
    assert "bias" in FusedProjection.why_not([lin(8, 8), lin(8, 4, bias=False)])
    assert "inputs" in FusedProjection.why_not([lin(8, 8), lin(4, 8)])
    assert FusedProjection.why_not([FP8Linear.from_linear(lin(256, 256)), FP8Linear.from_linear(lin(256, 128))]) is None
    assert "blocks" in FusedProjection.why_not([FP8Linear.from_linear(lin(256, 200)), FP8Linear.from_linear(lin(256, 128))])
    assert "recipes" in FusedProjection.why_not([FP8Linear.from_linear(lin(256, 256)),
                                                 FP8Linear.from_linear(lin(256, 128), "tensorwise")])
    assert "not all" in FusedProjection.why_not([FP8Linear.from_linear(lin(256, 256)), lin(256, 128)])


def test_recompute_log_probs_takes_another_forward(tokenizer):
    """A caller's forward (e.g. GraphedLogProbs on a GPU) in place of token_log_probs, given the micro-batch, the
    temperature and with_entropy: the same values."""
    from jetrl.policy import token_log_probs
    policy = Policy(make_model(tokenizer), tokenizer, "jet")
    rollout = RolloutEngine(policy, chat_template=False).generate(PROMPTS[:1], SamplingParams(n=4, max_new_tokens=8, seed=0))
    calls = []
    def forward(ids, mask, temperature, with_entropy):
        calls.append((ids.shape[0], temperature, with_entropy))
        return token_log_probs(policy.model, ids, mask, temperature, with_entropy)
    mine = recompute_log_probs(policy.model, rollout, micro_batch_size=3, log_probs=forward)
    assert calls == [(3, 1.0, False), (1, 1.0, False)]
    assert torch.equal(mine, recompute_log_probs(policy.model, rollout, micro_batch_size=3))
    logp, entropy = recompute_log_probs(policy.model, rollout, 0.7, 3, with_entropy=True, log_probs=forward)
    expected = recompute_log_probs(policy.model, rollout, 0.7, 3, with_entropy=True)
    assert calls[-1] == (1, 0.7, True) and torch.equal(logp, expected[0]) and torch.equal(entropy, expected[1])


@pytest.mark.parametrize("strategy", ["bf16", "jet-fp8kv"])
def test_released_memory_is_allocated_again_with_the_same_rollout(tokenizer, strategy):
    """release_memory frees the static KV cache (and its graphs) and says how many bytes; the next generation
    allocates it again and samples the same tokens with the same log-probs as an engine that kept it. With
    release_after_generate the engine holds nothing between generations."""
    params = SamplingParams(max_new_tokens=12, n=2, seed=3)
    kept = RolloutEngine(Policy(make_model(tokenizer), tokenizer, strategy), chat_template=False)
    released = RolloutEngine(Policy(make_model(tokenizer), tokenizer, strategy), chat_template=False,
                             release_after_generate=True)
    first = kept.generate(PROMPTS, params)
    rows, columns = kept._static.cache.rows, kept._static.cache.capacity
    store = 1 if strategy == "jet-fp8kv" else 4                                  # FP8 codes, or fp32 on the CPU
    per_column = 2 * 2 * 2 * 32 * store + (2 * 2 * 2 * 4 if strategy == "jet-fp8kv" else 0)   # K+V, layers, kv heads, head_dim (+ scales)
    assert kept.held_bytes() == rows * columns * (per_column + 1)               # + the valid mask's byte
    again = kept.generate(PROMPTS, params)
    for engine in (released, released):                                        # twice: allocated again each time
        out = engine.generate(PROMPTS, params)
        assert engine._static is None and engine.held_bytes() == 0
        assert torch.equal(out.completion_ids, again.completion_ids) and torch.equal(out.logprobs, again.logprobs)
    assert torch.equal(first.completion_ids, again.completion_ids)
    import gc, weakref
    held, key_cache = kept.held_bytes(), weakref.ref(kept._static.cache.keys[0])
    gc.disable()                               # freed by the release itself, not by a later run of the cycle collector
    try:
        assert kept.release_memory() == held > 0 and kept.held_bytes() == 0 and kept._static is None
        assert key_cache() is None, "the released cache is still alive"
    finally: gc.enable()
    assert torch.equal(kept.generate(PROMPTS, params).logprobs, again.logprobs)


@pytest.mark.parametrize("strategy", ["bf16", "jet-fp8kv"])
def test_prefill_runs_in_passes_of_whole_rows_within_the_budget(tokenizer, strategy):
    """prefill_tokens splits the prompts into passes of whole rows: here one row a pass (a budget below one prompt's
    tokens still gets its row a pass) and two. Each pass writes its own rows of the cache, FP8 scales included. On the
    CPU, BLAS rounding may move with a GEMM's row count, so the rollout is the one-pass rollout up to that rounding
    (fp32 here: ~1e-6; under FP8 a moved rounding can flip a code, ~1e-3; a pass writing another row's scales: ~0.5);
    on a GPU, jet's invariant kernels make it the same bits (test_gpu's grouped-prefill test)."""
    params = SamplingParams(max_new_tokens=10, n=2, seed=5)
    policy = Policy(make_model(tokenizer), tokenizer, strategy)
    one_pass = RolloutEngine(policy, chat_template=False, prefill_tokens=None).generate(PROMPTS, params)
    longest = max(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    forward = rollout_module.decoder_forward
    for budget, passes in ((1, [1, 1, 1, 1]), (2 * longest, [2, 2]), (None, [4])):
        seen = []
        def counting(model, ids, *args, **kwargs):
            seen.append(ids.shape)
            return forward(model, ids, *args, **kwargs)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rollout_module, "decoder_forward", counting)
            grouped = RolloutEngine(policy, chat_template=False, prefill_tokens=budget).generate(PROMPTS, params)
        assert [rows for rows, columns in seen if columns > 1] == passes            # a decode step: one column
        assert torch.equal(grouped.completion_ids, one_pass.completion_ids)
        torch.testing.assert_close(grouped.logprobs, one_pass.logprobs, rtol=0, atol=1e-5 if strategy == "bf16" else 1e-2)


def test_an_outgrown_cache_is_freed_before_the_larger_one_is_allocated(tokenizer):
    """A generation that needs more rows or columns than the engine's cache holds replaces it; the old cache (and its
    graphs) is gone before the new one is allocated, so the two never share the device's memory."""
    import gc, weakref
    from jetrl.forward import StaticKVCache
    engine = RolloutEngine(Policy(make_model(tokenizer), tokenizer, "jet"), chat_template=False)
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, seed=0))
    old = weakref.ref(engine._static.cache.keys[0])
    alive_at_allocation = []
    allocate = StaticKVCache.allocate.__func__
    def watched(cls, *args, **kwargs):
        alive_at_allocation.append(old() is not None)
        return allocate(cls, *args, **kwargs)
    gc.disable()                                     # freed by the engine itself, not by a later run of the cycle collector
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(StaticKVCache, "allocate", classmethod(watched))
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=200, n=2, seed=0))      # more rows, more columns
    finally: gc.enable()
    assert alive_at_allocation == [False]


@pytest.mark.parametrize("strategy", ["bf16", "jet"])
def test_a_dropped_engine_frees_its_model_and_cache_at_once(tokenizer, strategy):
    """Dropping the last reference to an engine (and its policy) frees the model and the KV cache right away, not at a
    later run of the cycle collector: a benchmark that builds one strategy after another must not hold both at once."""
    import gc, weakref
    policy = Policy(make_model(tokenizer), tokenizer, strategy)
    engine = RolloutEngine(policy, chat_template=False)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=0))
    model, cache = weakref.ref(policy.model), weakref.ref(engine._static.cache.keys[0])
    gc.disable()
    try:
        del policy, engine
        assert model() is None and cache() is None
    finally: gc.enable()


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "16384"])
def test_prefill_tokens_must_be_a_positive_whole_number(tokenizer, bad):
    with pytest.raises(ValueError, match="prefill_tokens must be a whole number of tokens >= 1"):
        RolloutEngine(Policy(make_model(tokenizer), tokenizer, "bf16"), chat_template=False, prefill_tokens=bad)


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_a_cache_too_large_for_the_gpu_is_refused_before_allocation(tokenizer, kv_fp8):
    """On a GPU whose memory left cannot hold the KV cache, `StaticKVCache.allocate` raises torch's OutOfMemoryError
    with the cache's size, the memory left and what to change, before it allocates anything (the device's memory is
    what torch.cuda reports: patched here, so the check runs on any machine); a cache that fits passes the check."""
    from unittest import mock
    from jetrl.forward import StaticKVCache, check_cache_fits
    model = make_model(tokenizer)
    need = StaticKVCache.allocate(model, 64, 4096, "meta", torch.bfloat16, kv_fp8).nbytes     # counted, not allocated
    assert need > 64 * 4096 * 2 * 2 * 32 * 2 * (1 if kv_fp8 else 2)          # keys and values: 2 layers, 2 KV heads of 32
    left = lambda free: dict(mem_get_info=lambda device=None: (free, 80 * 2**30), memory_reserved=lambda device=None: 2**20,
                             memory_allocated=lambda device=None: 0)
    with mock.patch.multiple(torch.cuda, **left(need // 2)), \
         pytest.raises(torch.OutOfMemoryError, match=r"64 rows x 4096 columns needs 0\.\d GiB.*fewer rows") as refused:
        StaticKVCache.allocate(model, 64, 4096, "cuda", torch.bfloat16, kv_fp8=kv_fp8)
    assert ("'jet-fp8kv'" in str(refused.value)) != kv_fp8         # the FP8 hint only for a cache not in FP8 already
    with mock.patch.multiple(torch.cuda, **left(need - 2**20)):     # free plus what the allocator holds unused: enough
        check_cache_fits(need, torch.device("cuda"), "64 rows x 4096 columns", kv_fp8)


def test_an_engine_whose_cache_was_refused_generates_a_smaller_batch(tokenizer, monkeypatch):
    "After a refused cache the engine holds none, and the next, smaller generation allocates one and completes."
    from jetrl.forward import StaticKVCache
    engine = RolloutEngine(Policy(make_model(tokenizer), tokenizer, "jet"), chat_template=False)
    allocate = StaticKVCache.allocate.__func__
    def refuse_many_rows(cls, model, rows, *args, **kwargs):       # as `check_cache_fits` refuses on a full GPU
        if rows > 2: raise torch.OutOfMemoryError(f"The KV cache of {rows} rows needs more than is left")
        return allocate(cls, model, rows, *args, **kwargs)
    monkeypatch.setattr(StaticKVCache, "allocate", classmethod(refuse_many_rows))
    with pytest.raises(torch.OutOfMemoryError, match="KV cache of"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, seed=0))
    assert engine._static is None
    out = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, seed=0))
    assert out.completion_ids.shape == (2, 4)
