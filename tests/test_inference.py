"""Hugging Face in and out: SFT from a transformers-written Llama, export, and transformers agrees."""

from __future__ import annotations

import json

import pytest
import torch

from _chat_fixtures import CONVERSATIONS, make_end_of_turn_tokenizer_dir, make_hf_model_dir
from _helpers import run_lmforge
from lmforge.exporters import export_hf
from lmforge.inference import load_for_inference, sample_texts

transformers = pytest.importorskip("transformers")

TINY_RUN = ["--data.seq_len=64", "--training.global_batch_size=4", "--training.micro_batch_size=4",
            "--eval.interval=0", "--metrics.tensorboard=false", "--data.prefetch=0", "--optimizer.lr=1e-3",
            "--schedule.warmup_steps=0"]
PROMPT = "hello world, the quick"


def hf_logits(model_dir, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0], m


def test_hf_round_trip_through_sft_and_export(tmp_path, capsys):
    src = make_hf_model_dir(tmp_path / "hf")
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS * 4) + "\n")
    ids = transformers.AutoTokenizer.from_pretrained(str(src))(PROMPT, add_special_tokens=False)["input_ids"]

    # Loading the transformers checkpoint gives transformers' logits.
    model, tok = load_for_inference(src)
    assert tok.encode(PROMPT) == ids
    theirs, _ = hf_logits(src, ids)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids]))[0], theirs, rtol=1e-4, atol=1e-4)

    run = tmp_path / "run"
    r = run_lmforge("sft", f"--model.from_hf={src}", f"--data.train={data}", "--data.validation=none",
            "--training.steps=3", f"--run.dir={run}", *TINY_RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    from lmforge.cli import main  # the remaining commands run in-process (one interpreter start saved each)

    out = tmp_path / "out"
    assert main(["export", "--hf", str(out), str(run)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}

    # The fine-tuned weights changed, and transformers computes the same logits as lmforge on them.
    tuned, _ = load_for_inference(run)
    with torch.no_grad():
        ours = tuned(torch.tensor([ids]))[0]
    assert not torch.allclose(ours, theirs, atol=1e-3)
    exported, hf_model = hf_logits(out, ids)
    torch.testing.assert_close(exported, ours, rtol=1e-4, atol=1e-4)

    # `lmforge generate` and transformers' greedy generate produce the same tokens.
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                            eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)[0, len(ids):]
    assert printed.rstrip("\n") == hf_tok.decode(gen, skip_special_tokens=True)
    assert sample_texts(tuned, tok, [PROMPT], max_new_tokens=12) == [hf_tok.decode(gen, skip_special_tokens=True)]


def test_byte_run_exports_to_transformers(tmp_path):
    """A byte-tokenizer lmforge run exports with an equivalent tokenizer.json and chat template."""
    from lmforge.cli import main

    run = tmp_path / "run"
    assert main(["sft", "--model.size=debug", "--model.n_layers=2", "--model.dim=64", "--tasks.train_examples=32",
                 "--tasks.eval_examples=0", "--data.validation=none", "--training.steps=1", f"--run.dir={run}",
                 *TINY_RUN]) == 0
    out = export_hf(run, tmp_path / "out")
    model, tok = load_for_inference(run)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    from lmforge.inference import chat_prompt_ids

    assert ids == chat_prompt_ids(tok, "What is 2 + 2?")
    theirs, _ = hf_logits(out, ids)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids]))[0], theirs, rtol=1e-4, atol=1e-4)


def test_tokenizer_vocab_mismatch_is_refused(tmp_path, capsys):
    from lmforge.cli import main

    small = make_hf_model_dir(tmp_path / "hf", vocab_size=64)  # its tokenizer has ~300 tokens
    rc = main(["sft", f"--model.from_hf={small}", f"--run.dir={tmp_path / 'run'}", *TINY_RUN])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit the model's vocab_size (64)" in err


def test_export_lists_every_stop_token(tmp_path):
    """EOS is <|endoftext|> but turns end with <|im_end|>: the exported generation_config lists both, so
    transformers' generate stops at the end of a chat turn as lmforge does."""
    src = make_end_of_turn_tokenizer_dir(tmp_path / "hf")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=49152, max_position_embeddings=64,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(src))
    (src / "generation_config.json").unlink()  # the end of turn must come from the chat template
    out = export_hf(src, tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    stops = [hf_tok.convert_tokens_to_ids("<|endoftext|>"), hf_tok.convert_tokens_to_ids("<|im_end|>")]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == stops
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == stops


def test_export_refuses_a_file_and_replaces_an_earlier_export_whole(tmp_path):
    from lmforge.errors import UserError

    trained_run = make_hf_model_dir(tmp_path / "src")

    target = tmp_path / "existing"
    target.write_text("not a directory")
    with pytest.raises(UserError, match="exists and is not a directory"):
        export_hf(trained_run, target)
    assert target.read_text() == "not a directory"
    out = export_hf(trained_run, tmp_path / "hf")
    (out / "stale.txt").write_text("from an earlier export")
    export_hf(trained_run, out)
    assert (out / "config.json").is_file() and not (out / "stale.txt").exists()
    assert not list(tmp_path.glob(".hf.*"))


def test_export_leaves_the_users_partial_named_files_alone_and_fills_the_working_directory(tmp_path, capfd):
    """The temporary names an export writes under are its own (random): a user's ``hf.partial``,
    ``.hf.partial`` or ``.hf.old`` survives untouched. ``--hf .`` in an empty working directory fills it in
    place (the directory itself is not renamed away from under the shell)."""
    from _helpers import lmforge_in_process

    src = make_hf_model_dir(tmp_path / "src")
    mine = {tmp_path / "hf.partial": "file", tmp_path / ".hf.partial": "dir", tmp_path / ".hf.old": "dir"}
    for path, kind in mine.items():
        if kind == "dir":
            path.mkdir()
            (path / "keep.txt").write_text("mine")
        else:
            path.write_text("mine")
    for _ in range(2):  # a new export, then one over it
        assert lmforge_in_process("export", "--hf", tmp_path / "hf", src) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf.partial").read_text() == "mine"
    assert all((p / "keep.txt").read_text() == "mine" for p, kind in mine.items() if kind == "dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", "hf", *(p.name for p in mine)])

    here = tmp_path / "empty"
    here.mkdir()
    assert lmforge_in_process("export", "--hf", ".", src, cwd=here) == 0
    assert (here / "config.json").is_file() and here.is_dir()
    assert not list(tmp_path.glob(".empty.*"))


def test_names_too_long_for_the_file_system_are_one_line(tmp_path, capfd):
    from _helpers import lmforge_in_process

    src = make_hf_model_dir(tmp_path / "src")
    capfd.readouterr()  # transformers' progress bars
    long = tmp_path / ("x" * 300)
    for args in (["export", "--hf", long, src], ["export", "--gguf", f"{long}.gguf", src],
                 ["rm", f"--data.train={long}.jsonl", f"--run.dir={tmp_path / 'run'}"],
                 ["sft", f"--run.dir={long}"]):
        assert lmforge_in_process(*args) == 2, args
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "too long" in err[0], (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
