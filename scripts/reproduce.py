"""Reproduce Jet-RL's finding: GRPO under bf16, fp8-rollout, fp8-rollout-tis and jet (and a ladder of coarser
rollout precisions), same prompts, seeds and settings; one command, one seed list, one report.

    python scripts/reproduce.py --preset workshop --out runs/reproduce        # CPU, the dose-response
    python scripts/reproduce.py --preset gpu --out runs/reproduce_gpu --time-budget 500   # one H200 call; again resumes
    python scripts/reproduce.py --preset gpu --plan                          # state sizes, the device calls and their times
    python scripts/reproduce.py --preset gpu --base-only --base runs/gpu_base --out /tmp/sft   # the base alone, as parts
    python scripts/reproduce.py --preset gpu --base runs/gpu_base --out runs/parity --time-budget 470   # every run on that base
    python scripts/reproduce.py --report-from benchmarks/results/reproduce_gpu.jsonl --out DIR   # redraw a saved report

What it does, in order, each stage resumable (run the same command again to continue; nothing is redone):
1. (presets with `sft`) train the base policy from scratch on jetrl's arithmetic chains with worked solutions
   (one line `a + b = c` per step), so that its completions are long;
2. GRPO for every (seed, strategy), in that order, with `jetrl.train.train`: identical TrainConfig but for the
   strategy name; a run checkpoints every step and resumes after its last checkpoint;
3. the report: OUT/table.md (paper-shaped), OUT/summary.jsonl, the results file (one object per finished
   (strategy, seed), each marked `complete`: whether every run of the set is finished; written also when the time
   budget stopped the call; merged: rows of other runs already in the file stay, so several OUTs may share one file),
   then OUT/report.html (its figure needs plotly; without it, a note and the table only).

The base is what every seed of a comparison must share: its SFT runs with torch's deterministic algorithms (the same
bits from the same seed and data on one kind of GPU and software), and `--base-only --base DIR` saves it as
`DIR/base.tgz.partNN` (<= 15 MiB each) with `DIR/base.json` (its `base_fingerprint`, a hash of the weights, its SFT's
numbers and held-out accuracy). `--base DIR` then runs on that base, restored into OUT/base and checked against the
fingerprint (an OUT whose runs started from another base is refused); `--pack` leaves it out of OUT's parts. Every
results row names its base's fingerprint.

`--time-budget S` stops at a step boundary before S seconds have passed (a run's next step is started only if
the mean step time so far fits), so a GPU machine lent in calls of at most 10 minutes can spread the work over
several calls. `--pack DIR` writes the whole OUT folder as a few gzip'd tar parts of at most 15 MiB each (60 MiB in
all, or it stops and says which files are too big); `--unpack DIR` restores it before the work starts.

Learning is scored twice: the train accuracy (sampled, new prompts every step: noisy) and the held-out accuracy of
the master weights before and after training (256 fixed prompts x 4 samples at the training temperature). Each row
also carries what would show why a strategy learns differently: the tokens a clip cut by the advantage's sign (in the
loss, and with the rollout's log-probs as pi_old), entropy, gradient norm, KL to the starting policy, and the mismatch by
token position; the report's second figure draws them per step.

Deviations from the paper, stated once: models of 3-22M parameters, not 7-32B; synthetic tasks with exact rewards;
the rollout engine is jetrl's own; the rungs below FP8 (`rollout-nvfp4`, `rollout-mxfp4`, `rollout-fp4-rowwise`)
emulate 4-bit E2M1 with the fake quantizer of this script, for the dose-response only (jetrl has no FP4 kernel).
"""
from __future__ import annotations

import argparse, contextlib, copy, hashlib, io, json, math, os, re, shlex, sys, tarfile, time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# cuBLAS is deterministic only with a fixed workspace, read when it starts: set before any CUDA work (see deterministic_algorithms)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.nn as nn

from jetrl.grpo import GRPOConfig
from jetrl.linear import RECIPES, FP8Recipe, fp8_modules, set_recipe
from jetrl.policy import STRATEGIES, Policy, PrecisionSpec, SyncReport, load_model_and_tokenizer
from jetrl.tasks import STEP_WORDS, ArithmeticChainTask, number_reward
from jetrl.train import TrainConfig, make_task, read_metrics, train
from jetrl.runfolder import write_atomically
sys.path.insert(0, str(Path(__file__).resolve().parent))     # this folder's siblings, however this file was loaded
from learning_parity import provenance        # the date and commit of a row (no torch there)

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
PART_BYTES = 15 * MiB          # a packed part: under the device tool's 16 MiB a file
PACK_BYTES = 60 * MiB          # all parts together: the device tool's 64 MiB, less room for the log and tables beside them
DIVERGENCE_DROP = 0.10         # diverged: the held-out accuracy, or the train accuracy's last window, more than this
                               # below where it started (or a non-finite loss / gradient norm); one rule for every run


# ---------------------------------------------------------------- rollout precisions below FP8 (dose-response)
E2M1_MAX = 6.0                 # the largest 4-bit E2M1 value: the grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6

def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    "Round (already scaled) values to the nearest E2M1 value, ties to even, saturating at +-6."
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))        # the grid spacing of each binade
    return torch.sign(x) * torch.round(a / step) * step

def fake_quantize_fp4(x: torch.Tensor, block: int, pow2_scale: bool) -> torch.Tensor:
    """x (..., K) quantized to E2M1 in groups of `block` along K, each with its own scale amax / 6 (NVFP4-like,
    fp32 scales) or that scale rounded up to a power of two (MXFP4-like), then dequantized: the values an FP4
    GEMM would multiply. K must be a multiple of `block`; `block` 0 takes whole rows (one scale per row)."""
    *lead, K = x.shape
    block = block or K                                                  # 0: one scale per row
    if K % block: raise ValueError(f"FP4 groups of {block} need K to be a multiple of {block}, got K = {K}: "
                                   "choose a group size that divides K, or 0 for one scale per row")
    groups = x.float().reshape(*lead, K // block, block)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / E2M1_MAX
    if pow2_scale: scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (e2m1_round(groups / scale) * scale).reshape(x.shape).to(x.dtype)

class FP4RolloutLinear(nn.Module):
    "A rollout-only linear whose weight and input are both fake-quantized to E2M1 (see `fake_quantize_fp4`)."

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, block: int, pow2_scale: bool):
        super().__init__()
        self.block, self.pow2_scale = block, pow2_scale
        self.register_buffer("weight_q", torch.empty_like(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.load_weight(weight, bias)

    def load_weight(self, hp_weight: torch.Tensor, bias: torch.Tensor | None):
        "The weight sync: quantize the trainer's high-precision weight once."
        self.weight_q.copy_(fake_quantize_fp4(hp_weight.detach(), self.block, self.pow2_scale))
        if bias is not None: self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fake_quantize_fp4(x, self.block, self.pow2_scale).float() @ self.weight_q.float().t()
        if self.bias is not None: y = y + self.bias.float()
        return y.to(x.dtype)

class FP4RolloutPolicy(Policy):
    "High-precision training, a separate rollout copy in 4-bit E2M1 (weights and activations): the ladder's bottom rungs."

    def __init__(self, model, tokenizer, spec: PrecisionSpec, device, block: int, pow2_scale: bool):
        self.fp4_block, self.fp4_pow2 = block, pow2_scale
        super().__init__(model, tokenizer, spec, device)

    def sync_weights(self):
        if not getattr(self, "_fp4_ready", False):                  # first call: swap the FP8 copy's linears for FP4 ones
            rollout = self.rollout_model
            for fqn, m in fp8_modules(self.model).items():
                parent, _, child = fqn.rpartition(".")
                setattr(rollout.get_submodule(parent), child,
                        FP4RolloutLinear(m.weight, m.bias, self.fp4_block, self.fp4_pow2).to(m.weight.device))
            self._fp4_ready = True
        start, n, nbytes = time.perf_counter(), 0, 0
        with torch.no_grad():
            rollout_modules = dict(self.rollout_model.named_modules())
            for fqn, m in fp8_modules(self.model).items():
                rollout_modules[fqn].load_weight(m.weight, m.bias); n += 1; nbytes += m.weight.numel() // 2
            handed_over = {f"{fqn}.{name}" for fqn in fp8_modules(self.model) for name in ("weight", "bias")}
            rollout_state = self.rollout_model.state_dict(keep_vars=True)
            for key, value in [*self.model.named_parameters(), *self.model.named_buffers()]:
                if key in handed_over or key not in rollout_state: continue
                rollout_state[key].data.copy_(value.data)
        self.last_sync = SyncReport(n, 0, nbytes, time.perf_counter() - start)
        return self.last_sync

def _rollout_spec(name: str, recipe: FP8Recipe) -> PrecisionSpec:
    return PrecisionSpec(name, rollout_recipe=recipe, shared_weights=False)

# name -> (PrecisionSpec, FP4 options or None). The ladder turns only the rollout side down; training stays high precision.
VARIANTS: dict[str, tuple[PrecisionSpec, dict | None]] = {
    **{name: (STRATEGIES[name], None) for name in ("bf16", "fp8-rollout", "fp8-rollout-tis", "jet", "jet-fp8kv")},
    "rollout-rowwise": (_rollout_spec("rollout-rowwise", RECIPES["rowwise"]), None),
    "rollout-tensorwise": (_rollout_spec("rollout-tensorwise", RECIPES["tensorwise"]), None),
    "rollout-tensorwise-e5m2": (_rollout_spec("rollout-tensorwise-e5m2",
                                              FP8Recipe("tensorwise-e5m2", "tensorwise", act_fmt="e5m2", weight_fmt="e5m2")), None),
    "rollout-nvfp4": (_rollout_spec("rollout-nvfp4", RECIPES["blockwise"]), {"block": 16, "pow2_scale": False}),
    "rollout-mxfp4": (_rollout_spec("rollout-mxfp4", RECIPES["blockwise"]), {"block": 32, "pow2_scale": True}),
    "rollout-fp4-rowwise": (_rollout_spec("rollout-fp4-rowwise", RECIPES["blockwise"]), {"block": 0, "pow2_scale": False}),
}
DESCRIPTIONS = {"bf16": "training and rollout in high precision", "fp8-rollout": "rollout FP8 E4M3 1x128 / 128x128",
                "fp8-rollout-tis": "fp8-rollout + truncated importance sampling (C = 2)",
                "jet": "training and rollout FP8 E4M3 1x128 / 128x128, one quantizer",
                "jet-fp8kv": "jet, and keys and values in FP8 E4M3 (a scale per token and head) on both sides",
                "rollout-rowwise": "rollout FP8 E4M3 per row", "rollout-tensorwise": "rollout FP8 E4M3 per tensor",
                "rollout-tensorwise-e5m2": "rollout FP8 E5M2 per tensor",
                "rollout-nvfp4": "rollout 4-bit E2M1, 1x16 groups, fp32 scales (emulated)",
                "rollout-mxfp4": "rollout 4-bit E2M1, 1x32 groups, power-of-two scales (emulated)",
                "rollout-fp4-rowwise": "rollout 4-bit E2M1, one scale per row (emulated)"}

def build_policy(variant: str, model_name: str, device: str) -> Policy:
    "The policy of `variant` (a name of VARIANTS) over a fresh copy of `model_name`."
    if variant not in VARIANTS: raise ValueError(f"unknown strategy {variant!r}: choose from {sorted(VARIANTS)}")
    spec, fp4 = VARIANTS[variant]
    model, tokenizer = load_model_and_tokenizer(model_name)
    if fp4 is None: return Policy(model, tokenizer, spec, device=device)
    return FP4RolloutPolicy(model, tokenizer, spec, device, **fp4)


# ---------------------------------------------------------------- the base policy of the GPU preset: long worked solutions
STEP_PATTERN = re.compile("(" + "|".join(re.escape(w.split(" {}")[0].capitalize()) for w in STEP_WORDS.values()) + r") (\d+)\.")
WORD_OPERATOR = {w.split(" {}")[0].capitalize(): op for op, w in STEP_WORDS.items()}

def worked_solution(row: dict) -> str:
    "The completion SFT teaches for an arithmetic-chain row: one line `a op b = c` per step, then the tagged answer."
    start = int(re.search(r"Start with (-?\d+)\.", row["prompt"]).group(1))
    moves = STEP_PATTERN.findall(row["prompt"])
    lines, value = [], start
    for (word, number), result in zip(moves, row["intermediate"], strict=True):
        lines.append(f"{value} {WORD_OPERATOR[word]} {number} = {result}")
        value = int(result)
    return " " + "\n".join(lines) + f"\n<answer>{row['answer']}</answer>"

SFT_TAIL = 100            # sft.json reports the mean loss of the last SFT_TAIL steps (one batch's loss is noisy)
SFT_SEED = 2 * 10**9       # SFT rows are seeded from here up; held-out prompts use EVAL_SEED = 10**9 + 7

@dataclass(frozen=True)
class SFTSpec:
    "How the base policy is made: model shape, data (chains of these lengths), optimisation."
    hidden_size: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate_size: int = 1408
    max_positions: int = 1536
    chain_steps: tuple[int, ...] = (4, 8, 16, 32, 48)   # the SFT mix; GRPO uses the preset's task
    digits: int = 2
    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 100
    seed: int = 0
    deterministic: bool = True          # torch's deterministic algorithms (deterministic_algorithms): the same bits each time

def sft_rows(spec: SFTSpec, n: int, offset: int = 0) -> list[dict]:
    "n chain rows, lengths cycling through `spec.chain_steps`, seeded apart from GRPO's and the held-out prompts (>= 2 * 10**9)."
    rows = []
    for i in range(offset, offset + n):
        steps = spec.chain_steps[i % len(spec.chain_steps)]
        task = ArithmeticChainTask(steps=steps, digits=spec.digits, operators="+-", seed=SFT_SEED + spec.seed * 10**7 + i)
        rows.append(task.sample(1)[0])
    return rows

@contextlib.contextmanager
def deterministic_algorithms(on: bool = True):
    """With `on`: torch's deterministic algorithms (an op that has none raises, named in a one-line RuntimeError), cuDNN's,
    no TF32, so that a training run's bits depend on its seed and data alone on one kind of GPU and software
    (CUBLAS_WORKSPACE_CONFIG, which cuBLAS needs for that, is set when this script is imported). Restored after."""
    if not on: yield; return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = True, False, False
    try: yield
    except RuntimeError as e:
        if "deterministic" not in str(e): raise
        raise RuntimeError(f"the deterministic SFT met an op without a deterministic kernel here ({str(e).splitlines()[0][:160]}); "
                           "run with --nondeterministic-sft to train the base anyway, then build it twice and compare the "
                           "fingerprints before sharing it") from None
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = saved[2:]

def train_base_policy(spec: SFTSpec, folder: Path, device: str, deadline: float, log=print) -> bool:
    "Train the base policy into `folder` (resumable: `folder/sft_state.pt`); True when done, False at the deadline."
    from jetrl.tiny import build_tokenizer, lr_at
    from transformers import Qwen2Config, Qwen2ForCausalLM, PreTrainedTokenizerFast
    wanted = asdict(spec)                   # what the folder's base, or its stopped SFT, must have been made with
    if (folder / "config.json").exists():
        built = json.loads((folder / "sft.json").read_text()) if (folder / "sft.json").exists() else {}
        differ = sorted(k for k in wanted if k in built and json.dumps(built[k]) != json.dumps(wanted[k]))
        if differ:
            raise ValueError(f"{folder} holds a base SFT'd with other settings ({', '.join(f'{k} {built[k]} there, {wanted[k]} now' for k in differ)}): "
                             "use another --out for this base")
        return True
    folder.mkdir(parents=True, exist_ok=True)
    state_file, tok_dir = folder / "sft_state.pt", folder / "tokenizer"
    if tok_dir.exists(): tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        texts = [t for row in sft_rows(spec, 2000) for t in (row["prompt"], worked_solution(row))]
        tokenizer = build_tokenizer(texts); tokenizer.save_pretrained(tok_dir)
    torch.manual_seed(spec.seed)
    config = Qwen2Config(vocab_size=512, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                         head_dim=spec.hidden_size // spec.heads, max_position_embeddings=spec.max_positions,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    step = 0
    if state_file.exists():
        state = torch.load(state_file, map_location=device)
        if json.dumps(state.get("spec", wanted), sort_keys=True) != json.dumps(wanted, sort_keys=True):
            raise ValueError(f"{state_file} is an SFT stopped under other settings ({state.get('spec')}): use another --out")
        model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"]); step = state["step"]
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    start, tail, tail_steps = time.perf_counter(), torch.zeros((), device=device), 0     # the last SFT_TAIL steps' loss
    with deterministic_algorithms(spec.deterministic):
        while step < spec.steps:
            if time.time() > deadline:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "spec": wanted}, state_file)
                log(f"sft: stopped at step {step} (time budget); run again to continue"); return False
            rows = sft_rows(spec, spec.batch_size, offset=step * spec.batch_size)
            batch = {k: v.to(device) for k, v in encode_worked(tokenizer, rows).items()}
            for group in optimizer.param_groups: group["lr"] = lr_at(step, spec.steps, spec.lr, spec.warmup_steps)
            with autocast: loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True); loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); optimizer.step()
            if step % 100 == 0: log(f"sft step {step:5d} loss {loss.item():.4f} {time.perf_counter() - start:7.1f} s")
            if step >= spec.steps - SFT_TAIL: tail += loss.detach(); tail_steps += 1
            step += 1
    model.eval().to("cpu", torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model.generation_config.pad_token_id = 0
    from jetrl.models import no_progress_bars
    with no_progress_bars(): model.save_pretrained(folder); tokenizer.save_pretrained(folder)
    stats = {"params": sum(p.numel() for p in model.parameters()), "seconds_this_call": round(time.perf_counter() - start, 1),
             "device": device, f"loss_last_{SFT_TAIL}_steps": round(tail.item() / tail_steps, 5) if tail_steps else None}
    (folder / "sft.json").write_text(json.dumps(asdict(spec) | stats, indent=1))
    log(f"sft: done, {stats}")
    state_file.unlink(missing_ok=True)
    return True

def check_base_format(folder: Path, spec: SFTSpec, n: int = 10) -> None:
    """The saved base, loaded as GRPO and the held-out eval load it, must read and write SFT's exact token ids: each
    prompt through the rollout engine's own encoding (chat template included), each worked solution, and EOS as the
    engine's stop token. A RuntimeError names the first difference (transformers 5 can give this Qwen2 folder
    Qwen2Tokenizer's pre-tokenizer: every GRPO prompt is then ids the model never saw, and accuracy is 0)."""
    from transformers import PreTrainedTokenizerFast
    from jetrl.rollout import RolloutEngine, _prompt_token_ids
    sft_tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")           # what SFT trained with
    model, tokenizer = load_model_and_tokenizer(str(folder))
    engine = RolloutEngine(model, tokenizer)
    for row in sft_rows(spec, n):
        for what, text, loaded in (("prompt", row["prompt"], _prompt_token_ids(tokenizer, [row["prompt"]], engine.chat_template)[0]),
                                   ("worked solution", worked_solution(row), tokenizer(worked_solution(row), add_special_tokens=False)["input_ids"])):
            trained = sft_tokenizer(text, add_special_tokens=False)["input_ids"]
            if loaded != trained:
                raise RuntimeError(f"the base in {folder} reads this {what} as other token ids than SFT trained on "
                                   f"({type(tokenizer).__name__}: {loaded[:12]}... vs SFT's {trained[:12]}...): {text[:60]!r}. "
                                   "Load the folder with jetrl.policy.load_model_and_tokenizer, which keeps the saved tokenizer.")
    if engine.eos_ids != [sft_tokenizer.eos_token_id] or engine.pad_id != sft_tokenizer.pad_token_id:
        raise RuntimeError(f"the rollout stops on token ids {engine.eos_ids} and pads with {engine.pad_id}; SFT ended every "
                           f"solution with {sft_tokenizer.eos_token_id} and padded with {sft_tokenizer.pad_token_id}")

def encode_worked(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    "A right-padded SFT batch (B, T): prompt, worked solution, EOS; labels -100 except on the solution and EOS."
    pairs = [(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"],
              tokenizer(worked_solution(row), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for row in rows]
    T = max(len(p) + len(c) for p, c in pairs)
    input_ids = torch.full((len(pairs), T), tokenizer.pad_token_id)
    labels, attention_mask = torch.full((len(pairs), T), -100), torch.zeros((len(pairs), T), dtype=torch.long)
    for b, (p, c) in enumerate(pairs):
        input_ids[b, :len(p) + len(c)] = torch.tensor(p + c)
        labels[b, len(p):len(p) + len(c)] = torch.tensor(c)
        attention_mask[b, :len(p) + len(c)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ---------------------------------------------------------------- the base, carried between machines
BASE_STEM = "base.tgz"          # a saved base: DIR/base.tgz.partNN and DIR/base.json
BASE_RECORD = "base.json"       # in a saved base's folder, and in an OUT whose base came from one (--base)

def model_folder(model_name: str) -> Path:
    "The local folder of a model name (jetrl-tiny's is in the package)."
    from jetrl.tiny import TINY_DIR
    return TINY_DIR if model_name == "jetrl-tiny" else Path(model_name)

def base_fingerprint(model_name: str) -> str:
    """A hash of a model's weights (sha256 over every tensor of its safetensors files, by name: dtype, shape and bytes),
    16 hex digits: two bases with one fingerprint hold the same bits, however they were saved."""
    from safetensors import safe_open
    files = sorted(model_folder(model_name).glob("*.safetensors"))
    if not files: raise FileNotFoundError(f"no *.safetensors in {model_folder(model_name)}: give a model folder saved with save_pretrained")
    digest = hashlib.sha256()
    for file in files:
        with safe_open(file, "pt") as weights:
            for name in sorted(weights.keys()):
                t = weights.get_tensor(name).contiguous()
                digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode()); digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]

def save_base(folder: Path, into: Path, record: dict) -> list[Path]:
    """The base in `folder` (weights, tokenizers, sft.json; not an SFT's resume state) as `into/base.tgz.partNN`, and
    `into/base.json`: `record` with the base's fingerprint and SFT numbers. Returns the files written."""
    record = record | {"base_fingerprint": base_fingerprint(str(folder)), "sft": json.loads((folder / "sft.json").read_text())}
    parts = write_parts(_tgz(folder, {(folder / "sft_state.pt").resolve()}), into, BASE_STEM)
    (into / BASE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return parts + [into / BASE_RECORD]

def use_base(source: Path, out: Path, log=print, preset: str | None = None) -> dict:
    """OUT/base from the base saved in `source` (`save_base`) for `preset` (None: any): restored from its parts when OUT
    lacks it, then its fingerprint checked against source/base.json, and against the base OUT's runs started from
    (OUT/base.json). Writes OUT/base.json and, when the record holds it, OUT/eval_base.json. Returns the record."""
    if not (source / BASE_RECORD).is_file():
        raise FileNotFoundError(f"no {BASE_RECORD} in {source}: give --base the folder that --base-only wrote")
    record = json.loads((source / BASE_RECORD).read_text())
    if preset is not None and record.get("preset") not in (None, preset):
        raise ValueError(f"the base in {source} was built for the {record['preset']} preset, not {preset}: give --base the "
                         f"folder that --preset {preset} --base-only wrote")
    want = record["base_fingerprint"]
    if (out / BASE_RECORD).exists() and (had := json.loads((out / BASE_RECORD).read_text())["base_fingerprint"]) != want:
        raise ValueError(f"{out} holds runs of base {had} and {source} holds base {want}: give --base the base those runs "
                         "started from, or use another --out")
    folder = out / "base"
    if not (folder / "config.json").exists():
        extract_parts(source, BASE_STEM, folder, "--base-only")
        log(f"base {want}: restored from {source} into {folder}")
    have = base_fingerprint(str(folder))
    if have != want:
        raise ValueError(f"{folder} holds base {have}, not {want} as {source / BASE_RECORD} says: an OUT SFT'd in place or parts "
                         "from another build; use another --out, or copy the folder --base-only wrote again")
    (out / BASE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    if record.get("eval_base") is not None and not (out / "eval_base.json").exists():
        (out / "eval_base.json").write_text(json.dumps(record["eval_base"]) + "\n")
    return record


# ---------------------------------------------------------------- presets
WORKSHOP = ("bf16", "jet", "fp8-rollout", "rollout-tensorwise-e5m2", "rollout-nvfp4", "rollout-fp4-rowwise")

@dataclass(frozen=True)
class Preset:
    "One reproduction: the settings every strategy shares, the strategies, the seeds."
    name: str
    description: str
    strategies: tuple[str, ...]
    seeds: tuple[int, ...]
    train: TrainConfig                       # strategy and seed are set per run; everything else is shared
    sft: SFTSpec | None = None               # build the base policy first (the model name is then OUT/base)
    window: int = 5                          # steps averaged for accuracy_first / accuracy_last
    eval_prompts: int = 256                  # held-out prompts scored before and after training (0: none)
    min_base_accuracy: float = 0.0           # a base below this held-out accuracy is refused: not saved, no run started

def _config(**kw) -> TrainConfig:
    G = kw.pop("group_size", 8)
    return TrainConfig(**{"grpo": GRPOConfig(num_generations=G, loss_type="dapo", max_completion_length=kw.get("max_new_tokens", 12)), **kw})

# The GRPO settings every strategy shares, chosen so that bf16 itself learns: a comparison of strategies that all stay
# flat (or all fall) says nothing about precision. Measured on a CPU by a learning-rate probe (bf16 GRPO on a 0.46M base
# SFT'd by train_base_policy at peak lr 3e-3, 4-step chains; held-out 256 prompts x 4, base 0.635; rows and commands in
# benchmarks/results/reproduce_lr_probe_cpu.jsonl, 2026-12-01, ec32eae, fd96fef, f479e93), 30 steps, 2 seeds, mean gain:
#   16 prompts x 8:  lr 3e-5 +0.011, 1e-4 -0.014 (3e-4 -0.11 and 1e-3 -0.46 at 20 steps: every strategy falls, bf16 too)
#   64 prompts x 8:  lr 3e-5 +0.015, 1e-4 +0.007
#   128 prompts x 8: lr 3e-5 +0.020, 1e-4 +0.032 (seeds 0.663, 0.670), 3e-4 +0.007; 1e-4 at 12 / 24 steps +0.009 / +0.017
# The batch is what moves it: one Adam step moves every weight by ~lr whatever its gradient's size, and at 16 prompts
# GRPO's gradient is mostly noise. Not moving it (16 prompts, lr 1e-4): loss_type 'grpo' -0.011, scale_rewards 'none'
# -0.013; a less trained base (300 SFT steps, 0.11) fell at every lr. The 22.8M base is more fragile than the 0.46M
# one (at 16 prompts lr 1e-4 took it 0.59 -> 0.34 in 24 steps, as 3e-4..1e-3 do the small one), so its lr is the
# CPU optimum scaled by that ~5x: 2e-5 (1/50 of its SFT's peak lr; 1/30 on the CPU). 30 steps: the gain at 24 was
# within 1.3x the seed spread. On the H200 (benchmarks/results/reproduce_gpu.jsonl) bf16 went from 0.209 to
# 0.659 / 0.649 held out in 30 steps; every strategy learned (0.626-0.650 after).
GPU_STEPS = 30
GPU_PROMPTS = 128
# The SFT's loss falls steeply around steps 700-1,300, so where 1,500 steps end decides the base: two 1,500-step bases
# solved 0.209 and 0.006 of the held-out prompts, and no strategy learned from the second
# (benchmarks/results/reproduce_gpu_bases.jsonl). 2,000 steps go further down that slope; the floor below checks.
GPU_SFT_STEPS = 2000
# A base below this held-out accuracy is refused (check_base_floor): with 8 samples per prompt, at 0.1 more than half of
# the groups see a reward (1 - 0.9**8 = 0.57), at 0.006 one in twenty, and GRPO's advantages are 0 in the rest.
GPU_MIN_BASE_ACCURACY = 0.1
GPU_LR = 2e-5
# Learning parity needs seeds enough for an interval: 5 of the gpu preset, all on one base (--base). jet runs
# right after bf16 in each seed, so a set stopped early still holds whole pairs of the comparison that matters most.
GPU_SEEDS = (0, 1, 2, 3, 4)
# The long preset: a worked step is ~11 tokens of this tokenizer, so 200-step chains give worked solutions of ~2,180
# tokens (`worked_tokens`); the prompt lists the 200 moves (604 tokens on average, measured the same way). Its rows per step are half the gpu preset's
# so that a run's 30 steps fit one device call (a run's checkpoint is too large to carry between calls unfinished). It
# records no token samples: at ~2,200 tokens they would be most of the state each device call carries.
LONG_CHAIN_STEPS = 200
LONG_NEW_TOKENS = 2560
LONG_POSITIONS = 4096
LONG_PROMPTS = 64
LONG_SFT_STEPS = 800

PRESETS = {
    "smoke": Preset("smoke", "seconds: two strategies, two steps (tests)", ("bf16", "fp8-rollout"), (0,),
                    _config(steps=2, prompts_per_step=2, group_size=4, record_samples=1, log_kl_to_start=True), window=1, eval_prompts=16),
    "smoke-sft": Preset("smoke-sft", "seconds: a tiny base SFT'd first (tests of --base), two strategies, two steps", ("bf16", "jet"), (0, 1),
                        _config(task="arithmetic_chain", task_knobs=(("digits", 1), ("operators", "+-"), ("steps", 2)), steps=2,
                                prompts_per_step=2, group_size=4, max_new_tokens=24, record_samples=1, log_kl_to_start=True),
                        sft=SFTSpec(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, max_positions=256,
                                    chain_steps=(2, 3), digits=1, steps=3, batch_size=4, warmup_steps=1),
                        window=1, eval_prompts=8),
    "workshop": Preset("workshop", "CPU, the dose-response: the shipped tiny policy, its rollout precision turned down rung by rung "
                       "(bf16 -> FP8 E4M3 1x128 -> FP8 E5M2 per tensor -> 4-bit E2M1 1x16 -> 4-bit E2M1 per row), and jet",
                       WORKSHOP, (0, 1),
                       _config(steps=30, prompts_per_step=8, group_size=8, lr=2e-4, warmup_steps=5, record_samples=1)),
    "gpu": Preset("gpu", "GPU: a 22M-parameter Qwen2 trained on worked chain solutions, GRPO with ~500-token completions",
                  ("bf16", "jet", "fp8-rollout", "fp8-rollout-tis"), GPU_SEEDS,
                  _config(task="arithmetic_chain", task_knobs=(("digits", 2), ("operators", "+-"), ("steps", 48)),
                          steps=GPU_STEPS, prompts_per_step=GPU_PROMPTS, group_size=8, max_new_tokens=640, lr=GPU_LR, record_samples=1,
                          position_bucket=64, micro_batch_size=128, warmup_steps=5, log_kl_to_start=True),
                  sft=SFTSpec(steps=GPU_SFT_STEPS), min_base_accuracy=GPU_MIN_BASE_ACCURACY),
    "gpu-long": Preset("gpu-long", "GPU, toward the paper's regime: the 22M-parameter Qwen2 trained on 200-step chains, GRPO with "
                       "~2,200-token completions", ("bf16", "jet", "fp8-rollout"), (0, 1, 2),
                       _config(task="arithmetic_chain", task_knobs=(("digits", 2), ("operators", "+-"), ("steps", LONG_CHAIN_STEPS)),
                               steps=GPU_STEPS, prompts_per_step=LONG_PROMPTS, group_size=8, max_new_tokens=LONG_NEW_TOKENS,
                               lr=GPU_LR, record_samples=0, position_bucket=256, micro_batch_size=32, warmup_steps=5,
                               log_kl_to_start=True),
                       sft=SFTSpec(steps=LONG_SFT_STEPS, batch_size=16, chain_steps=(8, 32, 64, 128, LONG_CHAIN_STEPS),
                                   max_positions=LONG_POSITIONS), min_base_accuracy=GPU_MIN_BASE_ACCURACY),
}


# ---------------------------------------------------------------- running, resumably
EVAL_SEED = 10**9 + 7      # held-out prompts; GRPO's are seeded run_seed * 1_000_003 + step, far below

def eval_rows(preset: Preset) -> list[dict]:
    "The held-out prompts: the preset's task, seeded apart from every training prompt."
    task = make_task(preset.train)                     # the task and knobs training uses (its own defaults when None)
    return replace(task, seed=EVAL_SEED).sample(preset.eval_prompts)

EVAL_SAMPLES = 4           # completions per held-out prompt

@torch.no_grad()
def held_out_accuracy(model: nn.Module, tokenizer, rows: list[dict], config: TrainConfig) -> float:
    """Accuracy on `rows` at the training temperature (EVAL_SAMPLES completions each, a fixed sampling seed) of the
    master weights in high precision: a copy of `model` with every FP8 linear switched to 'bf16', so that every
    strategy is scored the same way (the paper scores its checkpoints, not its sampler)."""
    from jetrl.rollout import RolloutEngine, SamplingParams
    hp_model = set_recipe(copy.deepcopy(model), "bf16").eval()
    params = SamplingParams(n=EVAL_SAMPLES, max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=EVAL_SEED)
    rollout = RolloutEngine(hp_model, tokenizer).generate([r["prompt"] for r in rows], params)
    answers = [r["answer"] for r in rows for _ in range(EVAL_SAMPLES)]
    return sum(number_reward(rollout.prompts, rollout.completions, answers)) / len(answers)

def check_base_floor(preset: Preset, accuracy: float, what: str, consequence: str = ""):
    "A RuntimeError when `accuracy` (held out) is below the preset's `min_base_accuracy`, naming what to change."
    if accuracy >= preset.min_base_accuracy: return
    sft = preset.sft
    raise RuntimeError(f"{what} solves {accuracy:.3f} of the held-out prompts, below the {preset.name} preset's floor of "
                       f"{preset.min_base_accuracy}: GRPO from it sees a reward in too few groups to learn; {consequence}"
                       f"Build a base with a longer SFT (--sft-steps, now {sft.steps if sft else '-'}) or another seed (--sft-seed, "
                       f"now {sft.seed if sft else '-'}) with --base-only in a fresh --out")

def base_accuracy(preset: Preset, out: Path, model_name: str, device: str) -> float | None:
    "The held-out accuracy of the starting policy (the same for every strategy), computed once into OUT/eval_base.json."
    if not preset.eval_prompts: return None
    file = out / "eval_base.json"
    if not file.exists():
        policy = build_policy("bf16", model_name, device)
        accuracy = held_out_accuracy(policy.model, policy.tokenizer, eval_rows(preset), preset.train)
        out.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({"accuracy": accuracy, "prompts": preset.eval_prompts, "samples": EVAL_SAMPLES,
                                    "seed": EVAL_SEED}) + "\n")
    return json.loads(file.read_text())["accuracy"]

def run_dir(out: Path, strategy: str, seed: int) -> Path: return out / "runs" / f"{strategy}_seed{seed}"

def run_all(preset: Preset, out: Path, device: str, deadline: float, log=print, base: Path | None = None,
            prior_run_s: dict | None = None, budget_s: float = math.inf) -> bool:
    """Every (seed, strategy) run of `preset`, in order, on its base: SFT'd into OUT/base, or restored from `base` (a folder
    `save_base` wrote; `use_base`). True when all are done, False when the deadline stopped it. A run starts only if
    `expected_run_seconds` (`prior_run_s` while none is finished or cut) fits before the deadline; one expected to take
    longer than the call's whole `budget_s` is an error (it could never finish in one call)."""
    model = preset.train.model
    if preset.sft is not None:
        if base is not None: use_base(base, out, log, preset.name)
        elif not train_base_policy(preset.sft, out / "base", device, deadline, log): return False
        model = str(out / "base")
        check_base_format(out / "base", preset.sft)
    elif base is not None:
        raise ValueError(f"--base is for the presets that train their base ({', '.join(n for n, p in PRESETS.items() if p.sft)}); "
                         f"{preset.name} starts from {preset.train.model} as it is: leave --base out")
    before = base_accuracy(preset, out, model, device)
    if before is not None and preset.sft is not None:
        check_base_floor(preset, before, f"the base in {out / 'base'}", "no run was started. ")
    if before is not None:
        log(f"base policy: held-out accuracy {before:.3f} ({preset.eval_prompts} prompts x {EVAL_SAMPLES} samples)"
            + ("; no sample is right, so the accuracy reward gives GRPO no signal" if before == 0 else ""))
    for seed in preset.seeds:
        for strategy in preset.strategies:
            folder = run_dir(out, strategy, seed)
            if (folder / "done.json").exists(): continue
            config = replace(preset.train, model=model, strategy=strategy, seed=seed)
            expected = expected_run_seconds(out, strategy, config.steps, prior_run_s)
            if not (folder / "checkpoint").exists() and expected > budget_s:
                raise RuntimeError(f"a {strategy} run takes about {expected:.0f} s, more than a call's whole --time-budget "
                                   f"({budget_s:.0f} s), and an unfinished run is not carried: give a larger --time-budget or fewer --steps")
            if not (folder / "checkpoint").exists() and time.time() + expected > deadline:
                log(f"{strategy} seed {seed}: not started, it would take about {expected:.0f} s (the time per step of the "
                    "finished runs) and the time budget is nearly spent; run again to continue")
                return False
            policy = build_policy(strategy, model, device)
            started, times = time.time(), []                       # times: this call's steps (time/step)
            def on_step(metrics, times=times):
                times.append(metrics["time/step"])
                mean = sum(times) / len(times)
                return time.time() + mean <= deadline              # False: stop after this step (it is saved)
            run = train(config, folder, resume=(folder / "metrics.jsonl").exists(), callbacks=[on_step], policy=policy,
                        progress=sys.stderr.isatty())
            steps_done = len(read_metrics(folder)[1])
            if times: record_step_seconds(out, strategy, sum(times) / len(times))
            log(f"{strategy} seed {seed}: {steps_done}/{config.steps} steps, {time.time() - started:.0f} s this call")
            if steps_done < config.steps: return False
            seconds = time.time() - started
            done = {"steps": steps_done, "seconds_this_call": round(seconds, 1), "steps_this_call": len(times),
                    "overhead_s": round(seconds - sum(times), 1),               # start-up, checkpoints: a run's seconds beside its steps
                    "device_name": device_name(device),                         # where its last steps ran (a row says it),
                    "software": software_versions()}                            # and with which torch, CUDA and Triton
            if preset.eval_prompts:
                started = time.time()
                done["eval_accuracy"] = held_out_accuracy(run.policy.model, run.policy.tokenizer, eval_rows(preset), config)
                done["eval_seconds"] = round(time.time() - started, 3)      # a smoke eval can take under 50 ms
                log(f"{strategy} seed {seed}: held-out accuracy {done['eval_accuracy']:.3f}")
            (folder / "done.json").write_text(json.dumps(done) + "\n")
            import shutil; shutil.rmtree(folder / "checkpoint", ignore_errors=True)   # a finished run keeps its metrics only
    return True


def build_base(preset: Preset, out: Path, device: str, deadline: float, into: Path, command: str, log=print) -> dict:
    """`--base-only`: the preset's base SFT'd into OUT/base, checked (`check_base_format`), its held-out accuracy measured,
    then saved into `into` (`save_base`) with the preset, that accuracy, the command, date and commit. Returns the record."""
    if preset.sft is None:
        raise ValueError(f"--base-only builds the base of a preset that trains one ({', '.join(n for n, p in PRESETS.items() if p.sft)}); "
                         f"{preset.name} starts from {preset.train.model}")
    if not train_base_policy(preset.sft, out / "base", device, deadline, log):
        raise RuntimeError(f"the SFT stopped at --time-budget, and its resume state (weights and AdamW moments in fp32) is too "
                           f"large to carry between device calls: run --base-only with a larger --time-budget, or none")
    check_base_format(out / "base", preset.sft)
    base_accuracy(preset, out, str(out / "base"), device)
    evaluated = json.loads((out / "eval_base.json").read_text()) if (out / "eval_base.json").exists() else None
    if evaluated is not None: check_base_floor(preset, evaluated["accuracy"], f"the base SFT'd in {out / 'base'}",
                                               f"it was not saved into {into}. ")
    files = save_base(out / "base", into, {"preset": preset.name, "eval_base": evaluated, "device_name": device_name(device),
                                           "command": command, **provenance()})
    record = json.loads((into / BASE_RECORD).read_text())
    log(f"base {record['base_fingerprint']} ({preset.name}): held-out accuracy "
        f"{'-' if evaluated is None else format(evaluated['accuracy'], '.3f')}; saved as "
        + ", ".join(f"{f.name} ({f.stat().st_size / MiB:.1f} MiB)" for f in files) + f" in {into}")
    return record


STEP_SECONDS = "step_seconds.json"   # in OUT: strategy -> mean s/step of its latest run there, finished or cut short
                                     # (a cut run's folder is left out of --pack; this small file travels)

def software_versions() -> dict:
    "The versions a run's numbers depend on besides jetrl's commit: torch, its CUDA (None on a CPU build) and Triton."
    try: import triton; triton_version = triton.__version__
    except ImportError: triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}

def device_name(device: str) -> str:
    "The accelerator's name as torch reports it ('NVIDIA H100 80GB HBM3'), or 'cpu'."
    return torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else "cpu"

def record_step_seconds(out: Path, strategy: str, seconds: float) -> None:
    file = out / STEP_SECONDS
    record = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps(record | {strategy: round(seconds, 3)}) + "\n")

def expected_run_seconds(out: Path, strategy: str, steps: int, prior: dict | None = None) -> float:
    """A fresh run's duration: `steps` x the mean step time of this strategy's finished runs, plus their seconds beside
    the steps and their eval's (done.json); else `steps` x the step time its latest run measured (OUT/step_seconds.json,
    a run cut short included); else the slowest finished run's, or the slowest recorded step time; else
    `prior[strategy]` (the plan's estimate; the largest of it for a strategy it lacks), else 0."""
    per_run = {}
    for f in (out / "runs").glob("*_seed*"):
        if (f / "done.json").exists():
            done, times = json.loads((f / "done.json").read_text()), [m["time/step"] for m in read_metrics(f)[1]]
            per_run.setdefault(f.name.rsplit("_seed", 1)[0], []).append(
                steps * sum(times) / max(len(times), 1) + done.get("overhead_s", 0.0) + done.get("eval_seconds", 0.0))
    cut = json.loads((out / STEP_SECONDS).read_text()) if (out / STEP_SECONDS).exists() else {}
    if strategy in per_run: return _mean(per_run[strategy])
    if strategy in cut: return steps * cut[strategy]
    if per_run: return max(max(v) for v in per_run.values())
    if cut: return steps * max(cut.values())
    return (prior or {}).get(strategy, max((prior or {}).values(), default=0.0))


# ---------------------------------------------------------------- the report
def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else math.nan

def run_summary(preset: Preset, strategy: str, seed: int, history: list[dict], model_params: int, command: str,
                evals: tuple[float | None, float | None] = (None, None), base_fingerprint: str | None = None,
                done: dict | None = None) -> dict:
    "One row of the results file; `done`: the run's done.json (its seconds beside the steps, its eval's seconds)."
    w, done = preset.window, done or {}
    first, last = _mean([m["accuracy"] for m in history[:w]]), _mean([m["accuracy"] for m in history[-w:]])
    finite = all(math.isfinite(m.get("loss", 0.0)) and math.isfinite(m.get("grad_norm", 0.0)) for m in history)
    key = lambda k: _mean([m.get(k) for m in history])
    eval_before, eval_after = evals
    dropped = eval_before is not None and eval_after is not None and eval_after < eval_before - DIVERGENCE_DROP
    return {"strategy": strategy, "seed": seed, "model_params": model_params, "max_new_tokens": preset.train.max_new_tokens,
            "steps": len(history), "accuracy_first": first, "accuracy_last": last,
            "diverged": (not finite) or last < first - DIVERGENCE_DROP or dropped,
            "eval_accuracy_before": eval_before, "eval_accuracy_after": eval_after,
            "kl_k3_mean": key("mismatch/kl_k3"), "logp_abs_diff_mean": key("mismatch/logp_abs_diff_mean"),
            "is_ratio_mean": key("mismatch/is_ratio_mean"), "is_ratio_min": min(m["mismatch/is_ratio_min"] for m in history),
            "is_ratio_max": max(m["mismatch/is_ratio_max"] for m in history), "ess_mean": key("mismatch/ess"),
            "tis_clip_frac_mean": key("mismatch/tis_clip_frac"), "token_mult_prob_error_mean": key("mismatch/token_mult_prob_error"),
            "completion_length_mean": key("completions/mean_length"), "seconds_per_step": key("time/step"),
            # the diagnostics of a learning difference: clipping split by the advantage's sign (TRL's clip_ratio/low_mean
            # is the negative-advantage tokens below 1 - epsilon, high_mean the positive ones above 1 + epsilon_high, each
            # a fraction of all completion tokens; rollout_clip_frac_*: the same cuts with the rollout's log-probs as
            # pi_old, what the mismatch alone would clip), entropy, gradient norm, KL to the starting policy at the end of
            # training, and the mismatch by token position over the whole run
            "clip_frac_neg_adv": key("clip_ratio/low_mean"), "clip_frac_pos_adv": key("clip_ratio/high_mean"),
            "rollout_clip_frac_neg_adv": key("mismatch/clip_ratio/low_mean"), "rollout_clip_frac_pos_adv": key("mismatch/clip_ratio/high_mean"),
            "entropy_first": _mean([m.get("entropy") for m in history[:w]]),
            "entropy_last": _mean([m.get("entropy") for m in history[-w:]]),
            "grad_norm_mean": key("grad_norm"), "grad_norm_max": max((m["grad_norm"] for m in history if "grad_norm" in m), default=None),
            "kl_to_prev_policy_mean": key("drift/kl_to_prev_policy"),
            "kl_to_start_last": _mean([m.get("drift/kl_to_start") for m in history[-w:]]),
            "logp_abs_diff_by_position": dict(zip(("positions", "logp_abs_diff_mean"), position_profile(history, parts=1)[0][1:])),
            "base_fingerprint": base_fingerprint, "rows_per_step": preset.train.rows_per_step,
            "overhead_s": done.get("overhead_s"), "eval_seconds": done.get("eval_seconds"), "device_name": done.get("device_name"),
            "software": done.get("software"), "preset": preset.name, "rollout": DESCRIPTIONS.get(strategy, strategy), "command": command, **provenance(),
            "complete": None}                                  # write_report: whether every run of the set is finished

def _fmt(x, spec=".2f") -> str: return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

def paper_table(rows: list[dict], strategies: tuple[str, ...]) -> str:
    "Markdown, one line per strategy, seeds pooled: the shape of the paper's table plus the mismatch it measured."
    head = ("| strategy | rollout side | seeds | held-out accuracy before -> after (per seed) | train accuracy first -> last "
            "| diverged | mismatch k3 | mean \\|dlogp\\| | IS ratio min / max | ESS | TIS clip frac |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for s in strategies:
        r = [row for row in rows if row["strategy"] == s]
        if not r: continue
        after = [x["eval_accuracy_after"] for x in r]
        per_seed = ", ".join(_fmt(a) for a in after)
        before = r[0]["eval_accuracy_before"]
        lines.append(f"| `{s}` | {DESCRIPTIONS.get(s, s)} | {len(r)} | {_fmt(before)} -> {_fmt(_mean(after))} ({per_seed}) | "
                     f"{_mean([x['accuracy_first'] for x in r]):.2f} -> {_mean([x['accuracy_last'] for x in r]):.2f} | "
                     f"{sum(x['diverged'] for x in r)}/{len(r)} | {_mean([x['kl_k3_mean'] for x in r]):.1e} | "
                     f"{_mean([x['logp_abs_diff_mean'] for x in r]):.1e} | {min(x['is_ratio_min'] for x in r):.3g} / "
                     f"{max(x['is_ratio_max'] for x in r):.3g} | {_mean([x['ess_mean'] for x in r]):.4f} | "
                     f"{_mean([x['tis_clip_frac_mean'] for x in r]):.1e} |")
    return "\n".join(lines)

def position_profile(history: list[dict], parts: int = 3) -> list[tuple[str, list, list]]:
    "Mean |dlogp| by token position in `parts` spans of training: (label, positions, values)."
    out, n = [], len(history)
    for p in range(parts):
        span = history[p * n // parts:(p + 1) * n // parts]
        if not span: continue
        sums, counts = {}, {}
        for m in span:
            bp = m.get("mismatch/by_position") or {"positions": [], "logp_abs_diff_mean": [], "tokens": []}
            for pos, v, t in zip(bp["positions"], bp["logp_abs_diff_mean"], bp["tokens"]):
                sums[pos] = sums.get(pos, 0.0) + v * t; counts[pos] = counts.get(pos, 0) + t
        positions = sorted(sums)
        out.append((f"steps {span[0]['step']}-{span[-1]['step']}", positions, [sums[q] / counts[q] for q in positions]))
    return out

CURVE_KEYS = ("accuracy", "reward", "mismatch/kl_k3", "mismatch/logp_abs_diff_mean", "mismatch/is_ratio_min",
              "mismatch/is_ratio_max", "mismatch/ess", "mismatch/tis_clip_frac", "completions/mean_length")
DIAGNOSTIC_KEYS = ("entropy", "grad_norm", "drift/kl_to_start", "drift/kl_to_prev_policy", "clip_ratio/low_mean",
                   "clip_ratio/high_mean", "mismatch/clip_ratio/low_mean", "mismatch/clip_ratio/high_mean")

def curves(histories: dict[tuple[str, int], list[dict]]) -> dict:
    """The per-step curves (a metric a run did not log: None at each step) and the |dlogp|-by-position profile of every
    run, small enough to commit beside the results."""
    return {f"{s}_seed{seed}": {"strategy": s, "seed": seed, **{k: [m.get(k) for m in h] for k in CURVE_KEYS + DIAGNOSTIC_KEYS},
                                "by_position": [{"steps": label, "positions": pos, "logp_abs_diff_mean": val}
                                                for label, pos, val in position_profile(h)]}
            for (s, seed), h in histories.items()}

def learning_gain(row: dict) -> float:
    "What training bought: held-out accuracy after - before when measured, else train accuracy last - first window."
    if row.get("eval_accuracy_after") is not None and row.get("eval_accuracy_before") is not None:
        return row["eval_accuracy_after"] - row["eval_accuracy_before"]
    return row["accuracy_last"] - row["accuracy_first"]

def report_figure(run_curves: dict, rows: list[dict], strategies: tuple[str, ...]):
    """Six panels drawn from saved curves (the `curves()` format, e.g. a results file's `_curves.json`) and result rows:
    train accuracy, mismatch k3, |dlogp| by token position (each run's last span of training), IS ratio max, ESS (per
    step, the seeds of a strategy averaged), and held-out accuracy gain against mean |dlogp| (one dot per run)."""
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go
    titles = ["train accuracy (per step, seeds averaged)", "mismatch KL (k3)", "mean |dlogp| by token position (last third of training)",
              "IS ratio pi_train / pi_rollout: max per step (seeds averaged)", "effective sample size", "held-out accuracy gain vs measured mismatch (one dot per run)"]
    fig = make_subplots(rows=2, cols=3, subplot_titles=titles)
    palette = ["#1f77b4", "#2ca02c", "#9467bd", "#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    positive = [r["logp_abs_diff_mean"] for r in rows if r["logp_abs_diff_mean"] > 0]
    zero_at = min(positive) / 10 if positive else 1e-9           # where a run without any mismatch sits on the log axis
    for i, s in enumerate(strategies):
        color, seeds = palette[i % len(palette)], [c for c in run_curves.values() if c["strategy"] == s and c["accuracy"]]
        if not seeds: continue
        steps = list(range(min(len(c["accuracy"]) for c in seeds)))
        mean_of = lambda key: [_mean([c[key][k] for c in seeds]) for k in steps]
        for p, key, panel in ((0, "accuracy", (1, 1)), (1, "mismatch/kl_k3", (1, 2)), (3, "mismatch/is_ratio_max", (2, 1)),
                              (4, "mismatch/ess", (2, 2))):
            fig.add_trace(go.Scatter(x=steps, y=mean_of(key), name=s, legendgroup=s, showlegend=p == 0,
                                     line=dict(color=color)), *panel)
        by_position = {}                                                  # position -> that bucket's |dlogp| in each seed
        for last in (c["by_position"][-1] for c in seeds if c["by_position"]):
            for q, v in zip(last["positions"], last["logp_abs_diff_mean"]): by_position.setdefault(q, []).append(v)
        fig.add_trace(go.Scatter(x=sorted(by_position), y=[_mean(by_position[q]) for q in sorted(by_position)], name=s,
                                 legendgroup=s, showlegend=False, line=dict(color=color)), 1, 3)
        r = [row for row in rows if row["strategy"] == s]
        fig.add_trace(go.Scatter(x=[x["logp_abs_diff_mean"] or zero_at for x in r], y=[learning_gain(x) for x in r],
                                 mode="markers", marker=dict(color=color, size=9), name=s, legendgroup=s, showlegend=False,
                                 text=[f"seed {x['seed']}" + ", mismatch exactly 0" * (not x["logp_abs_diff_mean"]) for x in r]), 2, 3)
    fig.update_yaxes(type="log", row=1, col=2); fig.update_yaxes(type="log", row=1, col=3); fig.update_xaxes(type="log", row=2, col=3)
    fig.update_xaxes(title_text="step", row=1, col=1); fig.update_xaxes(title_text="token position (bucket start)", row=1, col=3)
    fig.update_xaxes(title_text=f"mean |dlogp| over the run (exactly 0: drawn at {zero_at:.0e})", row=2, col=3); fig.update_yaxes(title_text="accuracy gain", row=2, col=3)
    fig.update_layout(height=800, title="jetrl reproduce: the same GRPO run under each rollout precision "
                                        "(a mismatch of exactly 0 has no line on the log axes of the top row)")
    return fig

def diagnostics_figure(run_curves: dict, strategies: tuple[str, ...]):
    """What would show why one strategy learns differently, per step (the seeds of a strategy averaged), from saved
    curves: entropy, gradient norm, KL to the starting policy and to the previous one, and the tokens a clip cut by the
    advantage's sign: in the loss (solid; 0 when every batch is used for one optimizer step) and with the rollout's
    log-probs as pi_old (dotted: what the rollout/trainer mismatch alone would clip). None when no curve holds them."""
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go
    panels = [("entropy", "entropy", None), ("gradient norm (before clipping)", "grad_norm", None),
              ("KL to the starting policy", "drift/kl_to_start", None), ("KL to the previous policy", "drift/kl_to_prev_policy", None),
              ("clipped, negative advantage (r < 1 - eps)", "clip_ratio/low_mean", "mismatch/clip_ratio/low_mean"),
              ("clipped, positive advantage (r > 1 + eps_high)", "clip_ratio/high_mean", "mismatch/clip_ratio/high_mean")]
    if not any(c.get(key) and any(v is not None for v in c[key]) for c in run_curves.values() for _, key, _ in panels): return None
    fig = make_subplots(rows=2, cols=3, subplot_titles=[title for title, _, _ in panels])
    palette = ["#1f77b4", "#2ca02c", "#9467bd", "#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    for i, s in enumerate(strategies):
        seeds = [c for c in run_curves.values() if c["strategy"] == s and c["accuracy"]]
        if not seeds: continue
        steps = list(range(min(len(c["accuracy"]) for c in seeds)))
        for p, (_, key, rollout_key) in enumerate(panels):
            for k, dash in ((key, None), (rollout_key, "dot")):
                if k is None or not any(c.get(k) and c[k][0] is not None for c in seeds): continue
                fig.add_trace(go.Scatter(x=steps, y=[_mean([(c.get(k) or [None] * len(steps))[j] for c in seeds]) for j in steps],
                                         name=s, legendgroup=s, showlegend=p == 0 and dash is None,
                                         line=dict(color=palette[i % len(palette)], dash=dash)), p // 3 + 1, p % 3 + 1)
    fig.update_xaxes(title_text="step")
    fig.update_layout(height=700, title="Diagnostics per step (bottom row: solid in the loss, dotted with the rollout's log-probs as pi_old)")
    return fig

def report_note(preset: Preset, finished: list[tuple[str, int]] | None = None) -> str:
    "What table.md's numbers mean; with `finished` (the finished runs) short of the whole set, which runs are done."
    note = (f"{preset.description}. Seeds {list(preset.seeds)}. Held-out accuracy: {preset.eval_prompts} prompts never trained on, "
            f"{EVAL_SAMPLES} samples each at the training temperature, master weights in high precision. Train accuracy: mean over the first / last {preset.window} steps "
            f"(sampled, new prompts each step). Diverged: a non-finite loss, or either accuracy falling by more than {DIVERGENCE_DROP}.")
    if finished is not None and len(finished) < len(preset.strategies) * len(preset.seeds):
        note += (f" Incomplete: {len(finished)} of {len(preset.strategies) * len(preset.seeds)} runs finished "
                 f"({', '.join(f'{s} seed {seed}' for s, seed in finished) or 'none'}); a run without an 'after' accuracy is still going.")
    return note

def write_report_html(out: Path, title: str, note: str, table: str, command: str, run_curves: dict, rows: list[dict],
                      strategies: tuple[str, ...], log=print, plotlyjs: str = "inline") -> bool:
    """OUT/report.html: the note, the table and the command, then `report_figure`; True with the figure. Without plotly
    (the GPU machine has torch, transformers, triton and numpy only) the page says so and holds the rest. `plotlyjs`:
    'inline' (a self-contained page, ~4.8 MB) or 'cdn' (tens of KB; loads plotly.js from its CDN when opened)."""
    if plotlyjs not in ("inline", "cdn"): raise ValueError(f"plotlyjs must be 'inline' or 'cdn', got {plotlyjs!r}")
    header = f"<h2>{title}</h2><p>{note}</p><pre>{table}</pre><p><code>{command}</code></p>"
    try: fig = report_figure(run_curves, rows, strategies)
    except ImportError as e:                      # plotly is optional: the numbers are written before the figure
        log(f"report: no figure ({e}); the table and the numbers are written. `pip install plotly` and run again, or draw "
            "it elsewhere from the results file: python scripts/reproduce.py --report-from RESULTS.jsonl --out DIR")
        (out / "report.html").write_text(f"<!doctype html><html><body>{header}<p>No figure: {e}.</p></body></html>\n")
        return False
    html = fig.to_html(include_plotlyjs=True if plotlyjs == "inline" else "cdn", full_html=True)
    diagnostics = diagnostics_figure(run_curves, strategies)
    if diagnostics is not None: html = html.replace("</body>", diagnostics.to_html(include_plotlyjs=False, full_html=False) + "</body>", 1)
    (out / "report.html").write_text(html.replace("<body>", "<body>" + header, 1))
    return True

def write_report(preset: Preset, out: Path, command: str, results: Path | None, log=print) -> tuple[str, list[dict]]:
    """table.md and summary.jsonl in `out` (every run with a finished step), the results file and its curves (the finished
    runs only, each marked `complete`: whether every (strategy, seed) of the preset is finished), then report.html
    (`write_report_html`, the figure drawn from the same curves as the results file's). Returns (table, rows)."""
    histories, rows, finished = {}, [], []
    model = str(out / "base") if preset.sft is not None else preset.train.model
    model_params = _count_params(model)
    try: fingerprint = base_fingerprint(model)
    except FileNotFoundError: fingerprint = None                # a hub model, not on this machine as a folder
    for seed in preset.seeds:
        for s in preset.strategies:
            folder = run_dir(out, s, seed)
            if not (folder / "metrics.jsonl").exists(): continue
            history = read_metrics(folder)[1]
            if not history: continue
            histories[(s, seed)] = history
            done = json.loads((folder / "done.json").read_text()) if (folder / "done.json").exists() else {}
            before = json.loads((out / "eval_base.json").read_text())["accuracy"] if (out / "eval_base.json").exists() else None
            rows.append(run_summary(preset, s, seed, history, model_params, command, (before, done.get("eval_accuracy")),
                                    fingerprint, done))
            if done: finished.append((s, seed))
    if not rows: raise RuntimeError(f"no run in {out} has a finished step yet: nothing to report")
    complete = len(finished) == len(preset.strategies) * len(preset.seeds)
    for r in rows: r["complete"] = complete
    table, note = paper_table(rows, preset.strategies), report_note(preset, finished)
    (out / "table.md").write_text(table + "\n\n" + note + "\n")
    (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if results is not None and finished:
        done_rows = [{k: r[k] for k in RESULT_KEYS} for r in rows if (r["strategy"], r["seed"]) in finished]
        merge_results(results, done_rows, curves({k: histories[k] for k in finished}))
    write_report_html(out, f"jetrl reproduce ({preset.name})", note, table, command, curves(histories), rows, preset.strategies, log)
    return table, rows

def _run_key(row: dict) -> tuple:
    "What makes a results row one run: its preset, strategy, seed and base."
    return row.get("preset"), row["strategy"], row["seed"], row.get("base_fingerprint")

def merge_results(results: Path, rows: list[dict], run_curves: dict):
    """Write `rows` (finished runs) into the results file and `run_curves` into its `curves_file`, keeping every row and
    curve of other runs already there (another OUT's, an earlier call's): a row of the same run (`_run_key`) is
    replaced, the rest stay in their order. A results file that does not read as JSON lines is refused before anything
    is written, naming the line."""
    kept, replaced = [], {_run_key(r) for r in rows}
    if results.exists():
        for number, line in enumerate(results.read_text().splitlines(), 1):
            if not line.strip(): continue
            try: row = json.loads(line)
            except ValueError:
                raise ValueError(f"{results}, line {number}, is not JSON: mend or move the file, then run again "
                                 "(the runs are kept in OUT; nothing was written)") from None
            if not (isinstance(row, dict) and "strategy" in row and "seed" in row and _run_key(row) in replaced): kept.append(row)
    try: saved_curves = json.loads(curves_file(results).read_text()) if curves_file(results).exists() else {}
    except ValueError:
        raise ValueError(f"{curves_file(results)} is not JSON: mend or move it, then run again (the runs are kept in OUT; "
                         "nothing was written)") from None
    results.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(results, "".join(json.dumps(r) + "\n" for r in kept + rows))        # a kill: the old file or the new
    write_atomically(curves_file(results), json.dumps(saved_curves | run_curves) + "\n")

def curves_file(results: Path) -> Path:
    "The curves saved beside a results file: reproduce_gpu.jsonl -> reproduce_gpu_curves.json."
    return results.with_name(results.stem + "_curves.json")

def report_from_results(results: Path, out: Path, log=print, plotlyjs: str = "inline") -> str:
    """Redraw the report of a saved reproduction (no run folders needed): `results` (a results JSONL) and its
    `curves_file` -> OUT/table.md and OUT/report.html with the figure. Strategies in the results' order; the note from
    the preset the rows name (its description, the seeds found). Returns the table."""
    if not results.is_file(): raise FileNotFoundError(f"no results file {results}: give the JSONL a reproduction wrote "
                                                      "(e.g. benchmarks/results/reproduce_gpu.jsonl)")
    saved_curves = curves_file(results)
    if not saved_curves.is_file():
        raise FileNotFoundError(f"{saved_curves.name} is missing beside {results}: the figure is drawn from the per-step curves "
                                f"that write_report saves as {saved_curves}; copy it there (or rerun the reproduction's command "
                                "with --results pointing at this file) and try again")
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    if not rows: raise ValueError(f"{results} holds no result rows")
    run_curves = json.loads(saved_curves.read_text())
    missing = [f"{r['strategy']}_seed{r['seed']}" for r in rows if f"{r['strategy']}_seed{r['seed']}" not in run_curves]
    if missing: raise ValueError(f"{saved_curves} has no curves for {missing} of {results}: the two files are from different runs")
    strategies = tuple(dict.fromkeys(r["strategy"] for r in rows))
    seeds = tuple(dict.fromkeys(r["seed"] for r in rows))
    preset = PRESETS.get(rows[0].get("preset"))
    table = paper_table(rows, strategies)
    note = (report_note(replace(preset, strategies=strategies, seeds=seeds)) if preset is not None
            else f"{len(rows)} runs of {results.name}.")
    if not all(r.get("complete", True) for r in rows): note += " Incomplete: the set had unfinished runs when this file was written."
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n\n" + note + "\n")
    title = f"jetrl reproduce ({rows[0].get('preset', results.stem)}), from {results.name}"
    if not write_report_html(out, title, note, table, rows[0].get("command", ""), run_curves, rows, strategies, log, plotlyjs):
        raise RuntimeError("plotly is needed to draw the figure: `pip install plotly` and run again (table.md is written)")
    return table

RESULT_KEYS = ("strategy", "seed", "model_params", "max_new_tokens", "steps", "accuracy_first", "accuracy_last", "diverged",
               "eval_accuracy_before", "eval_accuracy_after",
               "kl_k3_mean", "logp_abs_diff_mean", "is_ratio_min", "is_ratio_max", "ess_mean", "tis_clip_frac_mean",
               "completion_length_mean", "seconds_per_step", "clip_frac_neg_adv", "clip_frac_pos_adv", "entropy_first",
               "entropy_last", "grad_norm_mean", "kl_to_prev_policy_mean", "rollout_clip_frac_neg_adv", "rollout_clip_frac_pos_adv",
               "grad_norm_max", "kl_to_start_last", "logp_abs_diff_by_position", "base_fingerprint", "rows_per_step", "overhead_s",
               "eval_seconds", "device_name", "software", "preset", "complete", "command", "date", "git_sha")

def _count_params(model_name: str) -> int:
    config = Path(model_name) / "config.json"
    if model_name == "jetrl-tiny":
        from jetrl.tiny import TINY_DIR; config = TINY_DIR / "config.json"
    if not config.exists(): return 0
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"): m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.parent))
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------- moving the work between machines
def _tgz(out: Path, leave_out: set[Path]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        tar.add(out, arcname=".", filter=lambda info: None if (out / info.name).resolve() in leave_out else info)
    return buffer.getvalue()

def pack(out: Path, into: Path, limit: int = PACK_BYTES, log=print) -> list[Path]:
    """OUT as gzip'd tar parts `reproduce.tgz.partNN` of at most PART_BYTES each, `limit` in all, less OUT/base when it
    came from `--base` (OUT/base.json names it: the next call restores it from the same parts). Over the limit,
    the folders of unfinished runs and an unfinished SFT's state are left out (they restart from step 0 next time:
    said loudly; finished runs and the finished base are always kept);
    still over, it stops and names the largest files. OUT itself is never changed."""
    carried = {(out / "base").resolve()} if (out / BASE_RECORD).exists() else set()
    data = _tgz(out, carried)
    if len(data) > limit:           # whole folders: a run's metrics without its checkpoint would refuse to resume
        unfinished = {f.resolve() for f in (out / "runs").glob("*_seed*") if f.is_dir() and not (f / "done.json").exists()}
        sft_state = {p.resolve() for p in [out / "base" / "sft_state.pt"] if p.exists()}
        if unfinished or sft_state:
            data = _tgz(out, carried | unfinished | sft_state)
            log(f"pack: {out} is over {limit / MiB:.0f} MiB with its checkpoints; left out "
                + "; ".join([f"the unfinished runs {sorted(p.name for p in unfinished)} (after --unpack they restart from step 0)"] * bool(unfinished)
                            + ["the unfinished SFT's state (after --unpack it restarts from step 0)"] * bool(sft_state)))
    if len(data) > limit:
        files = sorted((p for p in out.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)[:5]
        biggest = ", ".join(f"{p.relative_to(out)} ({p.stat().st_size / MiB:.1f} MiB)" for p in files)
        raise RuntimeError(f"{out} packs to {len(data) / MiB:.1f} MiB, over the {limit / MiB:.0f} MiB a device call brings "
                           f"back; largest files: {biggest}. Nothing was deleted.")
    return write_parts(data, into, "reproduce.tgz")

def write_parts(data: bytes, into: Path, stem: str) -> list[Path]:
    "`data` as files `into/<stem>.partNN` of at most PART_BYTES each (older parts of that stem removed first)."
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob(f"{stem}.part*"): old.unlink()
    parts = []
    for i in range(0, len(data), PART_BYTES):
        parts.append(into / f"{stem}.part{i // PART_BYTES:02d}"); parts[-1].write_bytes(data[i:i + PART_BYTES])
    return parts

def extract_parts(source: Path, stem: str, out: Path, wrote_them: str) -> int:
    "Extract the gzip'd tar split into `source/<stem>.partNN` into `out`; the number of bytes read."
    parts = sorted(source.glob(f"{stem}.part*"))
    if not parts: raise FileNotFoundError(f"no {stem}.partNN files in {source}: give the folder {wrote_them} wrote")
    data = b"".join(p.read_bytes() for p in parts)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar: tar.extractall(out, filter="data")
    return len(data)

def unpack(source: Path, out: Path) -> int:
    "Restore OUT from the parts `pack` wrote; returns the number of bytes read. Files already in OUT are replaced."
    return extract_parts(source, "reproduce.tgz", out, "--pack")


# ---------------------------------------------------------------- the plan: sizes and a time estimate
H200_STEPS = REPO / "benchmarks" / "results" / "grpo_step_h200.jsonl"   # `python -m benchmarks grpo_step` on one H200
QWEN2_05B = {"params": 494e6, "layers": 24}                                # the shape of its 'qwen2-0.5b' rows

def h200_step_anchor(path: Path = H200_STEPS) -> dict | None:
    """The newest measured 0.5B GRPO step per strategy (fast mode, eager trainer, one process) from `path`: rows, tokens,
    seconds; None without the file. Rows are appended, so the last matching row of a strategy is its newest."""
    if not path.exists(): return None
    newest = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if (r.get("model"), r.get("mode"), r.get("layers")) != ("qwen2-0.5b", "fast", QWEN2_05B["layers"]): continue
        if r.get("trainer_cuda_graphs") or r.get("gpus", 1) != 1 or r.get("checkpointing"): continue
        newest[r["strategy"]] = r
    if "bf16" not in newest: return None
    seconds = {s: r["step_s"] for s, r in newest.items()}
    if "fp8-rollout" in seconds: seconds["fp8-rollout-tis"] = seconds["fp8-rollout"]   # TIS adds no GEMM
    first = newest["bf16"]
    return QWEN2_05B | {"rows": first["prompts"] * first["samples"], "new_tokens": first["new_tokens"],
                        "prompt_len": first["prompt_len"], "seconds": seconds,
                        "source": f"{path.relative_to(REPO)} ({', '.join(sorted({r['date'] for r in newest.values()}))})"}

def _param_count(s: SFTSpec) -> int:
    head_dim = s.hidden_size // s.heads
    per_layer = (2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * head_dim * s.kv_heads   # q, o; k, v
                 + s.hidden_size + 2 * head_dim * s.kv_heads                                        # q, k, v biases
                 + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size)                      # MLP, two norms
    return s.layers * per_layer + 512 * s.hidden_size + s.hidden_size                             # tied embedding, final norm

# One H200, as measured (`--preset gpu`, the base SFT'd in the first device call). The committed reproduction (three
# calls, 30 steps of 128 prompts x 8, the SFT'd base writing ~501-token completions; reproduce_gpu/) gives the SFT time
# (its sft.json), the seconds of a run and of an eval (the log of its first call: the SFT, the base's eval, bf16 seed 0)
# and s/step at 1024 rows; two runs at 16 prompts x 8 give s/step at 128 rows and the spread in length that fits the
# per-token slope: step_times_16x8.jsonl (24 steps, ~501 tokens) and step_times_16x8_ragged.jsonl (30 steps, completions
# of 49..396 tokens from a tokenizer that split the answer format). (summary, rows per GRPO step) each:
GPU_RESULTS = REPO / "benchmarks" / "results"
GPU_MEASURED_SUMMARIES = ((GPU_RESULTS / "reproduce_gpu" / "step_times_16x8_ragged.jsonl", 16 * 8),
                          (GPU_RESULTS / "reproduce_gpu" / "step_times_16x8.jsonl", 16 * 8),
                          (GPU_RESULTS / "reproduce_gpu" / "summary.jsonl", 128 * 8))
GPU_MEASURED_LOG = GPU_RESULTS / "reproduce_gpu" / "log_1.txt"
GPU_MEASURED_SFT = GPU_RESULTS / "reproduce_gpu" / "sft.json"
GPU_SLOPE_ROWS = 16 * 8        # the batch of the runs whose lengths varied: the per-token slope is measured there
DEVICE_CALL_S = 540            # what one device call may take, start-up included (the tool allows 600)
TARGET_CALL_S = 420            # what the gpu preset is sized for: the lead's device budget per call
STARTUP_RESERVE_S = 30         # python + torch + CUDA start-up before the time budget starts: a reserve, not a measurement
RESTORE_RESERVE_S = 10         # --unpack, the base restored from its parts and fingerprinted: a reserve, not a measurement
REPORT_RESERVE_S = 15          # the report and --pack after the time budget: a reserve, not a measurement
PARITY_TIME_BUDGET_S = DEVICE_CALL_S - STARTUP_RESERVE_S - REPORT_RESERVE_S - 25   # --time-budget of a --base call (25 s spare)
GZIP_BF16 = 0.8                # gzip'd size of bf16 weights over their raw size (0.79 measured on normal weights, level 6)

def step_time_model(rows: list[dict]) -> tuple[dict[str, float], float]:
    """seconds/step = a[strategy] + b x mean completion tokens, least squares with one intercept per strategy and one
    shared slope b (the measured lengths varied within a strategy across seeds); returns (a, b)."""
    by = {}
    for r in rows: by.setdefault(r["strategy"], []).append((r["completion_length_mean"], r["seconds_per_step"]))
    sxy = sxx = 0.0
    for points in by.values():
        mx, my = _mean([x for x, _ in points]), _mean([y for _, y in points])
        sxy += sum((x - mx) * (y - my) for x, y in points); sxx += sum((x - mx) ** 2 for x, _ in points)
    slope = max(sxy / sxx, 0.0) if sxx else 0.0
    return {s: _mean([y for _, y in p]) - slope * _mean([x for x, _ in p]) for s, p in by.items()}, slope

def measured_call_seconds(log_file: Path, summary_rows: list[dict], sft_s: float) -> dict:
    """From one call's log (and its summary rows): the seconds per held-out eval (with its policy build) and each run's
    seconds beside its steps (policy build, optimizer, a checkpoint every `save_every` steps). The call's elapsed time
    is its last line's "N s; report"; the evals get what the SFT and the runs leave of it, over the evals done (the
    base's and one per finished run): an upper bound, as it also holds the base's format check and the report."""
    text = log_file.read_text()
    runs = [(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
            for m in re.finditer(r"^(\S+ seed \d+): (\d+)/(\d+) steps, (\d+) s this call", text, re.M)]
    elapsed = float(re.findall(r"; (\d+) s; report", text)[-1])
    evals = 1 + len(re.findall(r"seed \d+: held-out accuracy", text))
    step_s = {f"{r['strategy']} seed {r['seed']}": r["seconds_per_step"] for r in summary_rows}
    overhead = [seconds - done * step_s[name] for name, done, _, seconds in runs if name in step_s]
    return {"eval_s": (elapsed - sft_s - sum(r[3] for r in runs)) / evals, "run_overhead_s": _mean(overhead),
            "elapsed_s": elapsed, "evals": evals, "runs": len(runs)}

def _sft_tokenizer(spec: SFTSpec):
    from jetrl.tiny import build_tokenizer
    return build_tokenizer([t for row in sft_rows(spec, 2000) for t in (row["prompt"], worked_solution(row))])

def worked_tokens(preset: Preset) -> float:
    "Mean tokens of the worked solution (plus EOS) of the preset's GRPO prompts, with the tokenizer its SFT builds."
    tokenizer = _sft_tokenizer(preset.sft)
    rows = eval_rows(replace(preset, eval_prompts=64))
    return _mean([len(tokenizer(worked_solution(r), add_special_tokens=False)["input_ids"]) + 1 for r in rows])

def sft_step_cost(spec: SFTSpec, batches: int = 4) -> float:
    """An SFT step's training FLOPs, relative: rows x padded length T x (6 x parameters + 12 x layers x hidden x T), the
    last term attention over the whole padded T (an explicit mask); T the longest prompt + worked solution of a batch."""
    tokenizer, lengths = _sft_tokenizer(spec), []
    for b in range(batches):
        rows = sft_rows(spec, spec.batch_size, offset=b * spec.batch_size)
        lengths.append(max(len(tokenizer(r["prompt"] + worked_solution(r))["input_ids"]) + 1 for r in rows))
    T = _mean(lengths)
    return spec.batch_size * T * (6 * _param_count(spec) + 12 * spec.layers * spec.hidden_size * T)

def measured_batch(row: dict) -> int:
    "The rows per GRPO step a results row was measured at (rows written before that field: its preset's)."
    if row.get("rows_per_step"): return row["rows_per_step"]
    if row.get("preset") in PRESETS: return PRESETS[row["preset"]].train.rows_per_step
    raise ValueError(f"a measured row ({row.get('strategy')} seed {row.get('seed')}) says neither its rows_per_step nor a "
                     "known preset: give --measured a results file that scripts/reproduce.py wrote")

def gpu_call_estimate(preset: Preset, completion_tokens: float | None = None,
                      summaries: tuple[tuple[Path, int], ...] = GPU_MEASURED_SUMMARIES,
                      log_file: Path = GPU_MEASURED_LOG, sft_file: Path = GPU_MEASURED_SFT,
                      measured_rows: list[dict] | None = None) -> dict:
    """Seconds `preset` takes on one H200 (SFT, the base eval, every run and its eval), from the measurements above.
    Per-step time: from the largest measured batch not above the preset's rows per step (else the smallest), each
    strategy's mean s/step there moved along the length to `completion_tokens` (default: the worked solution's length,
    which the SFT'd base writes) by `step_time_model`'s per-token slope (fitted at GPU_SLOPE_ROWS) times that batch
    over GPU_SLOPE_ROWS, then times the preset's rows over that batch (every part of the step scaled linearly: an
    upper bound; never scaled down). Strategies never measured at that batch take its slowest. Each run's fixed
    seconds and the evals' from `measured_call_seconds`, the SFT time scaled by steps x rows, plus STARTUP_RESERVE_S.
    Also how many calls of TARGET_CALL_S it takes with whole runs per call, and the most GRPO steps per run for
    which everything fits in one call. The SFT's time scales by `sft_step_cost` (its rows, padded length and attention);
    an eval's by the completion tokens. `measured_rows` (the rows of an earlier results file, `--measured`) replace the
    per-step, eval and per-run seconds where they hold them; the per-token slope stays the committed one."""
    measured = [(json.loads(line), batch) for summary, batch in summaries for line in summary.read_text().splitlines()]
    eval_tokens = _mean([r["completion_length_mean"] for r, b in measured if b == summaries[-1][1]])   # the log's evals' length
    _, slope = step_time_model([r | {"strategy": f"{r['strategy']}@{batch}"} for r, batch in measured])  # one intercept per batch
    batches = sorted({batch for _, batch in measured})
    batch = max([b for b in batches if b <= preset.train.rows_per_step], default=batches[0])
    if measured_rows:                                     # --measured: that file's batch and step times
        measured = [(r, measured_batch(r)) for r in measured_rows]
        batches = sorted({b for _, b in measured})
        batch = max([b for b in batches if b <= preset.train.rows_per_step], default=batches[0])
    at_batch = {}
    for r, b in measured:
        if b == batch: at_batch.setdefault(r["strategy"], []).append(r)
    step_at = {s: (_mean([r["seconds_per_step"] for r in v]), _mean([r["completion_length_mean"] for r in v])) for s, v in at_batch.items()}
    sft = json.loads(sft_file.read_text())
    sft_measured_s = sft["seconds_this_call"]
    sft_s = 0.0
    if preset.sft is not None:
        measured_spec = SFTSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in sft.items() if k in SFTSpec.__dataclass_fields__})
        sft_s = sft_measured_s * preset.sft.steps / sft["steps"] * (1.0 if preset.sft == measured_spec else
                                                                     sft_step_cost(preset.sft) / sft_step_cost(measured_spec))
    log_summary = [r for r, b in (measured if not measured_rows else
                                  [(json.loads(line), batch) for summary, batch in summaries for line in summary.read_text().splitlines()])
                   if b == summaries[-1][1]]                              # the log's call ran the last summary's setting
    call = measured_call_seconds(log_file, log_summary, sft_measured_s)
    source_files = [*(f for f, _ in summaries), log_file, sft_file]
    if measured_rows:
        evals = [(r["eval_seconds"], r["completion_length_mean"]) for r in measured_rows if r.get("eval_seconds") is not None]
        if evals: call["eval_s"], eval_tokens = _mean([e for e, _ in evals]), _mean([t for _, t in evals])
        overheads = [r["overhead_s"] for r in measured_rows if r.get("overhead_s") is not None]
        if overheads: call["run_overhead_s"] = _mean(overheads)
    tokens = completion_tokens if completion_tokens is not None else worked_tokens(preset)
    call["eval_s"] *= tokens / eval_tokens                 # decode steps: as many as the completions' tokens
    rows_factor = max(preset.train.rows_per_step / batch, 1.0)
    slowest = max(step_at, key=lambda s: step_at[s][0])
    def seconds_per_step(strategy):                      # at the preset's length and rows per step
        measured_s, measured_tokens = step_at.get(strategy, step_at[slowest])
        return (measured_s + slope * batch / GPU_SLOPE_ROWS * (tokens - measured_tokens)) * rows_factor
    per_step = {s: seconds_per_step(s) for s in preset.strategies}
    runs = len(preset.seeds)
    all_runs_per_step = runs * sum(per_step.values())
    fixed = (STARTUP_RESERVE_S + sft_s + call["eval_s"] * (1 + runs * len(preset.strategies))
             + call["run_overhead_s"] * runs * len(preset.strategies))
    total = fixed + preset.train.steps * all_runs_per_step
    # Calls of TARGET_CALL_S that end at run boundaries (--pack leaves an unfinished run out): the first holds the SFT
    # and the base's eval, each holds STARTUP_RESERVE_S, and whole runs follow in run_all's order (seed by seed).
    run_s = {s: call["run_overhead_s"] + call["eval_s"] + preset.train.steps * per_step[s] for s in preset.strategies}
    calls, room = 1, TARGET_CALL_S - STARTUP_RESERVE_S - sft_s - call["eval_s"]
    for _ in preset.seeds:
        for s in preset.strategies:
            if run_s[s] > room: calls, room = calls + 1, TARGET_CALL_S - STARTUP_RESERVE_S
            room -= run_s[s]
    return {"seconds_per_step": {s: round(v, 2) for s, v in per_step.items()}, "slope_s_per_token": round(slope, 5),
            "rows_per_step": preset.train.rows_per_step, "measured_rows": batch, "rows_factor": round(rows_factor, 2),
            "completion_tokens": round(tokens, 1), "sft_s": round(sft_s, 1), "eval_s_each": round(call["eval_s"], 1),
            "run_overhead_s_each": round(call["run_overhead_s"], 1), "startup_reserve_s": STARTUP_RESERVE_S,
            "total_s": round(total, 1), "device_call_s": DEVICE_CALL_S, "target_call_s": TARGET_CALL_S,
            "run_s": {s: round(v, 1) for s, v in run_s.items()}, "calls": calls,
            "max_steps_in_one_call": int((DEVICE_CALL_S - fixed) // all_runs_per_step),
            "max_steps_in_target": int((TARGET_CALL_S - fixed) // all_runs_per_step),
            "time_budget_s": TARGET_CALL_S - STARTUP_RESERVE_S, "measured_rows_given": bool(measured_rows),
            "source": ", ".join(str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p) for p in source_files)}

def base_calls(est: dict) -> list[dict]:
    """The device calls that build the base twice in two processes (`--base-only`, each with its held-out eval and its
    parts; the second with `--expect-fingerprint` of the first): one call when both fit DEVICE_CALL_S one after the
    other, else one call each (the second then also checks the SFT across machines)."""
    build = STARTUP_RESERVE_S + est["sft_s"] + est["eval_s_each"] + REPORT_RESERVE_S
    if 2 * build - STARTUP_RESERVE_S <= DEVICE_CALL_S:
        return [{"what": "the base, built twice in two processes (--base-only, then --expect-fingerprint)",
                 "seconds": round(2 * build - STARTUP_RESERVE_S, 1)}]
    return [{"what": "the base (--base-only)", "seconds": round(build, 1)},
            {"what": "the base again, on a fresh machine (--base-only --expect-fingerprint)", "seconds": round(build, 1)}]

def parity_calls(preset: Preset, est: dict, budget_s: float = PARITY_TIME_BUDGET_S) -> list[dict]:
    """The device calls after the base's (`--base DIR --time-budget budget_s`, the same command each time): whole runs
    in run_all's order (seed by seed), as many as the budget holds (the base's held-out accuracy comes with its
    base.json), each call with its start-up, restore and report reserves. A run longer than the budget is an error:
    its state cannot be carried unfinished."""
    calls, runs, room = [], [], budget_s - RESTORE_RESERVE_S
    for seed in preset.seeds:
        for s in preset.strategies:
            seconds = est["run_s"][s]
            if seconds > budget_s - RESTORE_RESERVE_S:
                raise ValueError(f"a {s} run of {preset.name} takes about {seconds:.0f} s, over the {budget_s - RESTORE_RESERVE_S:.0f} s "
                                 "one device call holds, and an unfinished run cannot be carried: give it fewer --steps or rows")
            if seconds > room:
                calls.append(runs); runs, room = [], budget_s - RESTORE_RESERVE_S
            runs.append((s, seed, seconds)); room -= seconds
    calls.append(runs)
    return [{"runs": [f"{s} seed {seed}" for s, seed, _ in c],
             "seconds": round(STARTUP_RESERVE_S + RESTORE_RESERVE_S + sum(x for _, _, x in c) + REPORT_RESERVE_S, 1)} for c in calls]

def carried_sizes(preset: Preset, tokens: float) -> dict:
    """MiB a device call carries: the working tree (git's tracked files), the base's parts (bf16 weights gzip'd by
    GZIP_BF16) and OUT's parts at the end (the finished runs' metrics: ~3 KB a step, and each recorded sample's tokens
    at ~50 bytes each, gzip'd to ~0.4), against the 64 MiB a call takes and the 16 MiB a returned file may be."""
    import subprocess
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
        tree = sum((REPO / f.decode()).stat().st_size for f in listed if f and (REPO / f.decode()).is_file()) / MiB
    except (OSError, subprocess.CalledProcessError): tree = math.nan
    base = 2 * _param_count(preset.sft) * GZIP_BF16 / MiB if preset.sft is not None else 0.0
    per_run = preset.train.steps * (3e3 + 50 * tokens * preset.train.record_samples) * 0.4 / MiB
    out = per_run * len(preset.seeds) * len(preset.strategies)
    return {"tree_MiB": round(tree, 1), "base_parts_MiB": round(base, 1), "out_parts_MiB_at_end": round(out, 1),
            "per_run_MiB": round(per_run, 2), "total_MiB": round(tree + base + out, 1), "limit_MiB": 64}

def measured_on(measured_rows: list[dict] | None) -> str:
    "Which GPU the estimate's numbers come from: --measured rows give the runs' seconds, the committed H200 runs the rest."
    ran_on = sorted({r["device_name"] for r in measured_rows or [] if r.get("device_name")})
    if not ran_on: return "H200 (the committed measurements)"
    return (f"{' / '.join(ran_on)} for the GRPO steps, evals and runs (--measured), the SFT and the seconds per "
            "completion token from the committed H200 measurements")

def plan(preset: Preset, device: str, measure_steps: int = 0, log=print, measured: Path | None = None,
         base: Path | None = None) -> dict:
    """What a run of `preset` will carry and cost.

    Sizes: the base policy and a run checkpoint in bf16 against the 64 MiB a device call brings back. One H200 device
    call (presets with an SFT): `gpu_call_estimate`, from the GPU runs' measurements. With `measure_steps`
    (`--measure N`; minutes on a CPU), also GRPO
    steps of every strategy at 4 x 4 rows and 64 new tokens (the GPU preset's model shape, a tiny SFT), timed here;
    each extrapolated to the preset's rows and tokens by FLOPs (trainer: 10 x params x tokens, i.e. forward +
    backward + two no-grad forwards; rollout: rows x new tokens). For the GPU, the newest measured H200 GRPO step
    of the 0.5B shape (`h200_step_anchor`) is scaled two ways: by FLOPs (a floor: small models use the GPU less
    well) and by decode steps x layers (an upper bound when decode is launch-bound)."""
    import tempfile
    info = {"preset": preset.name, "device": device}
    measured_rows = None
    if measured is not None:
        if not measured.is_file(): raise FileNotFoundError(f"no results file {measured}: give --measured a JSONL that scripts/reproduce.py wrote")
        measured_rows = [json.loads(line) for line in measured.read_text().splitlines() if line.strip()]
        measured_rows = [r for r in measured_rows if r.get("seconds_per_step") and not r.get("summary")]
        if not measured_rows: raise ValueError(f"{measured} holds no run with seconds_per_step: give a results file of finished runs")
    if preset.sft is not None:
        params = _param_count(preset.sft)
        info |= {"model_params": params, "base_bf16_MiB": round(2 * params / MiB, 1),
                 "run_checkpoint_bf16_MiB": round(6 * params / MiB, 1)}
        log(f"model: {params / 1e6:.1f}M parameters; the base policy {2 * params / MiB:.0f} MiB in bf16; a run's checkpoint "
            f"(weights + AdamW moments) {6 * params / MiB:.0f} MiB. A call that packs must end at a run boundary when "
            f"that does not fit beside the base in {PACK_BYTES / MiB:.0f} MiB (--pack leaves an unfinished run's folder out).")
        call = info["h200_call"] = gpu_call_estimate(preset, measured_rows=measured_rows)
        if measured is not None: call["source"] = f"{measured} (per-step, eval and run seconds), {call['source']}"
        scaled = (f"; {call['rows_per_step']} rows per step, {call['rows_factor']}x the measured {call['measured_rows']}: every "
                  "part of the step scaled linearly, an upper bound") if call["rows_factor"] > 1 else ""
        log(f"on one {measured_on(measured_rows)}: about {call['total_s']:.0f} s in all (SFT {call['sft_s']:.0f} s, "
            f"{1 + len(preset.seeds) * len(preset.strategies)} evals x {call['eval_s_each']} s, "
            f"{len(preset.seeds) * len(preset.strategies)} runs x ({call['run_overhead_s_each']} s + {preset.train.steps} steps), "
            f"GRPO s/step {call['seconds_per_step']} at {call['completion_tokens']:.0f} completion tokens{scaled}; "
            f"{call['startup_reserve_s']} s start-up reserve per call); {call['calls']} call(s) of {call['target_call_s']} s "
            f"that end at run boundaries (a run: {call['run_s']} s with its eval); "
            + (f"all runs' steps fit one call up to {call['max_steps_in_target']} steps per run ({call['max_steps_in_one_call']} in "
               f"{call['device_call_s']} s); " if call["max_steps_in_one_call"] > 0 else "the runs cannot all share one call; ")
            + f"measured from {call['source']}")
        sizes = info["carried"] = carried_sizes(preset, call["completion_tokens"])
        first = base_calls(call)
        if base is not None and (base / BASE_RECORD).is_file(): first = []         # built: its base.json is there
        runs = parity_calls(preset, call)
        info["device_calls"] = first + runs
        info["device_s"] = round(sum(c["seconds"] for c in info["device_calls"]), 1)
        log(f"with a carried base (--base DIR): {len(first)} call(s) for the base, then {len(runs)} run call(s) of --time-budget "
            f"{PARITY_TIME_BUDGET_S} s; {info['device_s'] / 60:.0f} min of device time in all, each call's start on the machine not counted. "
            f"Each call carries the tree ({sizes['tree_MiB']} MiB), the base's parts ({sizes['base_parts_MiB']} MiB) and OUT's "
            f"(up to {sizes['out_parts_MiB_at_end']} MiB): {sizes['total_MiB']} of {sizes['limit_MiB']} MiB")
        for i, c in enumerate(info["device_calls"], 1):
            log(f"  call {i}: ~{c['seconds']:.0f} s: {c.get('what') or ', '.join(c['runs'])}")
        if sizes["total_MiB"] > sizes["limit_MiB"]:
            log(f"warning: {sizes['total_MiB']} MiB is over the {sizes['limit_MiB']} MiB a device call carries: record fewer samples "
                "(record_samples) or split the seeds over two OUT folders")
    if not measure_steps: return info
    with tempfile.TemporaryDirectory() as tmp:
        small_train = replace(preset.train, steps=measure_steps, prompts_per_step=4, grpo=replace(preset.train.grpo, num_generations=4),
                              max_new_tokens=64)
        small = replace(preset, seeds=(0,), eval_prompts=0, train=small_train)
        if preset.sft is not None:
            small = replace(small, sft=replace(preset.sft, steps=1, batch_size=2),     # the preset's tokenizer, one SFT step
                            train=replace(small_train, task_knobs=(("digits", 2), ("operators", "+-"), ("steps", 4))))
        measured, estimates, anchor = {}, {}, h200_step_anchor()
        if anchor: info["h200_anchor"] = anchor
        else: log(f"no H200 estimate: {H200_STEPS.relative_to(REPO)} (measured GRPO steps on an H200) is missing")
        model_name = str(Path(tmp) / "base") if preset.sft is not None else preset.train.model
        for s in preset.strategies:
            run_all(replace(small, strategies=(s,)), Path(tmp), device, math.inf, log=lambda *_: None)
            h = read_metrics(run_dir(Path(tmp), s, 0))[1][1:] or read_metrics(run_dir(Path(tmp), s, 0))[1]
            measured[s] = {k: round(_mean([m[f"time/{k}"] for m in h]), 3) for k in ("step", "rollout", "train")}
            measured[s]["completion_tokens"] = round(_mean([m["completions/mean_length"] for m in h]), 1)
        params = _count_params(model_name)
        tokenizer = load_model_and_tokenizer(model_name)[1]
        full_prompt = _mean([len(tokenizer(r["prompt"])["input_ids"]) for r in eval_rows(replace(preset, eval_prompts=16))])
        small_prompt = _mean([len(tokenizer(r["prompt"])["input_ids"]) for r in eval_rows(replace(small, eval_prompts=16))])
        rows_full, rows_small = preset.train.rows_per_step, small.train.rows_per_step
        for s, m in measured.items():
            train_ratio = (rows_full * (full_prompt + preset.train.max_new_tokens)) / (rows_small * (small_prompt + m["completion_tokens"]))
            decode_ratio = rows_full * preset.train.max_new_tokens / (rows_small * max(m["completion_tokens"], 1))
            here = m["train"] * train_ratio + m["rollout"] * decode_ratio
            estimates[s] = {"seconds_per_step_here": round(here, 1)}
            if anchor and s in anchor["seconds"] and preset.sft is not None:
                flops = (params * rows_full * (full_prompt + preset.train.max_new_tokens)) / (
                    anchor["params"] * anchor["rows"] * (anchor["prompt_len"] + anchor["new_tokens"]))
                launches = preset.train.max_new_tokens * preset.sft.layers / (anchor["new_tokens"] * anchor["layers"])
                estimates[s]["h200_seconds_per_step"] = [round(anchor["seconds"][s] * flops, 2), round(anchor["seconds"][s] * launches, 2)]
            log(f"{s:18s} measured here at {rows_small} rows x {m['completion_tokens']:.0f} tokens: {m}; at the preset's size: "
                f"{estimates[s]}")
        info |= {"measured_here": measured, "measured_at": {"rows": rows_small, "new_tokens": small.train.max_new_tokens},
                 "prompt_tokens": {"measured": round(small_prompt, 1), "preset": round(full_prompt, 1)}, "estimates": estimates}
        if all("h200_seconds_per_step" in e for e in estimates.values()):
            runs = preset.train.steps * sum(e["h200_seconds_per_step"][1] for e in estimates.values()) * len(preset.seeds)
            info["h200_grpo_minutes_upper"] = round(runs / 60, 1)
            log(f"all GRPO runs on an H200, the launch-bound (upper) estimate: {runs / 60:.0f} min, plus the SFT and start-up")
    return info


# ---------------------------------------------------------------- the command
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="workshop", choices=sorted(PRESETS))
    p.add_argument("--out", type=Path, help="output folder (runs, report); required unless --plan")
    p.add_argument("--strategies", help="comma-separated subset of the preset's strategies (default: all of them)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the preset's)")
    p.add_argument("--steps", type=int, help="GRPO steps per run (default: the preset's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--time-budget", type=float, default=0, help="seconds; stop at a step boundary before then (0: no limit)")
    p.add_argument("--results", type=Path, help="results JSONL, merged into (other runs' rows stay; default: "
                                                  "benchmarks/results/reproduce_<device>.jsonl for the workshop and gpu presets, none for smoke)")
    p.add_argument("--unpack", type=Path, help="restore OUT from the parts of an earlier --pack first")
    p.add_argument("--pack", type=Path, help="at the end, write OUT as <= 15 MiB parts into this folder")
    p.add_argument("--base", type=Path, metavar="DIR",
                   help="the base saved in DIR by --base-only (base.tgz.partNN, base.json): restored into OUT/base, fingerprint checked")
    p.add_argument("--base-only", action="store_true", help="with --base DIR: train the preset's base into OUT/base, save it into DIR, run nothing else")
    p.add_argument("--expect-fingerprint", metavar="HEX",
                   help="with --base-only: fail unless the base built here has this fingerprint (a second build's check)")
    p.add_argument("--sft-steps", type=int, help="the base's SFT steps (default: the preset's)")
    p.add_argument("--sft-seed", type=int, help="the base's SFT seed (default: the preset's)")
    p.add_argument("--nondeterministic-sft", action="store_true",
                   help="train the base without torch's deterministic algorithms (where an op has none; the fingerprint then "
                        "differs between builds)")
    p.add_argument("--plan", action="store_true", help="print state sizes, the device calls and their times, run nothing else")
    p.add_argument("--measured", type=Path, metavar="RESULTS_JSONL",
                   help="with --plan: per-step, eval and run seconds from the rows of an earlier results file (default: the committed measurements)")
    p.add_argument("--measure", type=int, default=0, help="with --plan: also time this many GRPO steps per strategy here, small")
    p.add_argument("--report-from", type=Path, metavar="RESULTS_JSONL",
                   help="run nothing: draw OUT/report.html and OUT/table.md from a saved results file and its _curves.json")
    p.add_argument("--plotlyjs", choices=("inline", "cdn"), default="inline",
                   help="with --report-from: plotly.js inside report.html (self-contained, ~4.8 MB) or from its CDN (small)")
    args = p.parse_args(argv)
    if args.out is None and not args.plan: p.error("--out is required (a folder for the runs and the report)")
    if args.base_only and args.base is None: p.error("--base-only needs --base DIR, the folder its parts and base.json go to")
    if args.base is not None and not args.base_only and (args.sft_steps is not None or args.sft_seed is not None or args.nondeterministic_sft):
        p.error("--sft-steps, --sft-seed and --nondeterministic-sft change the base a run trains; with --base DIR the runs start "
                "from the base saved there: build another with --base-only, or leave them out")
    if args.measured is not None and not args.plan: p.error("--measured goes with --plan (it changes the estimate, nothing else)")
    return args

def preset_from_args(args) -> Preset:
    preset = PRESETS[args.preset]
    if args.strategies:
        strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
        unknown = [s for s in strategies if s not in VARIANTS]
        if unknown: raise ValueError(f"unknown strategies {unknown}: choose from {sorted(VARIANTS)}")
        preset = replace(preset, strategies=strategies)
    if args.seeds: preset = replace(preset, seeds=tuple(int(s) for s in args.seeds.split(",")))
    if args.steps: preset = replace(preset, train=replace(preset.train, steps=args.steps))
    sft_changes = {k: v for k, v in (("steps", getattr(args, "sft_steps", None)), ("seed", getattr(args, "sft_seed", None)),
                                      ("deterministic", False if getattr(args, "nondeterministic_sft", False) else None))
                   if v is not None}
    if sft_changes and preset.sft is None:
        raise ValueError(f"--sft-steps, --sft-seed and --nondeterministic-sft change the base SFT of a preset that trains one "
                         f"({', '.join(n for n, p in PRESETS.items() if p.sft)}); {preset.name} starts from {preset.train.model}")
    if "steps" in sft_changes and sft_changes["steps"] < 1: raise ValueError(f"--sft-steps must be at least 1, not {sft_changes['steps']}")
    if sft_changes: preset = replace(preset, sft=replace(preset.sft, **sft_changes))
    return preset

def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python scripts/reproduce.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    deadline = start + args.time_budget if args.time_budget > 0 else math.inf
    runs_started = False
    try:
        preset = preset_from_args(args)
        if args.plan:
            print(json.dumps(plan(preset, args.device, args.measure, measured=args.measured, base=args.base), indent=1)); return 0
        if args.report_from:
            print(report_from_results(args.report_from, args.out, plotlyjs=args.plotlyjs)); print(f"report: {args.out / 'report.html'}"); return 0
        if args.base_only:
            record = build_base(preset, args.out, args.device, deadline, args.base, command)
            if args.expect_fingerprint and record["base_fingerprint"] != args.expect_fingerprint:
                raise RuntimeError(f"the base built here has fingerprint {record['base_fingerprint']}, not {args.expect_fingerprint}: "
                                   "the SFT is not reproducible between these builds; share one build's parts, never rebuild it")
            return 0
        if args.unpack: print(f"unpacked {unpack(args.unpack, args.out) / MiB:.1f} MiB into {args.out}")
        prior = None
        if preset.sft is not None and args.device.startswith("cuda") and math.isfinite(deadline):
            try: prior = gpu_call_estimate(preset)["run_s"]                  # the first run of a call, before any finished
            except (OSError, ValueError, KeyError) as e: print(f"reproduce: no run-time estimate ({e}); the first run starts regardless")
        device = "gpu" if args.device.startswith("cuda") else "cpu"
        results = args.results or (None if preset.name.startswith("smoke") else REPO / "benchmarks" / "results" / f"reproduce_{device}.jsonl")
        try:
            runs_started = True
            done = run_all(preset, args.out, args.device, deadline, base=args.base, prior_run_s=prior,
                           budget_s=args.time_budget if args.time_budget > 0 else math.inf)
        finally:     # whatever stops a run (the time budget, an error such as CUDA out of memory), the finished ones are written
            if any((run_dir(args.out, s, seed) / "metrics.jsonl").exists() for s in preset.strategies for seed in preset.seeds):
                table, _ = write_report(preset, args.out, command, results)
                print(table)
        print(f"{'done' if done else 'stopped at the time budget: run the same command again to continue'}; "
              f"{time.time() - start:.0f} s; report: {args.out / 'report.html'}")
        if args.pack: print("packed:", ", ".join(f"{p.name} ({p.stat().st_size / MiB:.1f} MiB)" for p in pack(args.out, args.pack)))
        return 0 if done else 3
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"reproduce: error: {e}", file=sys.stderr)
        trained_here = runs_started and any(f.stat().st_mtime >= start for f in args.out.glob("runs/*/metrics.jsonl"))
        if trained_here:            # an error inside a run, not a refusal before any: say where the finished ones are
            print(f"reproduce: the finished runs are in {results or args.out}; every finished step is saved in {args.out}: "
                  "run the same command again to continue", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nreproduce: interrupted; every finished step is saved: run the same command to continue.", file=sys.stderr)
        return 130

if __name__ == "__main__":
    sys.exit(main())
