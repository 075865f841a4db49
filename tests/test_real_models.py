"""A user's path with a real model family, end to end: Hugging Face directory in, SFT, export, and
``transformers`` loading the result.

Each family is a tiny random model built by ``transformers`` with the family's real tokenizer files
(``tests/fixtures/tokenizers``, published vocabularies of 32k-152k tokens) and generation config. The
run goes through the real CLI's entry point (``lmforge.cli.main``, in the test process): ``lmforge
sft --model.from_hf`` on multi-turn chats for two steps, then ``lmforge export --hf``.
``transformers`` must load the export as the same class, give the same logits as lmforge on a chat
prompt built by its own ``apply_chat_template``, the same greedy tokens as lmforge's generator, and
the same stop tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _helpers import lmforge_in_process, tiny_run_args
from _hf_models import FAMILIES, hf_start as _hf_start

transformers = pytest.importorskip("transformers")

CHATS = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
CONVERSATION = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "A small model."},
                {"role": "user", "content": "What can you do?"}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every family fine-tuned for two steps, then exported, one after another through the CLI's entry
    point in this process (``lmforge_in_process``): fourteen subprocesses would each only add the
    imports of torch and transformers."""
    base = tmp_path_factory.mktemp("real_models")
    for family in FAMILIES:
        start = _hf_start(family, base / family / "hf_start")
        args = tiny_run_args(CHATS, model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None,
                             model_n_kv_heads=None, data_seq_len=128, training_steps=2, training_global_batch_size=4,
                             training_micro_batch_size=2, tasks_eval_examples=0)
        run = base / family / "run"
        assert lmforge_in_process("sft", *args, f"--model.from_hf={start}", f"--run.dir={run}") == 0, family
        assert lmforge_in_process("export", run, "--hf", base / family / "hf_out") == 0, family
    return base


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_with_equal_logits_tokens_and_stops(trained, family):
    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.inference import load_for_inference
    from lmforge.models.generate import generate

    start, out = trained / family / "hf_start", trained / family / "hf_out"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == json.loads((start / "config.json").read_text())["architectures"][0]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    model, tok = load_for_inference(trained / family / "run")
    model.eval()

    hf_ids = hf_tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    hf_ids = list(hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids)
    ids = chat_format_for(tok).prompt_ids(CONVERSATION)
    assert ids == hf_ids  # the exported template and tokenizer give the prompt lmforge trained with

    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-4, rtol=1e-4)
        ours = generate(model, [ids], 8, stop_ids=stop_token_ids(tok), pad_id=tok.pad_id, temperature=0.0)[0]
        theirs = hf.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_id)[0, len(ids):].tolist()
    eos = hf.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    if theirs and theirs[-1] in stops:  # transformers stops at the same tokens lmforge does
        assert ours == theirs
    else:
        assert ours == theirs[:len(ours)] and len(ours) == 8
    assert stops == set(stop_token_ids(tok))
    end_of_turn = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "smollm2": "<|im_end|>", "mistral": "</s>",
                   "gemma3": "<end_of_turn>", "qwen3_moe": "<|im_end|>", "mixtral": "</s>"}[family]
    assert tok.token_id(end_of_turn) in stops
    start_eos = json.loads((start / "generation_config.json").read_text())["eos_token_id"]
    assert set(start_eos if isinstance(start_eos, list) else [start_eos]) <= stops  # nothing dropped on export
