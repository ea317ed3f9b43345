"""Rollout throughput: jetrl's engine vs `transformers.generate`, same model, same settings, one run.

    python benchmarks/rollout.py --model jetrl-tiny --batch 32 --prompt-len 32 --new-tokens 64
    python benchmarks/rollout.py --model smollm2-135m --batch 16 --prompt-len 64 --new-tokens 64
    python benchmarks/rollout.py --device cuda --model qwen2-0.5b --batch 64 --prompt-len 128 --new-tokens 256

Prompts are random token ids of one length; both sides sample (temperature 1, no truncation) and ignore EOS,
so both generate exactly batch x new-tokens tokens. Prints one JSON object per configuration.
"""
import argparse, json, platform, statistics, sys, time
import torch

from jetrl.policy import Policy, load_model_and_tokenizer
from jetrl.rollout import RolloutEngine, SamplingParams

RANDOM_MODELS = {  # random weights, real shapes (no download): Qwen2-0.5B and a 7B Llama-like shape
    "qwen2-0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=26, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def build(name: str, dtype):
    if name in RANDOM_MODELS:
        from transformers import Qwen2Config, Qwen2ForCausalLM, PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models
        cfg = dict(RANDOM_MODELS[name]); cfg.pop("family")
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2ForCausalLM(Qwen2Config(**cfg, eos_token_id=0, pad_token_id=0)).to(dtype)
        vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                            eos_token="t0", pad_token="t0")
        return model.eval(), tokenizer
    model, tokenizer = load_model_and_tokenizer(name, dtype)
    return model, tokenizer


def tokens_per_s(fn, tokens: int, reps: int, device) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda": torch.cuda.synchronize()
        t0 = time.perf_counter(); fn()
        if device.type == "cuda": torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="jetrl-tiny", help="jetrl-tiny, smollm2-135m, a local folder, or " + ", ".join(RANDOM_MODELS))
    p.add_argument("--strategy", default="bf16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads: torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = build(args.model, dtype)
    policy = Policy(model, tokenizer, args.strategy, device=device)
    engine = RolloutEngine(policy, chat_template=False)
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    prompt_ids = torch.randint(10, vocab, (args.batch, args.prompt_len))
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    tokens = args.batch * args.new_tokens

    def run_engine(): return engine.generate(prompt_ids.tolist(), params)
    hf_model = policy.rollout_model
    hf_inputs = dict(input_ids=prompt_ids.to(device), attention_mask=torch.ones_like(prompt_ids).to(device))

    @torch.no_grad()
    def run_hf():
        return hf_model.generate(**hf_inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=engine.pad_id)
    run_engine(); run_hf()                                    # warm-up
    engine_tps = tokens_per_s(run_engine, tokens, args.reps, device)
    hf_tps = tokens_per_s(run_hf, tokens, args.reps, device)
    row = dict(model=args.model, strategy=args.strategy, device=str(device), dtype=str(dtype).removeprefix("torch."),
               batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
               engine_tokens_per_s=round(engine_tps, 1), hf_tokens_per_s=round(hf_tps, 1),
               speedup_vs_hf=round(engine_tps / hf_tps, 2), threads=torch.get_num_threads(), torch=torch.__version__,
               command="python benchmarks/rollout.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
