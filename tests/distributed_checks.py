"""Run on every rank (torchrun, or processes given RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): one jet step
on jetrl-tiny, then the weight sync both ways (FP8 from the owning shards, high precision gathered then quantized),
checking that each rank's rollout copy holds the trainer's FP8 bytes; prints one JSON line per format on rank 0.
Then, with --die-at-step S, a run in which rank 1 exits at step S: rank 0 must stop with RankLostError (printed)."""
import argparse, json, os, sys, time
import jetrl.distributed as jd
from jetrl.grpo import GRPOConfig
from jetrl.train import TrainConfig

p = argparse.ArgumentParser()
p.add_argument("--die-at-step", type=int, default=None)
args = p.parse_args()
config = TrainConfig(model="jetrl-tiny", strategy="jet", steps=3, prompts_per_step=4, grpo=GRPOConfig(num_generations=4),
                     max_new_tokens=8)
world = jd.init_world()
run = jd.start_distributed_run(config, world)
jd.grpo_step(run, 0, world)
for sync_format in jd.SYNC_FORMATS:
    for repeat in range(2):                                      # the first call of each format warms up
        report = jd.sync_rollout_weights(run.policy, world, sync_format)
    layers = jd.rollout_matches_trainer(run.policy)
    if world.is_main:
        print(json.dumps({"sync_format": sync_format, "world_size": world.size, "fp8_layers": layers, "sync_bytes": report.bytes,
                          "layer_bytes": report.layer_bytes, "sync_s": round(report.seconds, 4)}), flush=True)
if args.die_at_step is None: sys.exit(0)

step_once = jd.grpo_step
def dying_step(run, step, world, *a, **k):
    if world.rank == 1 and step == args.die_at_step: os._exit(3)
    return step_once(run, step, world, *a, **k)
jd.grpo_step = dying_step
start = time.perf_counter()
try:
    jd.train_distributed(config)
except jd.RankLostError as e:
    print(f"RankLostError after {time.perf_counter() - start:.1f}s: {e}", flush=True)
    sys.exit(0)
print("no error", flush=True); sys.exit(1)
