"""The GPU reproduction's GRPO settings, scaled down for a CPU: does the shared learning rate destroy an SFT'd base?

Builds a small base the way `scripts/reproduce.py --preset gpu` builds its 22.8M one (its own `train_base_policy`:
arithmetic chains with worked solutions, a shorter mix), then runs bf16 GRPO with the gpu preset's shared settings
(group 8, 16 prompts/step, dapo, 5 warm-up steps, T = 1, completions ~1.3x the worked solution) at several learning
rates, each from the same base, same seed and prompts, and scores held-out accuracy before and after.

    python benchmarks/reproduce_lr_probe.py --out runs/lr_probe --lrs 1e-4,3e-5,1e-5 --steps 20

Any other shared setting is changed with `--set NAME=VALUE` (repeatable): a TrainConfig field (`prompts_per_step=64`,
`warmup_steps=0`, `temperature=0.7`, `max_grad_norm=0.1`) or a GRPOConfig one prefixed `grpo.` (`grpo.loss_type=grpo`,
`grpo.scale_rewards=none`, `grpo.num_generations=16`, `grpo.num_iterations=2`, `grpo.beta=0.01`). Each setting gets
its own folder under OUT (named by lr and the --set list), so rows of several calls can share OUT and its base.
Appends one row per (lr, seed) to --results (default OUT/probe.jsonl) and prints it; runs already done in OUT are read
back, not redone. A diagnosis tool for the gpu preset's shared settings, not a benchmark.
"""
import argparse, ast, json, shlex, shutil, sys, time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import reproduce as R
from jetrl.train import read_metrics

SMALL_SFT = R.SFTSpec(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate_size=384, max_positions=512,
                      chain_steps=(2, 3, 4), digits=1, steps=800, batch_size=32, lr=3e-3, warmup_steps=40)

def _value(text: str):
    try: return ast.literal_eval(text)
    except (ValueError, SyntaxError): return text                  # a bare word: a string ('grpo', 'none', 'cosine')

def with_settings(train, assignments: list[str]):
    "`train` with each NAME=VALUE applied (grpo.NAME: a GRPOConfig field); returns it and the settings as a dict."
    settings, grpo = {}, {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep: raise SystemExit(f"--set takes NAME=VALUE, got {item!r}")
        settings[name] = _value(text)
        if name.startswith("grpo."): grpo[name[5:]] = settings[name]
    plain = {k: v for k, v in settings.items() if not k.startswith("grpo.")}
    return replace(train, **plain, grpo=replace(train.grpo, **grpo)), settings

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lrs", default="1e-4,3e-5,1e-5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chain-steps", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--sft-steps", type=int, default=SMALL_SFT.steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", type=Path, help="JSONL to append the rows to (default OUT/probe.jsonl)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a shared TrainConfig field, or a GRPOConfig one as grpo.NAME (repeatable)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gpu = R.PRESETS["gpu"]
    sft = replace(SMALL_SFT, steps=a.sft_steps)
    train = replace(gpu.train, task_knobs=(("digits", SMALL_SFT.digits), ("operators", "+-"), ("steps", a.chain_steps)), steps=a.steps,
                    max_new_tokens=a.max_new_tokens, grpo=replace(gpu.train.grpo, max_completion_length=a.max_new_tokens),
                    position_bucket=8, micro_batch_size=0)
    train, settings = with_settings(train, a.set)
    base = a.out / "base"
    start = time.time()
    R.train_base_policy(sft, base, "cpu", float("inf"))
    print(f"base: {time.time() - start:.0f} s, {json.loads((base / 'sft.json').read_text())}", flush=True)
    rows = []
    for lr in [float(x) for x in a.lrs.split(",")]:
        out = a.out / ("_".join([f"lr{lr:g}", *a.set]).replace("/", "-"))
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "base").exists(): (out / "base").symlink_to(base.resolve())
        shared_eval = a.out / f"eval_base_T{train.temperature:g}.json"      # the base's score depends on the sampling temperature
        if shared_eval.exists(): shutil.copy(shared_eval, out / "eval_base.json")
        preset = replace(gpu, name="lr-probe", strategies=("bf16",), seeds=(a.seed,), sft=sft, eval_prompts=a.eval_prompts,
                         train=replace(train, lr=lr))
        t = time.time()
        R.run_all(preset, out, "cpu", float("inf"))
        if not shared_eval.exists(): shutil.copy(out / "eval_base.json", shared_eval)
        folder = R.run_dir(out, "bf16", a.seed)
        history = read_metrics(folder)[1]
        row = {"lr": lr, "seed": a.seed, "settings": settings, "steps": len(history), "model_params": json.loads((base / "sft.json").read_text())["params"],
               "sft_loss_last_100_steps": json.loads((base / "sft.json").read_text())["loss_last_100_steps"],
               "chain_steps": a.chain_steps, "max_new_tokens": a.max_new_tokens, "eval_prompts": a.eval_prompts, "eval_before": json.loads((out / "eval_base.json").read_text())["accuracy"],
               "eval_after": json.loads((folder / "done.json").read_text())["eval_accuracy"],
               "accuracy": [round(m["accuracy"], 3) for m in history],
               "length": [round(m["completions/mean_length"], 1) for m in history],
               "grad_norm": [round(m.get("grad_norm", float("nan")), 3) for m in history],
               "frac_reward_zero_std": [round(m["frac_reward_zero_std"], 3) for m in history],
               "entropy": [round(m["entropy"], 4) for m in history],
               "seconds_this_call": round(time.time() - t, 1), "command": "python benchmarks/reproduce_lr_probe.py " + shlex.join(sys.argv[1:])}
        rows.append(row); print(json.dumps(row), flush=True)
    with open(a.results or a.out / "probe.jsonl", "a") as f: f.write("".join(json.dumps(r) + "\n" for r in rows))

if __name__ == "__main__":
    main()
