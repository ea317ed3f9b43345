"""The GRPO step on a GPU, per precision strategy and kernel mode, side by side in one run: jetrl's headline benchmark.

    python benchmarks/grpo_step.py --model qwen2-0.5b --prompts 32 --samples 8 --prompt-len 128 --new-tokens 512 \
        --micro-batch 16 --out benchmarks/results/grpo_step_h200.jsonl
    python benchmarks/grpo_step.py --model qwen2-7b --prompts 16 --samples 8 --prompt-len 128 --new-tokens 512 \
        --micro-batch 4 --checkpointing --out benchmarks/results/grpo_step_h200.jsonl
    python benchmarks/grpo_step.py --model qwen2-0.5b --strategies bf16,jet --micro-batch 64 --checkpointing \
        --out benchmarks/results/grpo_step_h200.jsonl      # issue #11's memory target: micro-batches of 64 rows < 40 GB
    python benchmarks/grpo_step.py --model qwen2-0.5b --strategies bf16,jet --cuda-graphs \
        --out benchmarks/results/grpo_step_h200.jsonl      # the trainer's log-probs from CUDA graphs (host-bound at 0.5B)

One step, timed phase by phase as `jetrl.train` runs it, on a random-weight model of a real shape (no download):
  rollout:  the engine generates samples x new-tokens per prompt (EOS ignored: every row generates the same tokens)
  old_logp: the trainer's log-probs of the same tokens (no grad), in micro-batches
  train:    forward + backward of the GRPO loss in micro-batches (random group advantages: the model has no task),
            then AdamW
  sync:     the rollout side brought up to date (FP8 weights re-quantized)
plus tokens/s, peak GPU memory and the engine-vs-trainer gap of the same step (mean |log p_train - log p_rollout|).
Every (strategy, mode) runs a warm-up step first (CUDA-graph capture), then `--steps` timed steps on the same model
shape, rebuilt from the same seed. Modes: fast (default kernels) and exact (Policy(exact=True): batch-invariant
kernels everywhere, bitwise engine == trainer).
"""
import argparse, gc, json, sys, time
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rollout import build                                          # benchmarks/rollout.py: the random model shapes
from jetrl.grpo import GRPOConfig, group_advantages, grpo_loss
from jetrl.policy import Policy, GraphedLogProbs, token_log_probs
from jetrl.rollout import RolloutEngine, SamplingParams, recompute_log_probs, micro_batches


def timed(device):
    if device.type == "cuda": torch.cuda.synchronize(device)
    return time.perf_counter()


def grpo_step(policy, engine, optimizer, prompts, params, micro_batch: int, generator, sync=None,
              graphed: GraphedLogProbs | None = None, with_entropy: bool = False) -> dict:
    """One GRPO step; returns its phase times and its engine-vs-trainer gap. `sync`: the weight sync (default the
    policy's). `graphed`: the trainer's log-probs (old ones and the micro-batches' forward + backward) from CUDA graphs.
    `with_entropy`: the old log-probs with each position's entropy, as `jetrl.train` computes them."""
    device, config = policy.device, GRPOConfig(num_generations=params.n)
    t0 = timed(device)
    rollout = engine.generate(prompts, params)                                                   # rollout
    t1 = timed(device)
    old_logp = recompute_log_probs(policy.model, rollout, micro_batch_size=micro_batch, with_entropy=with_entropy,
                                   log_probs=graphed)                                            # trainer log-probs
    if with_entropy: old_logp, _ = old_logp
    t2 = timed(device)
    log_probs = graphed or (lambda ids, mask: token_log_probs(policy.model, ids, mask))
    rewards = torch.randn(len(rollout), generator=generator)
    advantages, _ = group_advantages(rewards, rollout.group.cpu(), "group")
    advantages, P, tokens = advantages.to(device), rollout.prompt_ids.shape[1], float(rollout.completion_mask.sum())
    optimizer.zero_grad(set_to_none=True)
    batches = micro_batches(len(rollout), micro_batch)
    for i, rows in enumerate(batches):                                                          # loss, backward
        if hasattr(policy.model, "fsdp_before_backward"): policy.model.fsdp_before_backward(i == len(batches) - 1)
        logp = log_probs(rollout.input_ids[rows], rollout.attention_mask[rows])[:, P - 1:]
        loss, _ = grpo_loss(logp, old_logp[rows], rollout.logprobs[rows], advantages[rows], rollout.completion_mask[rows],
                            config, loss_normalizer=tokens)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
    optimizer.step()
    t3 = timed(device)
    sync = (sync or policy.sync_weights)()                                                       # sync
    t4 = timed(device)
    mask = rollout.completion_mask.bool()
    gap = (old_logp - rollout.logprobs).abs()[mask]
    return dict(rollout_s=t1 - t0, old_logp_s=t2 - t1, train_s=t3 - t2, sync_s=t4 - t3, step_s=t4 - t0,
                tokens=int(mask.sum()), logp_abs_diff_mean=float(gap.mean()), logp_abs_diff_max=float(gap.max()),
                exact_fraction=float((gap == 0).float().mean()), sync_bytes=sync.bytes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
                        "forward again there (the same numbers; benchmarks/activation_memory.py shows what each part keeps)")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--out", default=None)
    p.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine runs q/k/v and gate/up as one GEMM each (default: RolloutEngine's, on a GPU on; "
                        "--no-fuse-projections to compare)")
    p.add_argument("--no-fused-grad", action="store_true",
                   help="the FP8 backward's separate quantizer passes instead of jetrl.grad_kernels' fused ones (to compare)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the trainer's log-probs (no grad, and forward + backward) replayed from CUDA graphs (GraphedLogProbs)")
    p.add_argument("--no-cublas-fprop", action="store_true",
                   help="many-row FP8 GEMMs (the trainer's forward, prefill) on jetrl's Triton kernel at every shape, not "
                        "on cuBLAS where it gives that kernel's bits (jetrl.kernels.cublas_when_same_bits; to compare)")
    p.add_argument("--cublas-decode", action="store_true",
                   help="decode GEMMs of 65-256 rows on cuBLAS too, where it gives the kernel's bits in less GPU time "
                        "(jetrl.kernels.cublas_at_decode; off by default)")
    p.add_argument("--fused-head", action=argparse.BooleanOptionalAction, default=None,
                   help="the head's log-probs, trainer and sampler alike, by jetrl.kernels.selective_log_softmax "
                        "(jetrl.policy.fused_head_log_probs; default: on a GPU; --no-fused-head for torch's formula)")
    p.add_argument("--no-producer-quant", action="store_true",
                   help="FP8 linears quantize their input themselves, not the RMSNorm / SiLU-mul kernels before them "
                        "(jetrl.linear.quantize_in_producers = False; to compare)")
    p.add_argument("--no-rotary-kernel", action="store_true",
                   help="the rotary embedding and its gradient by torch's ops, not by jetrl's kernel "
                        "(jetrl.kernels.rotary_kernel = False; to compare)")
    p.add_argument("--no-dy-producer-quant", action="store_true",
                   help="gate and up quantize their own dy for Dgrad, not the SiLU-mul's backward kernel "
                        "(jetrl.linear.quantize_dy_in_producers = False; to compare)")
    p.add_argument("--no-gluon-decode", dest="gluon_decode", action="store_false",
                   help="decode's long-K FP8 GEMMs (the down projections) by the Triton kernel, not the overlapped Gluon "
                        "kernel (jetrl.kernels.gluon_decode, on by default since session 13; the same bits)")
    p.add_argument("--requantize-launch", type=json.loads, default=None, metavar="JSON",
                   help="Wgrad's requantizer launch, e.g. '{\"form\": \"quads\", \"num_warps\": 4, \"COLS\": 64}' (one of "
                        "jetrl.grad_kernels.REQUANTIZE_CANDIDATES; the same bytes), in place of REQUANTIZE_LAUNCH")
    p.add_argument("--entropy", action="store_true",
                   help="the old log-probs with each position's entropy, as jetrl.train computes them (its metric and "
                        "top-entropy mask)")
    p.add_argument("--no-fused-entropy", action="store_true",
                   help="--entropy: by torch's formula rather than jetrl.kernels.softmax_entropy's kernel "
                        "(jetrl.kernels.fused_entropy = False; to compare)")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: FSDP2 over the ranks (jetrl.distributed), each rank its block of prompts")
    p.add_argument("--sync-format", default="fp8", choices=("fp8", "hp"), help="--distributed: the weight sync's wire format")
    args = p.parse_args(argv)
    if args.cuda_graphs and args.distributed:
        p.error("--cuda-graphs replays kernels, not FSDP's hooks: run it without --distributed")
    if args.no_fused_entropy and not args.entropy:
        p.error("--no-fused-entropy times torch's entropy formula: add --entropy (the old log-probs with the entropy)")
    if args.no_fused_grad:
        from jetrl.grad_kernels import fused_grad_quantizers
        fused_grad_quantizers(False).__enter__()                     # for the whole process
    import jetrl.kernels
    jetrl.kernels.cublas_when_same_bits = not args.no_cublas_fprop
    jetrl.kernels.cublas_at_decode = args.cublas_decode
    jetrl.kernels.rotary_kernel = not args.no_rotary_kernel
    jetrl.kernels.fused_entropy = not args.no_fused_entropy
    jetrl.kernels.gluon_decode = args.gluon_decode
    import jetrl.policy, jetrl.linear, jetrl.gluon_kernels, jetrl.grad_kernels
    if args.requantize_launch is not None:
        if args.requantize_launch not in jetrl.grad_kernels.REQUANTIZE_CANDIDATES:
            p.error(f"--requantize-launch {args.requantize_launch} is not one of REQUANTIZE_CANDIDATES (bytes checked by the "
                    f"tests): {jetrl.grad_kernels.REQUANTIZE_CANDIDATES}")
        jetrl.grad_kernels.REQUANTIZE_LAUNCH.clear(); jetrl.grad_kernels.REQUANTIZE_LAUNCH.update(args.requantize_launch)
    jetrl.policy.fused_head_log_probs = args.fused_head
    jetrl.linear.quantize_in_producers = not args.no_producer_quant
    jetrl.linear.quantize_dy_in_producers = not args.no_dy_producer_quant
    world = None
    if args.distributed:
        from jetrl.distributed import init_world, shard_policy, sync_rollout_weights, rank_block
        world = init_world()
    device = world.device if world else torch.device("cuda")
    launch = f"torchrun --standalone --nproc-per-node {world.size} " if world else "python "
    command = launch + "benchmarks/grpo_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    for mode in args.modes.split(","):
        for strategy in args.strategies.split(","):
            model, tokenizer = build(args.model, torch.bfloat16)
            if args.layers: model.model.layers = model.model.layers[:args.layers]; model.config.num_hidden_layers = args.layers
            if args.checkpointing: model.gradient_checkpointing_enable()
            model.train()
            policy = Policy(model, tokenizer, strategy, device=device, exact=mode == "exact")
            sync = None
            if world:                                   # a full rollout copy per rank, then FSDP2: before the optimizer
                shard_policy(policy, world)
                sync = lambda: sync_rollout_weights(policy, world, args.sync_format)
            engine = RolloutEngine(policy, chat_template=False, fuse_projections=args.fuse_projections)
            optimizer = torch.optim.AdamW(policy.model.parameters(), lr=args.lr)
            prompts = torch.randint(10, model.config.vocab_size, (args.prompts, args.prompt_len),
                                    generator=torch.Generator().manual_seed(1)).tolist()
            if world: prompts = rank_block(prompts, world)[0]
            generator = torch.Generator().manual_seed(2)
            graphed = GraphedLogProbs(policy.model) if args.cuda_graphs else None
            run = lambda: grpo_step(policy, engine, optimizer, prompts, params, args.micro_batch, generator, sync, graphed,
                                    args.entropy)
            warmup = run()                                   # captures the engine's graphs (and the trainer's: --cuda-graphs)
            if device.type == "cuda": torch.cuda.reset_peak_memory_stats(device)
            steps = [run() for _ in range(args.steps)]
            row = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
            if world:
                row["tokens"] *= world.size                            # every rank generates as many (EOS ignored)
                other = "hp" if args.sync_format == "fp8" else "fp8"    # the other wire format, one sync: its bytes and time
                report = sync_rollout_weights(policy, world, other)
                row |= {f"sync_s_{other}": report.seconds, f"sync_bytes_{other}": report.bytes}
            row |= dict(model=args.model, layers=model.config.num_hidden_layers, strategy=strategy, mode=mode,
                        prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                        micro_batch=args.micro_batch, checkpointing=args.checkpointing, steps=args.steps,
                        tokens_per_s=row["tokens"] / row["step_s"], rollout_tokens_per_s=row["tokens"] / row["rollout_s"],
                        warmup_step_s=warmup["step_s"], fuse_projections=engine.fuses_projections(),
                        trainer_cuda_graphs=args.cuda_graphs, cublas_fprop=not args.no_cublas_fprop, cublas_decode=args.cublas_decode,
                        fused_head=jetrl.policy.fused_head_active(device), producer_quant=jetrl.linear.quantize_in_producers,
                        rotary_kernel=jetrl.kernels.rotary_kernel, entropy=args.entropy, fused_entropy=jetrl.kernels.fused_entropy,
                        dy_producer_quant=jetrl.linear.quantize_dy_in_producers, gluon_decode=jetrl.kernels.gluon_decode,
                        gluon_decode_launches=jetrl.gluon_kernels.launches,
                        requantize_launch=dict(jetrl.grad_kernels.REQUANTIZE_LAUNCH),
                        # many-row FP8 GEMM keys (shape, row count, dtypes, alignment) seen so far in this process:
                        # on cuBLAS (its bits checked equal) / on jetrl's kernel
                        cublas_shapes=sum(jetrl.kernels._fast_chosen.values()),
                        kernel_shapes=sum(not v for v in jetrl.kernels._fast_chosen.values()),
                        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__, command=command, gpus=world.size if world else 1,
                        launcher="torchrun" if world else "single", sync_format=args.sync_format if world else None)
            row = {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
            if not world or world.is_main:
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")
            del policy, engine, optimizer, model, graphed
            gc.collect()                                # FSDP2's modules and hooks refer to each other: freed by the collector
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
