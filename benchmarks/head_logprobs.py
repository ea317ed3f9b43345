"""Time the head's per-token log-probs on a GPU: `jetrl.kernels.selective_log_softmax` (one pass forward, one
backward) against the trainer's torch ops (`temperature_log_softmax(logits, T).gather(-1, targets)`, as
`jetrl.logprobs._head_log_probs` runs them per chunk), and check that the two agree.

    python benchmarks/head_logprobs.py                                   # one chunk: 4096 tokens x 151,936, bf16
    python benchmarks/head_logprobs.py --temperature 0.7 --out benchmarks/results/head_logprobs_h200.jsonl

Per implementation: forward and forward + backward times in ms (`jetrl.kernels.graph_time_ms`: calls captured in a
CUDA graph and replayed, GPU time only) and the peak memory each allocates beyond the logits, targets and gradient
(GiB; the forward without autograd, as the checkpointed trainer's first pass runs it); then the largest difference of log-probs and of gradients between the two. One JSON line per run, with the
command, the GPU and torch's version. Needs a CUDA GPU.
"""
import argparse, json, sys
import torch

from jetrl.kernels import _reference_selective_log_softmax, graph_time_ms, selective_log_softmax


def peak_gib(fn) -> float:
    "GiB allocated at the peak of one fn() beyond what was allocated before it."
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(); torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def measure(tokens: int, vocab: int, T: float, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(tokens, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    grad = torch.randn(tokens, device="cuda", generator=g)
    row = dict(tokens=tokens, vocab=vocab, temperature=T, dtype="bfloat16")
    for name, f in (("fused", lambda: selective_log_softmax(logits, targets, T)), ("torch", lambda: _reference_selective_log_softmax(logits, targets, T))):
        def forward():                       # as the checkpointed trainer's first forward runs: without autograd
            with torch.no_grad(): f()
        both = lambda: torch.autograd.grad(f(), logits, grad)
        row[f"{name}_forward_ms"] = graph_time_ms(forward, rounds=5)
        row[f"{name}_forward_backward_ms"] = graph_time_ms(both, rounds=5)
        row[f"{name}_forward_peak_gib"] = peak_gib(forward)
        row[f"{name}_forward_backward_peak_gib"] = peak_gib(both)
    row["speedup_forward"] = row["torch_forward_ms"] / row["fused_forward_ms"]
    row["speedup_forward_backward"] = row["torch_forward_backward_ms"] / row["fused_forward_backward_ms"]
    logp = selective_log_softmax(logits, targets, T)
    want = _reference_selective_log_softmax(logits, targets, T)
    (d,) = torch.autograd.grad(logp, logits, grad)
    (d_want,) = torch.autograd.grad(want, logits, grad)
    row["logp_max_abs_diff"] = (logp - want).abs().max().item()
    diff = (d.double() - d_want.double()).abs()
    row["grad_max_abs_diff"] = diff.max().item()
    row["grad_max_diff_over_row_max"] = (diff / d_want.double().abs().amax(1, keepdim=True)).max().item()
    row["grad_elements_differing"] = int((diff > 0).sum())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="rows: LOGPROB_CHUNK_TOKENS, the trainer's chunk")
    p.add_argument("--vocab", type=int, default=151936, help="columns: Qwen2's vocabulary")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--logprob-tolerance", type=float, default=1e-4, help="largest |log p| difference accepted")
    p.add_argument("--out", help="append one JSON line per temperature to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("head_logprobs.py needs a CUDA GPU (the fused kernels are Triton; graph_time_ms replays CUDA graphs).")
    ok = True
    for T in args.temperature:
        row = measure(args.tokens, args.vocab, T)
        row.update(command="python " + " ".join(sys.argv), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        print(json.dumps(row))
        ok &= row["logp_max_abs_diff"] <= args.logprob_tolerance
        if args.out:
            with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")
    if not ok: sys.exit(f"MISMATCH: the fused log-probs differ from torch's by more than {args.logprob_tolerance}")


if __name__ == "__main__":
    main()
