"""What the trainer's forward keeps for backward, part by part, and the peak of one micro-batch's forward + backward.

    python benchmarks/activation_memory.py --model qwen2-0.5b --layers 2 --rows 8 --seq 640 --strategies bf16,jet
    python benchmarks/activation_memory.py --device cuda --model qwen2-0.5b --layers 24 --rows 64 --seq 640 \
        --strategies bf16,jet --out benchmarks/results/activation_memory_h200.jsonl

One micro-batch of the GRPO step of `benchmarks/grpo_step.py`: `token_log_probs` (the engine's own layers,
`sequence_forward`, then the head and the log-softmax in chunks) and the GRPO loss, on a random-weight model of a real
shape with `--layers` decoder layers, `--rows` x `--seq` tokens. Every tensor autograd saves is counted once (by its
storage; parameters excluded) and charged to the part of the forward that saved it first: the innermost module and
the function that called the op. Layer parts are given per token per layer, and extrapolated to `--target`
(layers x rows x seq, default the 0.5B step of issue #11: 24 x 64 x 640).

On the CPU the GPU's kernels cannot run, so by default (`--gpu-graph`) the same autograd graph is built with torch
forwards in their place: `InvariantRMSNorm` and the attention run their custom autograd functions (which save what
they save on a GPU) with `_reference_rms_norm` and SDPA inside. Besides the table: the bytes still allocated after the
forward (what backward will need; CPU: torch's MemTracker, CUDA: the allocator) and the peak of forward + backward,
both above what was allocated before (weights, gradients of earlier micro-batches).
"""
import argparse, contextlib, json, re, sys
from collections import defaultdict
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rollout import RANDOM_MODELS                                   # benchmarks/rollout.py: the random model shapes
from jetrl.grpo import GRPOConfig, grpo_loss
from jetrl.policy import Policy, token_log_probs
import jetrl.kernels as kernels

GB = 1e9
_SOURCES = ("/jetrl/", "/transformers/", "/torch/nn/functional.py", "/torch/nn/modules/")


def build_policy(model: str, layers: int, strategy: str, device: str, checkpointing: bool, vocab: int | None = None):
    "A Policy over a random-weight model of `model`'s shape with `layers` decoder layers (bf16, train mode)."
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = dict(RANDOM_MODELS[model]); cfg.pop("family")
    cfg["num_hidden_layers"] = layers or cfg["num_hidden_layers"]
    if vocab: cfg["vocab_size"] = vocab
    torch.manual_seed(0)
    with torch.device(device):
        net = Qwen2ForCausalLM(Qwen2Config(**cfg, eos_token_id=0, pad_token_id=0)).to(torch.bfloat16)
    if checkpointing: net.gradient_checkpointing_enable()
    net.train()
    return Policy(net, None, _bf16_spec(strategy), device=device)


def _bf16_spec(strategy: str):
    "The strategy with bf16 high precision (the CPU default is fp32; the GPU's is bf16)."
    import dataclasses
    from jetrl.policy import get_strategy
    return dataclasses.replace(get_strategy(strategy), hp_dtype="bfloat16")


@contextlib.contextmanager
def gpu_graph_on_cpu():
    """On the CPU, build the autograd graph the GPU builds: RMSNorm and attention through their custom autograd
    functions (`_RMSNormFunction`, `_AttentionFunction`), whose forwards run torch's reference ops here."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    def attention(q, k, v, q_columns, key_valid, scale):
        return sdpa(q, k, v, attn_mask=kernels.causal_key_mask(key_valid, q_columns), scale=scale,
                    enable_gqa=k.shape[1] != q.shape[1])
    patches = dict(invariant_kernels_available=lambda device: True, rms_norm_invariant=kernels._reference_rms_norm,
                   attention_invariant=attention, matmul_invariant=lambda x2d, w: x2d @ w.t(),
                   _silu_mul_op=lambda gate, up, fmt: (torch.nn.functional.silu(gate) * up, None, None))
    saved = {name: getattr(kernels, name) for name in patches}
    for name, fn in patches.items(): setattr(kernels, name, fn)
    try: yield
    finally:
        for name, fn in saved.items(): setattr(kernels, name, fn)


def _where(module_stack: list[str]) -> tuple[str, bool]:
    "(part label, inside a decoder layer) of the op now saving a tensor: innermost module + calling function."
    frame, function, in_layer = sys._getframe(2), None, False
    while frame is not None:
        name, file = frame.f_code.co_name, frame.f_code.co_filename
        if function is None and any(s in file for s in _SOURCES) and name not in ("_call_impl", "_wrapped_call_impl", "apply"):
            function = name
        # `_layers`' block is one decoder layer; what `_layers` saves itself is per layer too (checkpointed layers' inputs)
        if name in ("block", "_layers") and file.endswith("rollout.py"): in_layer = True
        frame = frame.f_back
    module = re.sub(r"layers\.\d+\.", "", module_stack[-1]) if module_stack else "-"
    in_layer = in_layer or bool(module_stack and re.search(r"layers\.\d+\.", module_stack[-1]))
    return f"{module} / {function}", in_layer


@contextlib.contextmanager
def saved_tensor_table(model: torch.nn.Module):
    "Yields a dict {(label, in_layer): [bytes, tensors]} filled with every tensor autograd saves (once per storage)."
    names = {m: n for n, m in model.named_modules()}
    stack, table, seen = [], defaultdict(lambda: [0, 0]), set()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    def push(m, args): stack.append(names.get(m, type(m).__name__))
    def pop(m, args, out): stack.pop()
    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            entry = table[_where(stack)]
            entry[0] += storage.nbytes(); entry[1] += 1
        return t
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(push),
             torch.nn.modules.module.register_module_forward_hook(pop, always_call=True)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): yield table
    finally:
        for h in hooks: h.remove()


def micro_batch_loss(policy: Policy, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    "The GRPO loss of one micro-batch as `benchmarks/grpo_step.py` computes it (random advantages)."
    logp = token_log_probs(policy.model, input_ids, torch.ones_like(input_ids))[:, prompt_len - 1:]
    mask = torch.ones_like(logp)
    advantages = torch.randn(input_ids.shape[0], device=logp.device, generator=torch.Generator(logp.device).manual_seed(0))
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), advantages, mask, GRPOConfig(num_generations=1),
                        loss_normalizer=float(mask.numel()))
    return loss


def _totals_tracker():
    "torch's MemTracker without its per-module statistics (it refuses a module called twice, as the chunked head is)."
    from torch.distributed._tools.mem_tracker import MemTracker
    class TotalsTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs): pass
        def _post_fw_hook(self, module, inputs, outputs): pass
        def _pre_bw_hook(self, module, args): pass
        def _post_bw_hook(self, module, args): pass
    return TotalsTracker()


class _Memory:
    "Bytes allocated now and at the peak since `start()`: the CUDA allocator, or torch's MemTracker on the CPU."
    def __init__(self, device: torch.device, model):
        self.device, self.model = device, model

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); self.base = torch.cuda.memory_allocated()
        else:
            from jetrl.linear import fp8_modules
            # the FP8 weight caches exist already: known tensors, else the tracker counts them where an op first reads them
            cached = [t for m in fp8_modules(self.model).values() if m._synced is not None
                      for t in (m._synced[2].data, m._synced[2].scale, m._synced[3]) if t is not None]
            self.tracker = _totals_tracker(); self.tracker.track_external(self.model, *cached); self.tracker.__enter__()
            self.base = self._cpu("current")
        return self

    def _cpu(self, which: str) -> int: return self.tracker.get_tracker_snapshot(which)[self.device]["Total"]

    def now(self) -> int:
        if self.device.type == "cuda": torch.cuda.synchronize(); return torch.cuda.memory_allocated() - self.base
        return self._cpu("current") - self.base

    def peak(self) -> int:
        if self.device.type == "cuda": return torch.cuda.max_memory_allocated() - self.base
        return self._cpu("peak") - self.base

    def __exit__(self, *exc):
        if self.device.type != "cuda": self.tracker.__exit__(*exc)


def measure(policy: Policy, rows: int, seq: int, prompt_len: int, peak: bool) -> dict:
    "Saved bytes by part (one forward), then (if `peak`) the bytes held after the forward and the peak with backward."
    device = policy.device
    ids = torch.randint(1, policy.model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(1)).to(device)
    with saved_tensor_table(policy.model) as table:
        loss = micro_batch_loss(policy, ids, prompt_len)
    del loss
    out = dict(table={f"{label} [{'layer' if in_layer else 'once'}]": tuple(v) for (label, in_layer), v in table.items()})
    if peak:
        policy.model.zero_grad(set_to_none=False)                    # the gradients exist already, as in a real step
        for p in policy.model.parameters(): p.grad = torch.zeros_like(p)
        with _Memory(device, policy.model) as memory:
            loss = micro_batch_loss(policy, ids, prompt_len)
            out["held_after_forward"] = memory.now()
            loss.backward()
            del loss
            out["peak"] = memory.peak()
    return out


def report(strategy: str, result: dict, layers: int, rows: int, seq: int, target: tuple[int, int, int]) -> list[str]:
    "The table: per part, bytes per token (per layer for layer parts), GB measured, GB at the target shape."
    t_layers, t_rows, t_seq = target
    tokens, t_tokens = rows * seq, t_rows * t_seq
    lines = [f"## {strategy}: {layers} layers x {rows} rows x {seq} tokens -> target {t_layers} x {t_rows} x {t_seq}",
             f"{'part (module / function) [per layer or once]':<62} {'tensors':>7} {'B/token':>9} {'GB here':>8} {'GB target':>9}"]
    total = total_target = 0.0
    for label, (nbytes, count) in sorted(result["table"].items(), key=lambda kv: -kv[1][0]):
        in_layer = label.endswith("[layer]")
        per_token = nbytes / tokens / (layers if in_layer else 1)
        at_target = per_token * t_tokens * (t_layers if in_layer else 1)
        total += nbytes; total_target += at_target
        lines.append(f"{label:<62} {count:>7} {per_token:>9.0f} {nbytes / GB:>8.3f} {at_target / GB:>9.2f}")
    lines.append(f"{'saved for backward, total':<62} {'':>7} {'':>9} {total / GB:>8.3f} {total_target / GB:>9.2f}")
    for key in ("held_after_forward", "peak"):
        if key in result: lines.append(f"{key + ' (above what was allocated before)':<62} {'':>7} {'':>9} {result[key] / GB:>8.3f}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b", choices=sorted(RANDOM_MODELS))
    p.add_argument("--strategies", default="bf16,jet")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (0: the model's own count)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=640, help="tokens per row (prompt + completion)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=0, help="another vocabulary size (0: the model's); the layer parts do not depend on it")
    p.add_argument("--target", default="24x64x640", help="layers x rows x seq to extrapolate to")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--logprob-chunk", type=int, default=0,
                   help="positions per chunk of the head's log-softmax (0: jetrl.logprobs.LOGPROB_CHUNK_TOKENS)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per decoder layer")
    p.add_argument("--no-gpu-graph", action="store_true", help="CPU: the CPU's own graph (fp32-statistics RMSNorm, SDPA)")
    p.add_argument("--no-peak", action="store_true", help="only the table (no MemTracker pass)")
    p.add_argument("--out", default=None, help="append one JSON object per strategy to this file")
    args = p.parse_args(argv)
    target = tuple(int(v) for v in args.target.split("x"))
    if args.logprob_chunk:
        import jetrl.logprobs
        jetrl.logprobs.LOGPROB_CHUNK_TOKENS = args.logprob_chunk
    emulate = args.device == "cpu" and not args.no_gpu_graph
    command = "python benchmarks/activation_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for strategy in args.strategies.split(","):
        with gpu_graph_on_cpu() if emulate else contextlib.nullcontext():
            policy = build_policy(args.model, args.layers, strategy, args.device, args.checkpointing, args.vocab or None)
            layers = policy.model.config.num_hidden_layers
            result = measure(policy, args.rows, args.seq, args.prompt_len, not args.no_peak)
        print("\n".join(report(strategy, result, layers, args.rows, args.seq, target)) + "\n", flush=True)
        if args.out:
            row = dict(model=args.model, strategy=strategy, layers=layers, rows=args.rows, seq=args.seq, vocab=args.vocab or None,
                       logprob_chunk=args.logprob_chunk or None,
                       checkpointing=args.checkpointing, device=args.device, gpu_graph=emulate or args.device == "cuda",
                       table={k: v[0] for k, v in result["table"].items()}, held_after_forward=result.get("held_after_forward"),
                       peak=result.get("peak"), torch=torch.__version__, command=command)
            with open(args.out, "a") as f: f.write(json.dumps(row) + "\n")
        del policy


if __name__ == "__main__":
    main()
