"""What the trainer's forward keeps for backward: less memory, the same gradients bit for bit."""
import dataclasses
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import jetrl.linear as linear
import jetrl.forward as forward
import jetrl.kernels.mlp as mlp_kernels
from jetrl.linear import saved_activation_bytes
from jetrl.policy import Policy, get_strategy, token_log_probs

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 128, 384, 2, 300
ROWS, SEQ = 3, 40


def make_policy(strategy: str, hp_dtype: str, checkpointing: bool = False) -> Policy:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                         tie_word_embeddings=True)).train()
    if checkpointing: model.gradient_checkpointing_enable()
    return Policy(model, None, dataclasses.replace(get_strategy(strategy), hp_dtype=hp_dtype), device="cpu")


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids); mask[0, :7] = 0                      # a left-padded row
    return ids, mask


def gradients(policy: Policy) -> list[torch.Tensor]:
    ids, mask = batch()
    policy.model.zero_grad(set_to_none=True)
    logp = token_log_probs(policy.model, ids, mask)
    (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
    return [logp.detach()] + [p.grad.clone() for p in policy.model.parameters()]


def autograd_mlp(monkeypatch):
    "The trainer's MLP as before: the model's own module under grad too."
    monkeypatch.setattr(forward, "_mlp", lambda mlp, x, fused=False: mlp(x))


def unshared_inputs(monkeypatch):
    "Each FP8 linear quantizes its input itself, as before (q, k and v: three copies of one input)."
    monkeypatch.setattr(linear, "_shared_input_fp8", lambda x, recipe: None)


def saved(policy: Policy) -> int:
    ids, mask = batch()
    return saved_activation_bytes(lambda: token_log_probs(policy.model, ids, mask), list(policy.model.parameters()))


@pytest.mark.parametrize("strategy, hp_dtype, checkpointing", [("bf16", "float32", False), ("bf16", "bfloat16", True),
                                                             ("jet", "bfloat16", False), ("jet", "float32", True)])
def test_mlp_recompute_gives_the_same_bits(strategy, hp_dtype, checkpointing, monkeypatch):
    ours = gradients(make_policy(strategy, hp_dtype, checkpointing))
    autograd_mlp(monkeypatch); unshared_inputs(monkeypatch)
    reference = gradients(make_policy(strategy, hp_dtype, checkpointing))
    assert len(ours) == len(reference) and all(torch.equal(a, b) for a, b in zip(ours, reference))


@pytest.mark.parametrize("strategy", ["bf16", "jet"])
def test_mlp_recompute_drops_one_intermediate_tensor_per_layer(strategy, monkeypatch):
    ours = saved(make_policy(strategy, "bfloat16"))
    autograd_mlp(monkeypatch)
    before = saved(make_policy(strategy, "bfloat16"))
    silu_output = LAYERS * ROWS * SEQ * INTERMEDIATE * torch.finfo(torch.bfloat16).bits // 8
    assert before - ours == silu_output


def test_no_grad_forward_runs_the_models_own_mlp(monkeypatch):
    """On the CPU, the rollout side (no grad) never enters the recomputing function. (Where Triton runs, no-grad
    forwards run `silu_mul`'s one kernel instead of the model's MLP module, without autograd.)"""
    policy, ids = make_policy("bf16", "float32"), batch()[0]
    calls = []
    monkeypatch.setattr(mlp_kernels._SiLUMulFunction, "apply", lambda *a: calls.append(1))
    with torch.no_grad(): token_log_probs(policy.model, ids)
    assert calls == []


def test_q_k_v_and_gate_up_save_one_fp8_input(monkeypatch):
    "jet: q/k/v share one FP8 copy of their input, gate/up another; before, each linear saved its own."
    ours = saved(make_policy("jet", "bfloat16"))
    unshared_inputs(monkeypatch)
    before = saved(make_policy("jet", "bfloat16"))
    fp8_input = ROWS * SEQ * (HIDDEN + HIDDEN // linear.KERNEL_BLOCK * 4)      # E4M3 bytes + one fp32 scale per 1x128
    assert before - ours == LAYERS * 3 * fp8_input                           # 2 fewer for q/k/v, 1 for gate/up


@pytest.mark.parametrize("strategy", ["bf16", "jet"])
def test_checkpointing_gives_the_same_bits(strategy):
    "`--checkpointing` (issue #11's way under 40 GB): each layer's forward runs again in backward, the same numbers."
    plain, checkpointed = (gradients(make_policy(strategy, "bfloat16", c)) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
