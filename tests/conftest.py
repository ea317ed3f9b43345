"""Shared fixtures: a small random causal LM saved as a model folder, built offline in a second."""
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jetrl.tasks import ArithmeticTask


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    "A random Llama with a byte-level BPE tokenizer that can write arithmetic answers, saved as a model folder."
    rows = ArithmeticTask(digits=2).sample(100)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r["prompt"] + " <answer>" + r["answer"] + "</answer>" for r in rows],
                            trainers.BpeTrainer(vocab_size=384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=["<pad>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128))
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder); tokenizer.save_pretrained(folder)
    return str(folder)
