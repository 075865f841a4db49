"""Host memory: glibc keeps no freed tensor buffers, the chunked loss holds one chunk of logits, and
loading a GGUF keeps no second copy of the weights (bench/sft_memory.py measures the real model)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn.functional as F

from _helpers import cli_env
from lmforge.models import gguf as gguf_module
from lmforge.models.args import model_args_for
from lmforge.exporters.gguf_write import write_gguf
from lmforge.models.hf import hf_state_dict_from_lmforge
from lmforge.models.spec import spec_for_args
from lmforge.planning.memory_probe import LiveTensorMemory
from lmforge.losses.chunked_loss import _log_softmax_, chunked_target_logprob_sum
from lmforge.runtime.host_memory import _glibc

# One process, three phases, RSS after each (MB): a 20 MB buffer freed under glibc's default (after a
# 30 MB mapping was freed, which raised the dynamic threshold over 20 MB, so the buffer came from the
# heap and stays resident), then malloc_trim, then the same buffer with large buffers mapped.
_SCRIPT = textwrap.dedent("""
    import ctypes, json
    from lmforge.runtime.host_memory import _glibc, map_large_buffers, trim
    libc = _glibc()
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
    def cycle(mb):  # what a tensor's buffer goes through: malloc, every page written, free
        p = libc.malloc(mb << 20)
        ctypes.memset(p, 1, mb << 20)
        libc.free(p)
    cycle(30)
    start = rss(); cycle(20); kept = rss() - start
    trim(); trimmed = rss() - start
    state = map_large_buffers(); cycle(20); mapped = rss() - start
    print(json.dumps({"kept": kept, "trimmed": trimmed, "mapped": mapped, "state": state}))
""")


@pytest.mark.skipif(_glibc() is None or sys.platform != "linux", reason="glibc's malloc on Linux")
def test_large_buffers_go_back_to_the_os_once_mapped():
    env = {k: v for k, v in cli_env().items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["state"] == "on"
    assert r["kept"] > 15, r  # glibc's default: the freed buffer stays resident
    assert r["trimmed"] < 5, r  # malloc_trim hands it back
    assert r["mapped"] < 5, r  # mapped: freed straight back


def test_log_softmax_in_place_is_bit_identical_and_holds_one_chunk():
    z = torch.randn(37, 1000, generator=torch.Generator().manual_seed(0)) * 8
    assert torch.equal(_log_softmax_(z.clone()), F.log_softmax(z, dim=-1))
    # the cross-entropy path's forward: besides the two gradients it computes (hidden- and weight-sized),
    # at most one chunk of fp32 logits (plus the small per-row values) may be live
    n, dim, vocab, chunk = 256, 8, 4096, 64
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, dim, generator=g, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    with LiveTensorMemory() as mem:
        mem.track([hidden, weight, targets])
        base = mem.current
        total, _ = chunked_target_logprob_sum(hidden, weight, targets, chunk_tokens=chunk)
        extra = mem.peak - base
    grads, logits = 4 * (n * dim + vocab * dim), 4 * chunk * vocab
    assert extra <= grads + 1.1 * logits, (extra, grads, logits)  # out of place: grads + 2 x logits
    ref = F.log_softmax(hidden.detach() @ weight.detach().t(), dim=-1).gather(1, targets[:, None]).sum()
    assert torch.allclose(total, ref, rtol=1e-5)


def test_loading_a_gguf_keeps_no_second_copy(tmp_path, monkeypatch):
    args = model_args_for("debug", 320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    source = spec_for_args(args).build(args)
    source.init_weights(seed=0)
    path = write_gguf(hf_state_dict_from_lmforge(source.state_dict(), args), args, tmp_path / "m.gguf",
                      gguf_type="f32")
    readers: list[weakref.ref] = []
    open_gguf = gguf_module.open_gguf

    def opened(p):  # noqa: ANN001, ANN202
        reader = open_gguf(p)
        readers.append(weakref.ref(reader))
        return reader

    monkeypatch.setattr(gguf_module, "open_gguf", opened)
    model = gguf_module.load_gguf_model(path)
    assert readers and all(r() is None for r in readers)  # the file's mapping is gone with its reader
    for name, p in model.named_parameters():  # each weight is its own buffer: no view into a bigger one
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
    for (name, p), q in zip(model.state_dict().items(), source.state_dict().values()):
        assert torch.equal(p, q), name
