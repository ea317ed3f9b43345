"Tests of jetrl.tiny's shipped assets: they load offline, the tokenizer and chat template agree with raw prompts, the model answers."
import json

import pytest
import torch

from jetrl.tasks import number_reward
from jetrl.tiny import (EOS_TOKEN, LEVELS, TINY_DIR, TRAIN_SCRIPT, generate_completions, level_rows, load_tiny,
                        target_completion)

TEST_SEED = 4204  # a fixed set of prompts, neither a training seed (1000 * seed + i) nor the evaluation seed


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_assets_are_shipped_and_small():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "training.json"):
        assert (TINY_DIR / name).is_file(), name
    assert (TINY_DIR / "model.safetensors").stat().st_size < 20e6
    training = json.loads((TINY_DIR / "training.json").read_text())
    assert training["command"].startswith(f"python {TRAIN_SCRIPT}")
    assert set(training["accuracy"]) == set(LEVELS)


def test_loads_offline(tiny, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_tiny(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training


def test_model_shapes(tiny):
    model, tokenizer = tiny
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 704, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert config.intermediate_size % 128 != 0  # on purpose: FP8's partial-block path
    assert config.hidden_size % 128 == 0 and config.vocab_size % 128 == 0 and len(tokenizer) <= config.vocab_size
    assert model.model.layers[0].mlp.up_proj.weight.shape == (704, 256)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert 3.0e6 < sum(p.numel() for p in model.parameters()) < 3.2e6
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_tokenizer_round_trips_bytes(tiny):
    _, tokenizer = tiny
    rows = [row for level in LEVELS for row in level_rows(level, 5, TEST_SEED)]
    for text in [row["prompt"] + target_completion(row) for row in rows] + ["naïve 🙂\ttabs, é\n\n  -0042 ∑"]:
        assert tokenizer.decode(ids(tokenizer, text)) == text
    assert [tokenizer.decode(i) for i in ids(tokenizer, "9081726354")] == list("9081726354")  # one id per digit
    for row in rows:  # the prompt/completion boundary is a token boundary
        assert ids(tokenizer, row["prompt"]) + ids(tokenizer, target_completion(row)) == ids(
            tokenizer, row["prompt"] + target_completion(row))


def test_chat_template_is_the_raw_prompt(tiny):
    _, tokenizer = tiny
    for row in level_rows("easy", 4, TEST_SEED):
        chat = [{"role": "user", "content": row["prompt"]}]
        assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == row["prompt"]
        chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert list(chat_ids) == ids(tokenizer, row["prompt"])
        full = chat + [{"role": "assistant", "content": target_completion(row)}]
        assert tokenizer.apply_chat_template(full, tokenize=False) == row["prompt"] + target_completion(row) + EOS_TOKEN


def test_answers_easy_prompts_greedily(tiny):
    # Measured: 3 of these 8 right (float rounding may flip one); 24.5% of 200 easy prompts (training.json).
    model, tokenizer = tiny
    rows = level_rows("easy", 8, TEST_SEED)
    completions = generate_completions(model, tokenizer, [row["prompt"] for row in rows])
    rewards = number_reward(None, completions, [row["answer"] for row in rows])
    assert sum(rewards) >= 2, list(zip(completions, [row["answer"] for row in rows]))


def test_hard_level_is_mostly_wrong(tiny):
    # Measured: 0 of these 40 right; 0.0% of 200 hard prompts (training.json).
    model, tokenizer = tiny
    rows = level_rows("hard", 40, TEST_SEED)
    completions = generate_completions(model, tokenizer, [row["prompt"] for row in rows])
    assert sum(number_reward(None, completions, [row["answer"] for row in rows])) <= 0.1 * len(rows)


def test_bad_path_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=TRAIN_SCRIPT) as error:
        load_tiny(folder=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(error.value) and "model.safetensors" in str(error.value)
