"""Small Hugging Face style tokenizer and model directories built inside the tests (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

# A ChatML-like template that exercises what HF rendering does: bos_token, loop variables, a system
# default, whitespace that only trim_blocks/lstrip_blocks remove, and raise_exception.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant') }}{% endif %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML-like, prefix-stable (like real templates): bos_token, loop variables, raise_exception."""

# The same conversation format written as an indented multi-line template: only HF's
# trim_blocks/lstrip_blocks make its output sensible, and its generation prompt renders differently
# from a following assistant turn (so assistant tokens must be located by search).
INDENTED_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Conversation roles must be system, user or assistant') }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
        {{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}
    {% endif %}
    {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\\n' }}
{% endif %}"""

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, this is a tiny tokenizer for tests.",
    "the quick brown fox jumps over the lazy dog",
    "what is two plus two? it is four. sort these numbers: 3, 1, 2",
    "you are helpful. system user assistant reverse the word",
] * 4


def make_tokenizer_dir(path: Path, template: str = CHATML_TEMPLATE, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
              "pad_token": "<pad>", "chat_template": template, "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


REAL_TOKENIZERS = Path(__file__).resolve().parent / "fixtures" / "tokenizers"
"""Published tokenizer files of Qwen2.5, SmolLM2 and Mistral v0.1 (see its README.md)."""


def make_end_of_turn_tokenizer_dir(path: Path) -> Path:
    """SmolLM2's tokenizer with EOS set to ``<|endoftext|>``, no generation_config.json: like Llama-3, a
    turn ends with another token (``<|im_end|>``) than EOS, and only the chat template says which."""
    src = REAL_TOKENIZERS / "smollm2-135m-instruct"
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def make_hf_model_dir(path: Path, vocab_size: int | None = None, seed: int = 0) -> Path:
    """A tiny random ``LlamaForCausalLM`` saved by transformers, plus the tokenizer above."""
    import torch
    import transformers

    make_tokenizer_dir(path)
    n_tokens = json.loads((path / "tokenizer.json").read_text())
    size = len(n_tokens["model"]["vocab"]) + sum(1 for t in n_tokens["added_tokens"]
                                                 if t["content"] not in n_tokens["model"]["vocab"])
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size or size, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=4, pad_token_id=2, initializer_range=0.3,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    return path


CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "it is four."}],
    [{"role": "system", "content": "you are helpful."}, {"role": "user", "content": "reverse the word dog"},
     {"role": "assistant", "content": "god"}, {"role": "user", "content": "and fox?"},
     {"role": "assistant", "content": " xof "}],
]
