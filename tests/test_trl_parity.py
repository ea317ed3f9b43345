"""jetrl's GRPO loss against TRL's own: `GRPOTrainer._compute_loss` of TRL 1.16, called on a stub trainer that holds
only the attributes the method reads, on the same per-token log-probs, advantages and masks. Loss values and
gradients must agree for every loss type and every option combination.

What TRL computes elsewhere is given to it the way its trainer would: the mask of `mask_truncated_completions`, the
token count `num_items_in_batch` (counted after that mask) and the rollout importance-sampling ratio (computed in
`_generate_and_score_completions`, which needs a model and a generation; written out below from its documentation)."""
import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from jetrl.grpo import GRPOConfig, LOSS_TYPES, ROLLOUT_IS_MODES, grpo_loss, high_entropy_mask

trl = pytest.importorskip("trl", reason="trl is not installed: `pip install 'trl==1.16.*'` (in the dev extra) to run the TRL parity tests")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"the stub mirrors what TRL 1.16's _compute_loss reads; found trl {trl.__version__}", allow_module_level=True)
from trl.trainer.grpo_trainer import GRPOTrainer

TOLERANCE = 1e-6   # float32: the two sides sum the same terms, possibly in another order


class _OneProcess:
    "The accelerator of a single process: gathers and reductions are the identity."
    num_processes, sync_gradients = 1, True
    def gather(self, tensor): return tensor
    gather_for_metrics = gather
    def reduce(self, tensor, reduction="sum"): return tensor
    def pad_across_processes(self, tensor, dim=0, pad_index=0): return tensor


def trl_loss(config: GRPOConfig, logp, entropy, inputs, gradient_accumulation_steps=1):
    "TRL's `_compute_loss` on a stub trainer configured like `config`; `logp` plays the model's forward."
    args = SimpleNamespace(use_bias_correction_kl=config.use_bias_correction_kl, delta=config.delta,
                           steps_per_generation=config.steps_per_generation)
    stub = SimpleNamespace(
        args=args, loss_type=config.loss_type, beta=config.beta, epsilon_low=config.epsilon, epsilon_high=config.clip_high,
        importance_sampling_level=config.importance_sampling_level, top_entropy_quantile=config.top_entropy_quantile,
        max_completion_length=config.max_completion_length, off_policy_mask_threshold=None,
        use_vllm="importance_sampling_ratio" in inputs, vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=gradient_accumulation_steps,
        accelerator=_OneProcess(), _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    stub._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, entropy, None)
    stub.get_high_entropy_mask = lambda entropies, mask, threshold: GRPOTrainer.get_high_entropy_mask(stub, entropies, mask, threshold)
    return GRPOTrainer._compute_loss(stub, None, inputs), stub._metrics["train"]


def trl_rollout_ratio(config: GRPOConfig, old_logp, rollout_logp, mask):
    "TRL's `importance_sampling_ratio` (vllm_importance_sampling_*), from its documentation: per token, or per sequence."
    diff = (old_logp - rollout_logp) * mask
    if config.rollout_importance_sampling_mode.startswith("sequence"): diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = config.rollout_importance_sampling_clip_min, config.rollout_importance_sampling_clip_max
    if config.rollout_importance_sampling_mode.endswith("truncate"): return torch.clamp(ratio, min=low, max=high)
    keep = (ratio >= (-math.inf if low is None else low)) & (ratio <= (math.inf if high is None else high))
    return torch.where(keep, ratio, torch.zeros_like(ratio))


def batch(seed=0, rows=6, tokens=5):
    "Log-probs near each other (so that clipping happens), advantages of both signs, rows of every length (one empty)."
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, tokens, generator=g) * 2 - 0.1
    logp = old + 0.3 * torch.randn(rows, tokens, generator=g)
    lengths = torch.tensor([tokens, 3, 1, 0, tokens, 2])[:rows]
    return dict(logp=logp, old=old, rollout=old + 0.4 * torch.randn(rows, tokens, generator=g),
                ref=logp + 0.3 * torch.randn(rows, tokens, generator=g), advantages=torch.randn(rows, generator=g),
                mask=(torch.arange(tokens)[None] < lengths[:, None]).float(), entropy=torch.rand(rows, tokens, generator=g) * 3,
                truncated=torch.tensor([True, False, False, False, True, False])[:rows])


def compare(config: GRPOConfig, data: dict, rows=slice(None), tokens_per_step: float | None = None):
    "Loss and gradient of jetrl and TRL on `data[rows]`; returns (jetrl loss, TRL loss, max gradient difference)."
    mask = data["mask"]
    if config.mask_truncated_completions: mask = mask * (~data["truncated"]).float()[:, None]   # as the loop does
    N = float(mask.sum()) if tokens_per_step is None else tokens_per_step
    d = {k: v[rows] for k, v in data.items()}
    mask_rows = mask[rows]
    entropy_mask = high_entropy_mask(d["entropy"], mask_rows, config.top_entropy_quantile) if config.top_entropy_quantile < 1 else None
    ours_logp = d["logp"].clone().requires_grad_()
    ours, _ = grpo_loss(ours_logp, d["old"], d["rollout"], d["advantages"], d["mask"], config, ref_logp=d["ref"],
                        truncated=d["truncated"], loss_normalizer=N / config.steps_per_generation, entropy_mask=entropy_mask)
    ours.backward()
    B, T = mask_rows.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask_rows,
              "advantages": d["advantages"], "old_per_token_logps": d["old"], "ref_per_token_logps": d["ref"],
              "num_items_in_batch": torch.tensor(float(mask.sum()))}
    if config.rollout_importance_sampling_mode is not None:
        inputs["importance_sampling_ratio"] = trl_rollout_ratio(config, d["old"], d["rollout"], mask_rows)
    theirs_logp = d["logp"].clone().requires_grad_()
    theirs, _ = trl_loss(config, theirs_logp, d["entropy"], inputs)
    theirs.backward()
    return ours.item(), theirs.item(), (ours_logp.grad - theirs_logp.grad).abs().max().item()


OPTIONS = dict(beta=[0.0, 0.04], use_bias_correction_kl=[True, False], delta=[None, 1.5], epsilon_high=[None, 0.28],
               rollout_importance_sampling_mode=[None, *ROLLOUT_IS_MODES], top_entropy_quantile=[1.0, 0.4],
               mask_truncated_completions=[False, True])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_option_combination_agrees_with_trl(loss_type, level):
    data, failures, checked = batch(), [], 0
    for values in itertools.product(*OPTIONS.values()):
        options = dict(zip(OPTIONS, values))
        if loss_type == "cispo":
            if options["delta"] is not None: continue                          # delta applies to the clipped losses only
            options["epsilon_high"] = 5.0 if options["epsilon_high"] is None else 4.0
        if options["beta"] == 0 and not options["use_bias_correction_kl"]: continue   # no KL: the switch does nothing
        config = GRPOConfig(loss_type=loss_type, importance_sampling_level=level, max_completion_length=7,
                            rollout_importance_sampling_clip_min=0.5, rollout_importance_sampling_clip_max=1.6, **options)
        ours, theirs, grad_gap = compare(config, data)
        checked += 1
        if not (abs(ours - theirs) <= TOLERANCE * max(1, abs(theirs)) and grad_gap <= TOLERANCE):
            failures.append(f"{options}: jetrl {ours:.7g} TRL {theirs:.7g} max |grad diff| {grad_gap:.2e}")
    assert checked >= 80 and not failures, f"{len(failures)} of {checked} disagree:\n" + "\n".join(failures[:10])


def test_the_cases_differ_from_each_other():
    "The options change the loss on this batch (so agreeing on it says something)."
    data = batch()
    losses = {}
    for name, config in {"dapo": GRPOConfig(), "grpo": GRPOConfig(loss_type="grpo"), "gspo": GRPOConfig(importance_sampling_level="sequence"),
                         "cispo": GRPOConfig(loss_type="cispo", epsilon_high=1.1), "delta": GRPOConfig(delta=1.05),
                         "kl": GRPOConfig(beta=0.5), "kl_plain": GRPOConfig(beta=0.5, use_bias_correction_kl=False),
                         "entropy": GRPOConfig(top_entropy_quantile=0.4), "truncated": GRPOConfig(mask_truncated_completions=True),
                         **{mode: GRPOConfig(rollout_importance_sampling_mode=mode, rollout_importance_sampling_clip_min=0.5,
                                             rollout_importance_sampling_clip_max=1.6) for mode in ROLLOUT_IS_MODES}}.items():
        ours, theirs, _ = compare(config, data)
        losses[name] = ours
    values = sorted(losses.values())
    assert min(b - a for a, b in zip(values, values[1:])) > 1e-4, losses


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_steps_per_generation_normaliser_agrees_with_trl(loss_type):
    "Two optimizer steps per generation: each half of the rows is normalised by N / 2, N counting the whole batch."
    config = GRPOConfig(loss_type=loss_type, steps_per_generation=2, epsilon_high=5.0 if loss_type == "cispo" else None,
                        mask_truncated_completions=True)
    data = batch()
    for half in (slice(0, 3), slice(3, 6)):
        ours, theirs, grad_gap = compare(config, data, rows=half)
        assert ours == pytest.approx(theirs, abs=TOLERANCE) and grad_gap <= TOLERANCE


def test_truncated_completions_shrink_dapo_normaliser_as_in_trl():
    "The bug of issue 13: N counted before truncated completions were masked made the loss kept/all times too small."
    config, data = GRPOConfig(mask_truncated_completions=True), batch()
    ours, theirs, _ = compare(config, data)
    all_tokens = float(data["mask"].sum())
    kept = float((data["mask"] * (~data["truncated"]).float()[:, None]).sum())
    stale, _, _ = compare(config, data, tokens_per_step=all_tokens)
    assert ours == pytest.approx(theirs, abs=TOLERANCE) and kept < all_tokens
    assert stale == pytest.approx(theirs * kept / all_tokens, rel=1e-5)
