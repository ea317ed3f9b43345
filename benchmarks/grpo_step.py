"""The GRPO step on a GPU, per precision strategy and kernel mode, side by side in one run: jetrl's headline benchmark.

    python -m benchmarks grpo_step --model qwen2-7b --strategies bf16,jet --prompts 16 --micro-batch 16 \
        --out benchmarks/results/grpo_step_h200.jsonl
    python -m benchmarks grpo_step --model qwen2-0.5b --strategies bf16,jet --no-cuda-graphs \
        --out benchmarks/results/grpo_step_h200.jsonl      # the eager trainer (host-bound at 0.5B; graphs are the default)
    python -m benchmarks grpo_step --model qwen2-7b --strategies jet --prompts 16 --micro-batch 16 \
        --kernels gluon_decode=false                       # one kernel choice against the default
    python -m benchmarks grpo_step --model llama3-8b --strategies bf16 --prompts 8 --samples 8 --new-tokens 4096 \
        --warmup-new-tokens 256 --micro-batch 2 --checkpointing --no-cuda-graphs --release-rollout-memory \
        --out benchmarks/results/grpo_step_h200.jsonl
        # long rollouts: one strategy per call (a 256-token warm-up step, then the timed one); the KV cache (40 GB in
        # BF16) freed for training, whose micro-batches of 2 rows x ~4,650 tokens keep only each layer's input (~2.4 GB)
    torchrun --standalone --nproc-per-node 1 -m benchmarks grpo_step --distributed ...   # FSDP2 over the ranks

One step, timed phase by phase as `jetrl.train` runs it, on a random-weight model of a real shape (no download):
  rollout:  the engine generates samples x new-tokens per prompt (EOS ignored: every row generates the same tokens)
  old_logp: the trainer's log-probs of the same tokens (no grad), in micro-batches
  train:    forward + backward of the GRPO loss in micro-batches (random group advantages: the model has no task),
            then AdamW
  sync:     the rollout side brought up to date (FP8 weights re-quantized)
plus tokens/s, peak GPU memory and the engine-vs-trainer gap of the same step (mean |log p_train - log p_rollout|).
Every (strategy, mode) runs a warm-up step first (CUDA-graph capture), then `--steps` timed steps on the same model
shape, rebuilt from the same seed. Modes: fast (default kernels) and exact (Policy(exact=True): batch-invariant
kernels everywhere, bitwise engine == trainer). Kernel choices: `--kernels name=value,...` (jetrl.options.KernelOptions).
"""
import argparse, gc, sys
import torch

from benchmarks.common import add_output_args, build, emit, make_row, synced_clock
from jetrl.grpo import GRPOConfig, group_advantages, grpo_loss
from jetrl.options import use_kernel_options
from jetrl.policy import Policy, GraphedLogProbs, token_log_probs
from jetrl.rollout import RolloutEngine, SamplingParams, recompute_log_probs, micro_batches


def grpo_step(policy, engine, optimizer, prompts, params, micro_batch: int, generator, sync=None,
              graphed: GraphedLogProbs | None = None, with_entropy: bool = False, world=None) -> dict:
    """One GRPO step; returns its phase times and its engine-vs-trainer gap. `sync`: the weight sync (default the
    policy's). `graphed`: the trainer's log-probs (old ones and the micro-batches' forward + backward) from CUDA graphs.
    `with_entropy`: the old log-probs with each position's entropy, as `jetrl.train` computes them. `world`: under
    torchrun, the ranks (`jetrl.distributed.World`), told before each micro-batch's backward whether it is the last."""
    device, config = policy.device, GRPOConfig(num_generations=params.n)
    t0 = synced_clock(device)
    rollout = engine.generate(prompts, params)                                                   # rollout
    t1 = synced_clock(device)
    old_logp = recompute_log_probs(policy.model, rollout, micro_batch_size=micro_batch, with_entropy=with_entropy,
                                   log_probs=graphed)                                            # trainer log-probs
    if with_entropy: old_logp, _ = old_logp
    t2 = synced_clock(device)
    log_probs = graphed or (lambda ids, mask: token_log_probs(policy.model, ids, mask))
    rewards = torch.randn(len(rollout), generator=generator)
    advantages, _ = group_advantages(rewards, rollout.group.cpu(), "group")
    advantages, P, tokens = advantages.to(device), rollout.prompt_ids.shape[1], float(rollout.completion_mask.sum())
    optimizer.zero_grad(set_to_none=True)
    batches = micro_batches(len(rollout), micro_batch)
    for i, rows in enumerate(batches):                                                          # loss, backward
        if world is not None: world.before_backward(policy.model, i == len(batches) - 1)
        logp = log_probs(rollout.input_ids[rows], rollout.attention_mask[rows])[:, P - 1:]
        loss, _ = grpo_loss(logp, old_logp[rows], rollout.logprobs[rows], advantages[rows], rollout.completion_mask[rows],
                            config, loss_normalizer=tokens)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
    optimizer.step()
    t3 = synced_clock(device)
    sync = (sync or policy.sync_weights)()                                                       # sync
    t4 = synced_clock(device)
    mask = rollout.completion_mask.bool()
    gap = (old_logp - rollout.logprobs).abs()[mask]
    return dict(rollout_s=t1 - t0, old_logp_s=t2 - t1, train_s=t3 - t2, sync_s=t4 - t3, step_s=t4 - t0,
                tokens=int(mask.sum()), logp_abs_diff_mean=float(gap.mean()), logp_abs_diff_max=float(gap.max()),
                exact_fraction=float((gap == 0).float().mean()), sync_bytes=sync.bytes)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks grpo_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--strategies", default="bf16,fp8-rollout,jet")
    p.add_argument("--modes", default="fast", help="comma-separated: fast, exact")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=0, help="keep only this many decoder layers (0: all)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing per decoder layer: a layer keeps only its input for backward and runs its "
                        "forward again there (the same numbers; `activation_memory` shows what each part keeps)")
    p.add_argument("--release-rollout-memory", action="store_true",
                   help="the engine frees its KV cache and graphs after each rollout (TrainConfig.release_rollout_memory): "
                        "their allocation and capture count in the next rollout's time")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    p.add_argument("--warmup-new-tokens", type=int, default=None, metavar="N",
                   help="the warm-up step's new tokens (default --new-tokens): a short warm-up compiles the same kernels "
                        "and allocates AdamW's state; with --release-rollout-memory the timed rollout captures its own graphs")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine runs q/k/v and gate/up as one GEMM each (default: RolloutEngine's, on a GPU on)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="the trainer's log-probs (no grad, and forward + backward) replayed from CUDA graphs (GraphedLogProbs); "
                        "default as jetrl.train: on in one process, off under --distributed")
    p.add_argument("--entropy", action="store_true",
                   help="the old log-probs with each position's entropy, as jetrl.train computes them (its metric and "
                        "top-entropy mask)")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: FSDP2 over the ranks (jetrl.distributed), each rank its block of prompts")
    p.add_argument("--sync-format", default="fp8", choices=("fp8", "hp"), help="--distributed: the weight sync's wire format")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.cuda_graphs and args.distributed:
        p.error("--cuda-graphs replays kernels, not FSDP's hooks: run it without --distributed")
    if args.cuda_graphs is None: args.cuda_graphs = not args.distributed          # jetrl.train's default
    if args.warmup_new_tokens is not None:
        if not 0 < args.warmup_new_tokens <= args.new_tokens:
            p.error(f"--warmup-new-tokens {args.warmup_new_tokens}: give 1 to --new-tokens ({args.new_tokens})")
        if args.warmup_new_tokens < args.new_tokens and (args.cuda_graphs or not args.release_rollout_memory):
            p.error("a warm-up shorter than the timed step leaves graphs of the wrong shape: the timed step would capture "
                    "them inside its time; pass --release-rollout-memory and --no-cuda-graphs with it")
    with use_kernel_options(args.kernels):
        run_all(args, argv)


def run_all(args, argv):
    world = None
    if args.distributed:
        from jetrl.distributed import init_world, shard_policy, sync_rollout_weights, rank_block
        world = init_world()
    device = world.device if world else torch.device("cuda")
    launcher = f"torchrun --standalone --nproc-per-node {world.size} -m benchmarks" if world else "python -m benchmarks"
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    warmup_params = SamplingParams(n=args.samples, max_new_tokens=args.warmup_new_tokens or args.new_tokens, seed=0,
                                   ignore_eos=True)
    for mode in args.modes.split(","):
        for strategy in args.strategies.split(","):
            # what an earlier strategy of this process left allocated (0 unless something outlived it)
            allocated_at_start = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
            if allocated_at_start is not None and (not world or world.is_main):    # said before a step that may not end
                print(f"{strategy} ({mode}): {allocated_at_start:.2f} GB allocated before its model", file=sys.stderr, flush=True)
            model, tokenizer = build(args.model, torch.bfloat16)
            if args.layers: model.model.layers = model.model.layers[:args.layers]; model.config.num_hidden_layers = args.layers
            if args.checkpointing: model.gradient_checkpointing_enable()
            model.train()
            policy = Policy(model, tokenizer, strategy, device=device, exact=mode == "exact")
            sync = None
            if world:                                   # a full rollout copy per rank, then FSDP2: before the optimizer
                shard_policy(policy, world)
                sync = lambda: sync_rollout_weights(policy, world, args.sync_format)
            engine = RolloutEngine(policy, chat_template=False, fuse_projections=args.fuse_projections,
                                   release_after_generate=args.release_rollout_memory)
            optimizer = torch.optim.AdamW(policy.model.parameters(), lr=args.lr)
            prompts = torch.randint(10, model.config.vocab_size, (args.prompts, args.prompt_len),
                                    generator=torch.Generator().manual_seed(1)).tolist()
            if world: prompts = rank_block(prompts, world)[0]
            generator = torch.Generator().manual_seed(2)
            graphed = GraphedLogProbs(policy.model) if args.cuda_graphs else None
            run = lambda params: grpo_step(policy, engine, optimizer, prompts, params, args.micro_batch, generator, sync,
                                           graphed, args.entropy, world)
            warmup = run(warmup_params)                      # captures the engine's graphs (and the trainer's: --cuda-graphs)
            if device.type == "cuda": torch.cuda.reset_peak_memory_stats(device)
            steps = [run(params) for _ in range(args.steps)]
            row = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
            if world:
                row["tokens"] *= world.size                            # every rank generates as many (EOS ignored)
                gaps = world.all_gather_floats([row["logp_abs_diff_mean"], row["logp_abs_diff_max"], row["exact_fraction"]])
                row |= dict(logp_abs_diff_mean=sum(gaps[0::3]) / world.size, logp_abs_diff_max=max(gaps[1::3]),
                            exact_fraction=min(gaps[2::3]), logp_abs_diff_max_by_rank=gaps[1::3])   # every rank's gap
                other = "hp" if args.sync_format == "fp8" else "fp8"    # the other wire format, one sync: its bytes and time
                report = sync_rollout_weights(policy, world, other)
                row |= {f"sync_s_{other}": report.seconds, f"sync_bytes_{other}": report.bytes}
            row |= dict(model=args.model, layers=model.config.num_hidden_layers, strategy=strategy, mode=mode,
                        kv_dtype="fp8" if policy.spec.kv_fp8 else "bf16",
                        prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                        micro_batch=args.micro_batch, checkpointing=args.checkpointing, steps=args.steps,
                        tokens_per_s=row["tokens"] / row["step_s"], rollout_tokens_per_s=row["tokens"] / row["rollout_s"],
                        warmup_step_s=warmup["step_s"], warmup_new_tokens=warmup_params.max_new_tokens,
                        fuse_projections=engine.fuses_projections(),
                        trainer_cuda_graphs=args.cuda_graphs, entropy=args.entropy,
                        release_rollout_memory=args.release_rollout_memory,
                        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                        allocated_at_start_gb=allocated_at_start,
                        gpus=world.size if world else 1, launcher="torchrun" if world else "single",
                        sync_format=args.sync_format if world else None)
            row = make_row("grpo_step", row, argv, device, launcher=launcher)
            if not world or world.is_main: emit(row, args.out)
            del policy, engine, optimizer, model, graphed
            gc.collect()                                # FSDP2's modules and hooks refer to each other: freed by the collector
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
