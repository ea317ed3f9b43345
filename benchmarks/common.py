"""What every benchmark shares: random-weight models of real shapes, GPU timing, kernel options from the command line,
and the one row schema every benchmark writes.

A row is one JSON object: {bench, date, git_sha, gpu, torch, command, options, ...metrics}, where `options` is the
`jetrl.options.KernelOptions` the measurement ran under (`as_dict()`). Rows are printed, and appended as JSON lines to
a file only when asked (`--out FILE`, also spelled `--results FILE`).
"""
from __future__ import annotations
import argparse, datetime, json, os, re, statistics, subprocess, sys, time
from pathlib import Path

import torch

from jetrl.kernels import graph_time_ms      # GPU time from CUDA graph replays; re-exported for the benchmarks
from jetrl.options import KernelOptions, kernel_options

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# ---------------------------------------------------------------- random-weight models of named shapes (no download)
RANDOM_MODELS = {  # Qwen2-0.5B's shape and Qwen2-7B's (26 of its 28 layers: what one H200 holds with the step's state)
    "qwen2-0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=26, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # Qwen2.5-14B's shape, all 48 layers: the several-GPU shape (FSDP2 shards its training state; not one GPU's)
    "qwen2.5-14b": dict(family="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    # Llama-3-8B's shape, all 32 layers: the long-rollout shape (64 rows of ~5,000 tokens fit beside it)
    "llama3-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                      max_position_embeddings=131072),
}
# (N_out, K_in) of each linear of a Qwen2 layer; q/k/v and gate/up also fused (weights concatenated along N)
LINEAR_SHAPES = {
    "qwen2-7b": {"q/o": (3584, 3584), "k/v": (512, 3584), "qkv": (4608, 3584), "gate/up": (18944, 3584),
                 "gate+up": (37888, 3584), "down": (3584, 18944)},
    "qwen2-0.5b": {"q/o": (896, 896), "k/v": (128, 896), "qkv": (1152, 896), "gate/up": (4864, 896),
                   "gate+up": (9728, 896), "down": (896, 4864)},
}
TRAINER_TOKENS = 16 * 640          # one training micro-batch of the GRPO step: 16 rows x (128 prompt + 512 new) tokens


def random_model_config(name: str, **overrides):
    "The transformers config of a named random shape (`RANDOM_MODELS`), with `overrides` (e.g. num_hidden_layers)."
    from transformers import LlamaConfig, Qwen2Config
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[RANDOM_MODELS[name]["family"]]
    cfg = {k: v for k, v in RANDOM_MODELS[name].items() if k != "family"} | overrides
    return config_class(**cfg, eos_token_id=0, pad_token_id=0)


def build(name: str, dtype, device=None):
    """(model, tokenizer): a named random shape (`RANDOM_MODELS`, seed 0, a word-level tokenizer 't<i>' over its
    vocabulary, EOS = pad = 't0'), or anything `jetrl.policy.load_model_and_tokenizer` loads (jetrl-tiny, a hub id,
    a folder). Random shapes are built on `device` (default: CUDA where there is one)."""
    if name not in RANDOM_MODELS:
        from jetrl.policy import load_model_and_tokenizer
        return load_model_and_tokenizer(name, dtype)
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    config = random_model_config(name)
    torch.manual_seed(0)
    with torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                        eos_token="t0", pad_token="t0")
    return model.eval(), tokenizer


# ---------------------------------------------------------------- timing


def synced_clock(device) -> float:
    "time.perf_counter() after the device's queued work is done."
    if torch.device(device).type == "cuda": torch.cuda.synchronize(device)
    return time.perf_counter()


def event_times_ms(fn, iters: int = 20, warmup: int = 3) -> list[float]:
    "Each of `iters` eager calls of `fn` in ms between CUDA events (host launch time included), after `warmup` calls."
    for _ in range(warmup): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); fn(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def event_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    "The median of `event_times_ms`."
    return statistics.median(event_times_ms(fn, iters, warmup))


def peak_gib(fn) -> float:
    "GiB allocated at the peak of one fn() beyond what was allocated before it."
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(); torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


# ---------------------------------------------------------------- kernel options from the command line
def parse_kernels(text: str | None) -> KernelOptions:
    """KernelOptions from 'name=value,...' (values true/false, on/off, 1/0, or none), e.g.
    'gluon_decode=false,fused_entropy=false'; empty or None: the defaults."""
    values = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        words = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False, "none": None}
        if not sep or value.strip().lower() not in words:
            raise argparse.ArgumentTypeError(f"--kernels takes name=value pairs (value true/false/none), got {item!r}")
        values[name.strip()] = words[value.strip().lower()]
    try: return KernelOptions.from_dict(values)
    except (TypeError, ValueError) as e: raise argparse.ArgumentTypeError(str(e)) from None


def add_output_args(p: argparse.ArgumentParser, kernels: bool = True):
    "--out/--results FILE (append the rows as JSON lines) and, with `kernels`, --kernels name=value,..."
    p.add_argument("--out", "--results", dest="out", default=None, metavar="FILE",
                   help="append each row to FILE as a JSON line (default: print only)")
    if kernels:
        p.add_argument("--kernels", type=parse_kernels, default=KernelOptions(), metavar="NAME=VALUE,...",
                       help="kernel options for the run (jetrl.options.KernelOptions fields), e.g. gluon_decode=false")


# ---------------------------------------------------------------- the row
def git_sha() -> str | None:
    "The commit of the tree that runs ($JETRL_GIT_SHA where there is no .git, e.g. a copied tree); '+dirty' if edited."
    if os.environ.get("JETRL_GIT_SHA"): return os.environ["JETRL_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def gpu_name(device=None) -> str:
    if device is not None and torch.device(device).type != "cuda": return "cpu"
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"


# memory bandwidth by GPU, from each card's data sheet: the bound a memory-bound step is measured against. Keys are
# words of the name torch.cuda.get_device_name reports ("NVIDIA H100 80GB HBM3"); a GH200 or any card not named here
# gets a measured copy instead
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12}


def data_sheet_bandwidth(name: str) -> float | None:
    "The table's bytes per second for a device name: the longest key found in it as whole words, or None."
    known = [k for k in HBM_BYTES_PER_S if re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", name)]
    return HBM_BYTES_PER_S[max(known, key=len)] if known else None


def hbm_bytes_per_s(device=None) -> tuple[float, str]:
    """(bytes per second, where the number comes from) for a decode bound: the data sheet's for a GPU the table names,
    else what a 1 GiB device-to-device copy reaches here (its reads plus its writes), which is a little below it."""
    name = gpu_name(device)
    sheet = data_sheet_bandwidth(name)
    if sheet is not None: return sheet, f"data sheet ({name})"
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = event_time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3), f"measured copy ({name})"


def command_line(bench: str, argv: list[str] | None, launcher: str = "python -m benchmarks") -> str:
    import shlex
    return f"{launcher} {bench} " + shlex.join(sys.argv[2:] if argv is None else argv)


_SHA: list = []


def make_row(bench: str, metrics: dict, argv=None, device=None, options: KernelOptions | None = None,
             launcher: str = "python -m benchmarks") -> dict:
    "One row: {bench, date, git_sha, gpu, torch, command, options} then `metrics` (floats rounded to 6 digits)."
    if not _SHA: _SHA.append(git_sha())
    row = dict(bench=bench, date=datetime.date.today().isoformat(), git_sha=_SHA[0], gpu=gpu_name(device),
               torch=torch.__version__, command=command_line(bench, argv, launcher),
               options=(options or kernel_options()).as_dict())
    row |= {k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}
    return row


def emit(row: dict, out: str | None, echo: bool = True) -> dict:
    "Print `row` as one JSON line and, with `out`, append it to that file."
    line = json.dumps(row)
    if echo: print(line, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f: f.write(line + "\n")
    return row


def need_cuda(bench: str):
    if not torch.cuda.is_available(): sys.exit(f"{bench} needs a CUDA GPU")
