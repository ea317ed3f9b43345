"""Time the head's per-token log-probs on a GPU: `jetrl.kernels.selective_log_softmax` (one pass forward, one
backward) against the trainer's torch ops (`temperature_log_softmax(logits, T).gather(-1, targets)`, as
`jetrl.logprobs._head_log_probs` runs them per chunk), and check that the two agree.

    python -m benchmarks head_logprobs                      # one chunk: 4096 tokens x 151,936, bf16
    python -m benchmarks head_logprobs --temperature 0.7 --out benchmarks/results/head_logprobs_h200.jsonl

Per implementation: forward and forward + backward times in ms (calls captured in a CUDA graph and replayed, GPU time
only) and the peak memory each allocates beyond the logits, targets and gradient (GiB; the forward without autograd,
as the checkpointed trainer's first pass runs it); then the largest difference of log-probs and of gradients between
the two. One row per temperature. Needs a CUDA GPU.
"""
import argparse, sys
import torch

from benchmarks.common import add_output_args, emit, graph_time_ms, make_row, need_cuda, peak_gib
from jetrl.kernels import selective_log_softmax, temperature_log_softmax


def torch_selective_log_softmax(logits, targets, T: float):
    "The trainer's torch ops: an fp32 log-softmax of logits / T over the vocabulary, at each row's target."
    return temperature_log_softmax(logits, T).gather(-1, targets[:, None]).squeeze(-1)


def measure(tokens: int, vocab: int, T: float, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(tokens, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    grad = torch.randn(tokens, device="cuda", generator=g)
    row = dict(tokens=tokens, vocab=vocab, temperature=T, dtype="bfloat16")
    for name, f in (("fused", lambda: selective_log_softmax(logits, targets, T)), ("torch", lambda: torch_selective_log_softmax(logits, targets, T))):
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
    want = torch_selective_log_softmax(logits, targets, T)
    (d,) = torch.autograd.grad(logp, logits, grad)
    (d_want,) = torch.autograd.grad(want, logits, grad)
    row["logp_max_abs_diff"] = (logp - want).abs().max().item()
    diff = (d.double() - d_want.double()).abs()
    row["grad_max_abs_diff"] = diff.max().item()
    row["grad_max_diff_over_row_max"] = (diff / d_want.double().abs().amax(1, keepdim=True)).max().item()
    row["grad_elements_differing"] = int((diff > 0).sum())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks head_logprobs", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="rows: LOGPROB_CHUNK_TOKENS, the trainer's chunk")
    p.add_argument("--vocab", type=int, default=151936, help="columns: Qwen2's vocabulary")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--logprob-tolerance", type=float, default=1e-4, help="largest |log p| difference accepted")
    add_output_args(p, kernels=False)
    args = p.parse_args(argv)
    need_cuda("head_logprobs")
    ok = True
    for T in args.temperature:
        row = emit(make_row("head_logprobs", measure(args.tokens, args.vocab, T), argv), args.out)
        ok &= row["logp_max_abs_diff"] <= args.logprob_tolerance
    if not ok: sys.exit(f"MISMATCH: the fused log-probs differ from torch's by more than {args.logprob_tolerance}")


if __name__ == "__main__":
    main()
