"""The GRPO step in one process and under `torchrun` (FSDP2 over the ranks) on 1..N GPUs, same flags, one file.

    python -m benchmarks grpo_step_torchrun --out benchmarks/results/grpo_step_h200_torchrun.jsonl
    python -m benchmarks grpo_step_torchrun --nproc 1,all --parts torchrun --strategies bf16,jet \\
        --out benchmarks/results/grpo_step_h200x8.jsonl          # scaling over every GPU of the host

Runs `python -m benchmarks grpo_step` then, for each process count N of `--nproc`, `torchrun --standalone
--nproc-per-node N -m benchmarks grpo_step --distributed` with the same shape (default the 7B rows of
grpo_step_h200.jsonl with activation checkpointing). Weak scaling: every rank takes `--prompts-per-gpu` prompts, so N
ranks generate and train on N times the rows of one, as more GPUs serve more prompts per step in an RL job.

Every row carries `launcher` ("single" / "torchrun"), `gpus`, `prompts_per_gpu`, `sync_bytes` and `sync_format`; the
torchrun rows also one weight sync in the other wire format (`sync_s_hp`, `sync_bytes_hp`: gathered in high precision,
quantized after) and the engine-vs-trainer gap of every rank (`logp_abs_diff_max_by_rank`). The torchrun rows of
N > 1 get `scaling_efficiency` = their tokens/s / (N x the 1-rank torchrun row's), for the same strategy and mode
(`--nproc` must then include 1). On one GPU the torchrun rows should be within 5% of the single rows' step_s: the
wrapper costs nothing when there is nothing to shard.

A launch that fails or outlasts `--timeout-s` is a finding, not a crash of the driver: its row says `failed`, with
the return code, the ranks' exceptions and the log's last lines (the whole log under `--logs`), and the next launch
runs. NVLink multicast stays off in every launch (`MULTICAST_OFF`). Other grpo_step options (e.g. --kernels, --layers)
follow `--`. Memory: the 7B shape under torchrun on one rank peaked at 94 GB on an H200 (grpo_step_h200_torchrun.jsonl),
more than an 80 GB card holds; there, `-- --layers 14` keeps every size of the run on one shape that fits.
"""
import argparse, json, os, re, signal, subprocess, sys, tempfile
from pathlib import Path

import torch

from benchmarks.common import command_line, emit, make_row

SHAPE = ["--model", "qwen2-7b", "--samples", "8", "--prompt-len", "128", "--new-tokens", "512",
         "--micro-batch", "16", "--checkpointing"]
PROMPTS_PER_GPU = 16              # the 7B rows of grpo_step_h200.jsonl: 16 prompts x 8 samples on one GPU
# NVLink multicast can take a shared host's GPUs out of service: off in NCCL, PyTorch and NVSHMEM for every launch
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOG_TAIL_LINES = 40               # a failed launch's row keeps this many of its log's last lines


def process_counts(spec: str, devices: int) -> list[int]:
    "`--nproc` ('1,2,all') as counts; 'all' is every visible GPU. Each must be >= 1 and at most `devices` where known."
    counts = []
    for part in spec.split(","):
        part = part.strip()
        n = devices if part == "all" else int(part) if part.isdigit() else None
        if part == "all" and devices < 1: raise ValueError("--nproc all: no GPU is visible; give the counts as numbers")
        if n is None or n < 1: raise ValueError(f"--nproc {spec!r}: {part!r} is not a process count (1, 2, ..., or all)")
        if devices and n > devices: raise ValueError(f"--nproc {spec!r}: {n} processes, but this host has {devices} GPUs")
        if n not in counts: counts.append(n)
    return sorted(counts)


def add_scaling(rows: list[dict]) -> list[dict]:
    """Each torchrun row of N > 1 ranks with `scaling_efficiency` against the 1-rank torchrun row of the same strategy
    and mode (None where that row is missing or failed), and `tokens_per_s_per_gpu` on every row that ran."""
    one = {(r["strategy"], r["mode"]): r for r in rows if r.get("launcher") == "torchrun" and r.get("gpus") == 1
           and not r.get("failed")}
    for r in rows:
        if r.get("failed"): continue
        r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / r["gpus"]
        if r.get("launcher") == "torchrun" and r["gpus"] > 1:
            base = one.get((r["strategy"], r["mode"]))
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["gpus"] * base["tokens_per_s"]) if base else None
    return rows


def launch(command: list[str], log: Path, timeout_s: float) -> tuple[int | None, str]:
    "Run `command` with its output in `log`; (return code or None on timeout, the log's last lines)."
    env = os.environ | MULTICAST_OFF | {"PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:               # its own process group: a hung launch is stopped with all its ranks
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try: rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL); proc.wait(); rc = None
    lines = log.read_text(errors="replace").splitlines()
    return rc, "\n".join(lines[-LOG_TAIL_LINES:])


def rank_errors(log_text: str) -> list[str]:
    "The exceptions the ranks raised (`[rankN]: torch.OutOfMemoryError: ...`), each once, in order."
    found = re.findall(r"^(\[rank\d+\]: [\w.]*(?:Error|Exception|Interrupt)\b.*)$", log_text, flags=re.MULTILINE)
    return list(dict.fromkeys(found))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks grpo_step_torchrun", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2, help="timed steps per strategy, after one warm-up step")
    p.add_argument("--strategies", default="bf16,fp8-rollout,jet")
    p.add_argument("--parts", default="single,torchrun", help="comma-separated: single, torchrun")
    p.add_argument("--nproc", default="1", help="torchrun's process counts, comma-separated; 'all': every GPU")
    p.add_argument("--prompts-per-gpu", type=int, default=PROMPTS_PER_GPU, help="prompts per rank (weak scaling)")
    p.add_argument("--timeout-s", type=float, default=1800, help="a launch still running after this is stopped and reported")
    p.add_argument("--logs", default=None, help="keep each launch's log in this folder (default: a temporary one)")
    p.add_argument("--out", "--results", dest="out", default=None, metavar="FILE", help="append the rows to FILE")
    p.add_argument("rest", nargs="*", help="more grpo_step options, after --")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [x for x in parts if x not in ("single", "torchrun")]:
        p.error(f"unknown part {unknown[0]!r}: single or torchrun")
    if args.prompts_per_gpu < 1: p.error(f"--prompts-per-gpu {args.prompts_per_gpu}: give 1 or more")
    try:
        counts = process_counts(args.nproc, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    except ValueError as e: p.error(str(e))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="grpo_step_torchrun_"))
    logs.mkdir(parents=True, exist_ok=True)
    common = SHAPE + ["--steps", str(args.steps), "--strategies", args.strategies]
    # the same trainer on both sides: eager (graphs replay kernels, not FSDP's hooks)
    single = [sys.executable, "-m", "benchmarks", "grpo_step", "--no-cuda-graphs"]
    launches = [("single", 1, single)] if "single" in parts else []
    launches += [("torchrun", n, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                                  "-m", "benchmarks", "grpo_step", "--distributed"]) for n in counts if "torchrun" in parts]
    driver, rows = command_line("grpo_step_torchrun", argv), []
    for launcher, n, head in launches:          # rows written as each launch ends (the 1-rank ones first: counts sorted)
        out, log = logs / f"{launcher}_{n}.jsonl", logs / f"{launcher}_{n}.log"
        out.unlink(missing_ok=True)
        command = head + common + ["--prompts", str(args.prompts_per_gpu * n), *args.rest, "--out", str(out)]
        rc, tail = launch(command, log, args.timeout_s)
        ran = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        for r in ran: r |= {"prompts_per_gpu": args.prompts_per_gpu, "command": driver,
                            "launch": re.sub(r" --out \S+", "", r["command"])}
        if rc != 0:                     # a rank died, hung or ran out of memory: keep what it said
            ran.append(make_row("grpo_step_torchrun", dict(failed=True, launcher=launcher, gpus=n, returncode=rc,
                                                           timed_out=rc is None, strategies=args.strategies,
                                                           prompts_per_gpu=args.prompts_per_gpu, log=str(log),
                                                           rank_errors=rank_errors(log.read_text(errors="replace")),
                                                           log_tail=tail), argv) | {"bench": "grpo_step"})
            print(f"{launcher} on {n} process(es) failed (return code {rc}); its log: {log}\n{tail}", file=sys.stderr)
        add_scaling(rows + ran)
        for r in ran: emit(r, args.out)
        rows += ran
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
