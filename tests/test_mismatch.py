"Tests of jetrl.mismatch: hand-computed metrics, identities at zero mismatch, invariants, padding, bad inputs."
import json
import math

import pytest
import torch

from jetrl.mismatch import (MAX_ABS_LOG_RATIO, MISMATCH_KEYS, check_logps, clip_by_advantage_sign, kl_to_prev_policy,
                            mismatch_by_position, mismatch_metrics, ratio_stats)

L = math.log(2)


def hand_batch(dtype=torch.float64):
    """Two sequences, four real tokens with d = log p_train - log p_rollout = [0, L, -L | L], L = log 2.
    Row 0: p_rollout 0.5, 0.25, 0.5 -> p_train 0.5, 0.5, 0.25; row 1: p_rollout 0.2 -> p_train 0.4.
    The masked-out tokens hold garbage (positive, NaN, huge) that must change nothing."""
    rollout = torch.tensor([[0.5, 0.25, 0.5, 1.0], [0.2, 0.9, 0.3, 0.1]], dtype=dtype).log()
    train = torch.tensor([[0.5, 0.5, 0.25, 1.0], [0.4, 0.1, 0.3, 0.1]], dtype=dtype).log()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    train[0, 3], rollout[1, 1], train[1, 2], rollout[1, 3] = 7.0, math.nan, -1e6, 1e4
    return train, rollout, mask


# Expected values, by hand, for d = [0, L, -L, L], r = e^d = [1, 2, 1/2, 2], n = 4:
HAND = {
    "mismatch/logp_abs_diff_mean": 3 * L / 4,                 # (0 + L + L + L) / 4
    "mismatch/logp_abs_diff_max": L,
    "mismatch/prob_abs_diff_mean": 0.175,                     # (0 + 0.25 + 0.25 + 0.2) / 4
    "mismatch/prob_abs_diff_max": 0.25,
    "mismatch/kl_k1": -L / 4,                                 # mean(-d) = -(0 + L - L + L) / 4: negative
    "mismatch/kl_k3": 3 / 8 - L / 4,                          # [0 + (1 - L) + (L - 1/2) + (1 - L)] / 4
    "mismatch/token_mult_prob_error": 1.75,                   # (1 + 2 + 2 + 2) / 4
    "mismatch/is_ratio_mean": 1.375,                          # (1 + 2 + 0.5 + 2) / 4
    "mismatch/is_ratio_min": 0.5,
    "mismatch/is_ratio_max": 2.0,
    "mismatch/chi2_token": 0.5625,                            # (0 + 1 + 0.25 + 1) / 4
    "mismatch/ess": 30.25 / 37,                               # 5.5^2 / (4 * (1 + 4 + 0.25 + 4))
    "mismatch/tis_clip_frac": 0.5,                            # with cap 1.5: the two ratios of 2
    "mismatch/seq_logp_abs_diff_mean": L / 2,                 # (|0 + L - L| + |L|) / 2
    "mismatch/tokens": 4,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_metrics_match_hand_computed_values(dtype):
    train, rollout, mask = hand_batch(dtype)
    metrics = mismatch_metrics(train, rollout, mask, tis_cap=1.5)
    assert list(metrics) == list(MISMATCH_KEYS) == list(HAND)
    # bf16 holds log 0.2 etc. to ~3 significant digits; fp32 to ~1e-7
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    for key, value in HAND.items():
        assert metrics[key] == pytest.approx(value, abs=tol), key
    assert metrics["mismatch/tokens"] == 4 and isinstance(metrics["mismatch/tokens"], int)
    json.dumps(metrics)  # plain Python numbers


def test_tis_cap():
    train, rollout, mask = hand_batch()
    frac = lambda cap: mismatch_metrics(train, rollout, mask, tis_cap=cap)["mismatch/tis_clip_frac"]
    assert frac(0.9) == 0.75   # 1, 2, 2 exceed 0.9
    assert frac(1.5) == 0.5    # 2, 2
    assert frac(2.5) == 0.0
    with pytest.raises(ValueError, match="tis_cap"):
        frac(0.0)


def test_identical_logps_give_no_mismatch():
    train, _, mask = hand_batch()
    m = mismatch_metrics(train, train.clone(), mask)
    for key in ("logp_abs_diff_mean", "logp_abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_max", "kl_k1",
                "kl_k3", "chi2_token", "tis_clip_frac", "seq_logp_abs_diff_mean"):
        assert m[f"mismatch/{key}"] == 0.0, key
    for key in ("token_mult_prob_error", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "ess"):
        assert m[f"mismatch/{key}"] == 1.0, key
    assert kl_to_prev_policy(train, train.clone(), mask) == 0.0
    assert ratio_stats(train, train.clone(), mask) == {"ppo/ratio_mean": 1.0, "ppo/ratio_min": 1.0, "ppo/ratio_max": 1.0,
                                                       "ppo/clip_frac_low": 0.0, "ppo/clip_frac_high": 0.0,
                                                       "ppo/clip_frac": 0.0}


def random_batch(seed, B=6, T=40, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    train = -3 * torch.rand(B, T, generator=g) - 1e-3
    rollout = (train + scale * torch.randn(B, T, generator=g)).clamp(max=0)
    mask = torch.rand(B, T, generator=g) < 0.8
    return train, rollout, mask


def loop_metrics(train, rollout, mask):
    "Mean |d|, k1, k3, ESS one token at a time: a second oracle for random batches."
    ds = [t - r for tr, rr, mr in zip(train.tolist(), rollout.tolist(), mask.tolist())
          for t, r, m in zip(tr, rr, mr) if m]
    rs = [math.exp(d) for d in ds]
    n = len(ds)
    return {"mismatch/logp_abs_diff_mean": sum(map(abs, ds)) / n, "mismatch/kl_k1": -sum(ds) / n,
            "mismatch/kl_k3": sum(math.exp(d) - d - 1 for d in ds) / n,
            "mismatch/ess": sum(rs) ** 2 / (n * sum(r * r for r in rs))}


@pytest.mark.parametrize("seed", range(20))
def test_random_invariants(seed):
    train, rollout, mask = random_batch(seed, scale=[0.01, 0.5, 3.0][seed % 3])
    m = mismatch_metrics(train, rollout, mask)
    assert m["mismatch/kl_k3"] >= 0
    assert 0 < m["mismatch/ess"] <= 1
    assert m["mismatch/is_ratio_min"] <= m["mismatch/is_ratio_mean"] <= m["mismatch/is_ratio_max"]
    assert m["mismatch/token_mult_prob_error"] >= 1 and m["mismatch/chi2_token"] >= 0
    assert m["mismatch/tokens"] == int(mask.sum())
    for key, value in loop_metrics(train, rollout, mask).items():
        assert m[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert kl_to_prev_policy(rollout, train, mask) == pytest.approx(m["mismatch/kl_k3"], rel=1e-12)


def test_k3_nonnegative_even_for_tiny_differences():
    train = -torch.rand(4, 1000, dtype=torch.float64)
    rollout = train + 1e-12 * torch.randn(4, 1000, dtype=torch.float64)
    assert mismatch_metrics(train, rollout.clamp(max=0), torch.ones(4, 1000))["mismatch/kl_k3"] >= 0


def test_k1_can_be_negative_on_a_batch():
    # one token with d = +1, none with d < 0: k1 = -1, while k3 = e - 2 > 0
    m = mismatch_metrics(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.ones(1, 1))
    assert m["mismatch/kl_k1"] == pytest.approx(-1.0)
    assert m["mismatch/kl_k3"] == pytest.approx(math.e - 2, rel=1e-6)


def test_masked_out_tokens_have_no_influence():
    train, rollout, mask = random_batch(1)
    reference = mismatch_metrics(train, rollout, mask)
    garbage_train, garbage_rollout = train.clone(), rollout.clone()
    off = ~mask
    garbage_train[off] = torch.tensor([math.nan, 50.0, -1e30, math.inf]).repeat(int(off.sum()))[: int(off.sum())]
    garbage_rollout[off] = -1e30
    assert mismatch_metrics(garbage_train, garbage_rollout, mask) == reference
    assert mismatch_by_position(garbage_train, garbage_rollout, mask) == mismatch_by_position(train, rollout, mask)
    assert kl_to_prev_policy(garbage_rollout, garbage_train, mask) == kl_to_prev_policy(rollout, train, mask)
    assert ratio_stats(garbage_train, garbage_rollout, mask) == ratio_stats(train, rollout, mask)


def test_large_differences_stay_finite():
    # d = -50 and +30: clamped to +-20 for ratios, reported raw in logp_abs_diff_max and k1
    m = mismatch_metrics(torch.tensor([[-60.0, -1.0]]), torch.tensor([[-10.0, -31.0]]), torch.ones(1, 2))
    assert all(math.isfinite(v) for v in m.values())
    assert m["mismatch/logp_abs_diff_max"] == 50.0
    assert m["mismatch/kl_k1"] == pytest.approx(10.0)     # -(-50 + 30) / 2
    assert m["mismatch/is_ratio_min"] == pytest.approx(math.exp(-MAX_ABS_LOG_RATIO))
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(MAX_ABS_LOG_RATIO))


def test_empty_mask_gives_nan():
    train, rollout, mask = hand_batch()
    empty = torch.zeros_like(mask)
    m = mismatch_metrics(train, rollout, empty)
    assert list(m) == list(MISMATCH_KEYS) and m["mismatch/tokens"] == 0
    assert all(math.isnan(v) for k, v in m.items() if k != "mismatch/tokens")
    assert math.isnan(kl_to_prev_policy(train, rollout, empty))
    assert all(math.isnan(v) for v in ratio_stats(train, rollout, empty).values())
    assert mismatch_by_position(train, rollout, empty) == {"positions": [], "logp_abs_diff_mean": [], "kl_k3": [],
                                                           "tokens": []}
    nothing = torch.zeros(3, 0)
    assert mismatch_metrics(nothing, nothing, nothing)["mismatch/tokens"] == 0


def test_by_position_hand_computed():
    train, rollout, mask = hand_batch()
    # bucket 0 (positions 0-1): d at [0,0], [0,1], [1,0] = 0, L, L; bucket 1 (positions 2-3): d at [0,2] = -L
    got = mismatch_by_position(train, rollout, mask, bucket_size=2)
    assert got["positions"] == [0, 2] and got["tokens"] == [3, 1]
    assert got["logp_abs_diff_mean"] == pytest.approx([2 * L / 3, L])
    assert got["kl_k3"] == pytest.approx([2 * (1 - L) / 3, L - 0.5])   # e^L - L - 1 = 1 - L; e^-L + L - 1 = L - 1/2
    json.dumps(got)
    with pytest.raises(ValueError, match="bucket_size"):
        mismatch_by_position(train, rollout, mask, bucket_size=0)


@pytest.mark.parametrize("bucket_size", [1, 7, 32, 100])
def test_by_position_counts_add_up(bucket_size):
    train, rollout, mask = random_batch(3, T=70)
    got = mismatch_by_position(train, rollout, mask, bucket_size=bucket_size)
    assert sum(got["tokens"]) == int(mask.sum())
    assert all(p % bucket_size == 0 for p in got["positions"]) and got["positions"] == sorted(got["positions"])
    # the token-weighted mean of the buckets is the batch mean
    weighted = sum(a * n for a, n in zip(got["logp_abs_diff_mean"], got["tokens"])) / sum(got["tokens"])
    assert weighted == pytest.approx(mismatch_metrics(train, rollout, mask)["mismatch/logp_abs_diff_mean"])


def test_by_position_skips_empty_buckets():
    train = torch.full((2, 10), -1.0)
    mask = torch.zeros(2, 10)
    mask[0, :3] = 1   # positions 0-2
    mask[1, 8] = 1    # position 8
    got = mismatch_by_position(train, train - 0.5, mask, bucket_size=4)
    assert got["positions"] == [0, 8] and got["tokens"] == [3, 1]


def test_kl_to_prev_policy_hand_computed():
    train, rollout, mask = hand_batch()
    # samples from the rollout ("previous") policy, new - prev = d: the k3 of the hand batch
    assert kl_to_prev_policy(rollout, train, mask) == pytest.approx(3 / 8 - L / 4)


def test_ratio_stats_hand_computed():
    train, rollout, mask = hand_batch()
    # r = [1, 2, 0.5, 2]; eps 0.2: region [0.8, 1.2], below: 0.5 (1/4), above: 2, 2 (2/4)
    assert ratio_stats(train, rollout, mask, epsilon=0.2) == pytest.approx(
        {"ppo/ratio_mean": 1.375, "ppo/ratio_min": 0.5, "ppo/ratio_max": 2.0,
         "ppo/clip_frac_low": 0.25, "ppo/clip_frac_high": 0.5, "ppo/clip_frac": 0.75})
    # eps 0.6, eps_high 1.5: region [0.4, 2.5] holds every ratio
    got = ratio_stats(train, rollout, mask, epsilon=0.6, epsilon_high=1.5, prefix="train/")
    assert got == pytest.approx({"train/ratio_mean": 1.375, "train/ratio_min": 0.5, "train/ratio_max": 2.0,
                                 "train/clip_frac_low": 0.0, "train/clip_frac_high": 0.0, "train/clip_frac": 0.0})


@pytest.mark.parametrize("seed", range(4))
def test_clip_by_advantage_sign_matches_a_token_by_token_count(seed):
    "Against a loop over the tokens: a cut is A < 0 with r < 1 - eps, or A > 0 with r > 1 + eps_high, over all real tokens."
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    new, old = -torch.rand(B, T, generator=g) * 3, -torch.rand(B, T, generator=g) * 3
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    adv = torch.randn(B, generator=g); adv[0] = 0.0                      # a group with equal rewards: advantage 0
    eps, eps_high = 0.2, 0.28
    low = high = n = 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]: continue
            n += 1; r, a = math.exp(float(new[b, t] - old[b, t])), float(adv[b])
            low += a < 0 and r < 1 - eps; high += a > 0 and r > 1 + eps_high
    got = clip_by_advantage_sign(new, old, adv, mask, epsilon=eps, epsilon_high=eps_high)
    assert got == pytest.approx({"clip_ratio/low_mean": low / n, "clip_ratio/high_mean": high / n}, abs=1e-12)
    assert low > 0 and high > 0                                          # the batch exercises both cuts
    assert clip_by_advantage_sign(new, new, adv, mask) == {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0}
    assert all(math.isnan(v) for v in clip_by_advantage_sign(new, old, adv, torch.zeros_like(mask)).values())


# --- bad inputs ---------------------------------------------------------------------------------------------------

def bad_inputs():
    train, rollout, mask = hand_batch()
    nan_train = train.clone(); nan_train[0, 1] = math.nan
    positive = train.clone(); positive[1, 0] = 0.5
    return {
        "shapes": ((train[:, :3], rollout, mask), "shapes"),
        "mask shape": ((train, rollout, mask[:, :3]), "shapes"),
        "1-D": ((train[0], rollout[0], mask[0]), "shapes"),
        "int logps": ((train, rollout.long(), mask), "floating-point"),
        "positive": ((positive, rollout, mask), "log-probability is <= 0"),
        "probabilities": ((train.exp(), rollout, mask), "log-probability is <= 0"),
        "nan": ((nan_train, rollout, mask), r"NaN at real tokens.*\[0, 1\]"),
        "mask values": ((train, rollout, mask * 2), "0 and 1"),
    }


@pytest.mark.parametrize("case", list(bad_inputs()))
@pytest.mark.parametrize("function", [mismatch_metrics, mismatch_by_position, kl_to_prev_policy, ratio_stats])
def test_bad_inputs_raise(case, function):
    args, message = bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        function(*args)


def test_tiny_positive_rounding_is_accepted():
    # log 1 may come out a hair above 0 after rounding; up to 1e-6 is accepted
    logp = torch.tensor([[5e-7, -1.0]])
    assert check_logps(torch.ones(1, 2), a=logp, b=logp).all()


def test_logps_with_grad_are_accepted():
    train, rollout, mask = hand_batch()
    train.requires_grad_(True)
    assert mismatch_metrics(train, rollout, mask)["mismatch/tokens"] == 4
