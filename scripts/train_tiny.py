"""Train jetrl's tiny policy end to end and write its assets (see nbs/02b_tiny.ipynb).

The shipped weights in jetrl/assets/tiny/ were produced, on a 2-core CPU, by:

    python scripts/train_tiny.py --seed 0

Steps: build the byte-level BPE tokenizer from task text, initialise the tiny Qwen2, supervised fine-tuning on
the training mix, greedy evaluation on each level, save model + tokenizer + training.json.
"""
import argparse, platform, shlex, sys, time
from pathlib import Path

import torch
import transformers

from jetrl.tiny import (EVAL_SEED, LEVELS, TINY_DIR, TRAIN_MIX, build_tokenizer, evaluate, level_rows, new_tiny_model,
                        save_tiny, tokenizer_texts, train_sft)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the tokenizer text and the init (< 1000)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay to a tenth)")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--eval-n", type=int, default=200, help="prompts per level")
    parser.add_argument("--eval-seed", type=int, default=EVAL_SEED)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=TINY_DIR, help="folder for the assets")
    args = parser.parse_args(argv)
    if not 0 <= args.seed < 1000: parser.error("--seed must be in [0, 1000): training task seeds are 1000 * seed + i")
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    # tokenizer and a fresh model
    tokenizer = build_tokenizer(tokenizer_texts(seed=args.seed))
    model = new_tiny_model(seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} ids; model: {n_params:,} parameters", flush=True)
    # supervised fine-tuning
    losses = train_sft(model, tokenizer, args.steps, args.batch_size, args.lr, seed=args.seed,
                       warmup_steps=args.warmup_steps, threads=args.threads,
                       log=lambda line: print(line, flush=True))
    train_seconds = time.perf_counter() - start
    # greedy evaluation per level
    results = {level: evaluate(model, tokenizer, level_rows(level, args.eval_n, args.eval_seed)) for level in LEVELS}
    for level, result in results.items():
        print(f"{level:7s} accuracy {result['accuracy']:.3f}  format {result['format_rate']:.3f}  "
              f"e.g. {result['examples'][0]['completion']!r} (answer {result['examples'][0]['answer']})")
    # save
    final_loss = sum(losses[-50:]) / len(losses[-50:])
    training = {
        "command": "python scripts/train_tiny.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "threads": args.threads,
        "train_wall_time_s": round(train_seconds, 1), "total_wall_time_s": round(time.perf_counter() - start, 1),
        "final_loss": round(final_loss, 4), "final_loss_note": "mean completion-token loss of the last 50 steps",
        "eval": {"n_per_level": args.eval_n, "seed": args.eval_seed, "greedy": True, "reward": "number_reward"},
        "accuracy": {level: result["accuracy"] for level, result in results.items()},
        "format_rate": {level: result["format_rate"] for level, result in results.items()},
        "levels": {level: [repr(task) for task in tasks] for level, tasks in LEVELS.items()},
        "train_mix": [[weight, repr(task)] for weight, task in TRAIN_MIX],
        "n_parameters": n_params, "vocab_size_used": len(tokenizer),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
    folder = save_tiny(model, tokenizer, args.out, training)
    print(f"wrote {folder} in {training['total_wall_time_s']} s", flush=True)


if __name__ == "__main__":
    main()
