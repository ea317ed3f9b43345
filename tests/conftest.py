"""Shared fixtures and helpers: a small random causal LM saved as a model folder (built offline in a second), and the
comparison of jet's gradient with bf16's on one rollout that tests/test_train.py (CPU) and tests/test_gpu.py share."""
import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jetrl.tasks import ArithmeticTask


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    "A random Llama with a byte-level BPE tokenizer that can write arithmetic answers, saved as a model folder."
    rows = ArithmeticTask(digits=2).sample(100)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r["prompt"] + " <answer>" + r["answer"] + "</answer>" for r in rows],
                            trainers.BpeTrainer(vocab_size=384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=["<pad>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128))
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder); tokenizer.save_pretrained(folder)
    return str(folder)


# jet's gradient norm over bf16's, per module, on one rollout both train on: FP8's noise moves it by a few percent
# (3% at most at the 0.5B shape on the CPU); a bug that loses or scales a gradient moves it by far more
JET_GRAD_NORM_RATIO = (0.75, 1.33)


def gradient_norms_on_one_rollout(policies: dict, prompts: list, new_tokens: int, micro_batch_size: int,
                                  cuda_graphs: bool = False) -> tuple[dict, dict]:
    """Each policy's gradient after `optimize` (as a GRPO step runs it: micro-batches, the trainer's graphs where
    `cuda_graphs`) on one rollout of the first policy's engine, the same advantages for all: (per-module norms by
    strategy, the step's `grad_norm` by strategy). The optimizer's learning rate is negligible; its step leaves `.grad`."""
    from jetrl.grpo import GRPOConfig
    from jetrl.rollout import RolloutEngine, SamplingParams
    from jetrl.train import TrainConfig, start_run, trainer_log_probs, optimize
    first = next(iter(policies.values()))
    group = 4
    rollout = RolloutEngine(first, chat_template=False).generate(
        prompts, SamplingParams(n=group, max_new_tokens=new_tokens, seed=0, ignore_eos=True))
    advantages = torch.linspace(-1, 1, len(rollout), device=first.device)
    norms, step_norms = {}, {}
    for strategy, policy in policies.items():
        config = TrainConfig(strategy=strategy, steps=1, prompts_per_step=len(prompts), grpo=GRPOConfig(num_generations=group),
                             max_new_tokens=new_tokens, micro_batch_size=micro_batch_size, lr=1e-30, max_grad_norm=math.inf,
                             cuda_graphs=cuda_graphs)          # no clipping: each strategy's gradient as it came
        run = start_run(config, policy=policy)
        old_logp = trainer_log_probs(policy, rollout, 1.0, micro_batch_size, log_probs=run.log_probs)
        step_norms[strategy] = optimize(run, rollout, old_logp, advantages)["grad_norm"]
        norms[strategy] = {name: p.grad.detach().float().norm().item() for name, p in policy.model.named_parameters()
                           if p.grad is not None}
    return norms, step_norms


def gradient_ratio_problems(norms: dict, step_norms: dict, strategy: str = "jet", reference: str = "bf16") -> list[str]:
    "The modules (and the step's whole gradient) whose norm under `strategy` over `reference`'s leaves JET_GRAD_NORM_RATIO."
    low, high = JET_GRAD_NORM_RATIO
    ratios = {"(the step's grad_norm)": step_norms[strategy] / step_norms[reference]}
    ratios |= {name: norms[strategy][name] / max(norms[reference][name], 1e-30) for name in norms[reference]}
    return [f"{name}: {ratio:.3f}" for name, ratio in ratios.items() if not low <= ratio <= high]
