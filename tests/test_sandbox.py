"""Attacks on the code sandbox (:mod:`lmforge.rl.tools.sandbox`): each must be held.

Every attack runs with a short wall-clock limit; a test asserts what the attack would have achieved did
not happen (no file outside the scratch directory, no connection, no secret read, no process left), not
only that an error came back. The ``_audit=False`` tests take the interpreter layer away to show the OS
layer holds by itself where this machine gives it (a network namespace; a dropped user).
"""

from __future__ import annotations

import glob
import os
import socket
import tempfile
import threading

import pytest

from lmforge.rl.tools.sandbox import SandboxLimits, drops_to_nobody, network_isolation, run_python

FAST = SandboxLimits(timeout_s=3, cpu_s=3)


def _scratch_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "lmforge-sandbox-*")))


def test_ordinary_code_runs_and_errors_come_back_as_their_last_line():
    ok = run_python("import json, math, collections, itertools\nprint(json.dumps([math.factorial(5)]))", FAST)
    assert ok.ok and ok.for_model() == "[120]"
    bad = run_python("def f(x):\n    return x / 0\nf(1)", FAST)
    assert not bad.ok and bad.for_model() == "error: ZeroDivisionError: division by zero"


def test_fork_bomb_is_refused_and_leaves_no_process():
    before = _scratch_dirs()
    r = run_python("import os\nwhile True:\n    os.fork()", FAST)
    assert not r.ok and "os.fork is not allowed" in r.error
    r = run_python("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])", FAST)
    assert not r.ok and "not allowed" in r.error
    r = run_python("import os\nos.system('echo escaped > escaped.txt')\nprint(open('escaped.txt').read())", FAST)
    assert not r.ok and "os.system is not allowed" in r.error
    assert _scratch_dirs() == before


@pytest.mark.skipif(os.geteuid() == 0 and not drops_to_nobody(),
                    reason="RLIMIT_NPROC does not bind a root child (it cannot drop to nobody here)")
def test_fork_bomb_is_held_by_the_process_limit_alone():
    r = run_python("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            os._exit(0)\n"
                   "        n += 1\nexcept OSError as e:\n    print('refused after', n)", FAST, _audit=False)
    assert r.ok and r.stdout == "refused after 0"


def test_memory_bombs_are_a_memory_error():
    r = run_python("x = bytearray(2 ** 34)", FAST)
    assert r.error == "MemoryError"
    r = run_python("a = []\nwhile True:\n    a.append(' ' * 10 ** 7)", SandboxLimits(timeout_s=10, memory_mb=256))
    assert r.error == "MemoryError" and not r.timed_out


def test_infinite_loops_and_sleeps_are_killed_on_time():
    for code in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        r = run_python(code, SandboxLimits(timeout_s=1.0, cpu_s=5))
        assert r.timed_out and r.returncode is None and r.seconds < 3
        assert r.for_model().startswith("error: timed out after")
    r = run_python("while True:\n    pass", SandboxLimits(timeout_s=10, cpu_s=1))  # the CPU limit first
    assert not r.timed_out and r.error.startswith("killed by SIGXCPU") and r.seconds < 5


def test_writing_outside_the_scratch_directory_is_refused(tmp_path):
    target = tmp_path / "owned.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import os\nos.symlink({str(tmp_path)!r}, 'out')\nopen('out/owned.txt', 'w').write('x')",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})", f"import os\nos.chdir({str(tmp_path)!r})",
                 f"import os\nfor top, dirs, names, fd in os.fwalk({str(tmp_path)!r}):\n    print(names)"):
        r = run_python(code, FAST)
        assert not r.ok and "sandbox:" in r.error, (code, r)
    assert tmp_path.exists() and not target.exists()
    inside = run_python("open('a.txt', 'w').write('hi')\nimport os\nos.mkdir('d')\nprint(open('a.txt').read())", FAST)
    assert inside.ok and inside.stdout == "hi"


def test_a_readable_directory_cannot_be_written_through_a_directory_fd(tmp_path):
    """Paths are checked against the working directory; ``dir_fd=`` would resolve them elsewhere, so no
    directory fd outside the scratch directory is handed out (here a configured, readable import path)."""
    attack = (f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
              "open('owned.txt', 'w', opener=lambda p, f: os.open(p, f, dir_fd=fd)).write('x')")
    r = run_python(attack, SandboxLimits(timeout_s=3, python_paths=(str(tmp_path),)))
    assert not r.ok and "os.open of" in r.error
    assert not (tmp_path / "owned.txt").exists()


def test_the_scratch_directory_is_removed_and_file_sizes_are_capped():
    before = _scratch_dirs()
    r = run_python("open('big', 'w').write('x' * (8 * 2 ** 20))", SandboxLimits(timeout_s=5, file_mb=1))
    assert not r.ok and "File too large" in r.error
    r = run_python("import os\nprint(os.getcwd())", FAST)
    assert r.ok and not os.path.exists(r.stdout)
    assert _scratch_dirs() == before


def test_output_is_capped():
    r = run_python("while True:\n    print('x' * 1000)", SandboxLimits(timeout_s=5, output_chars=500))
    assert r.cut and len(r.stdout) == 500 and len(r.for_model()) < 700


def _listening_server() -> tuple[socket.socket, list[bool]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(5)
    accepted: list[bool] = []

    def accept() -> None:
        try:
            server.accept()
            accepted.append(True)
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_sockets_are_refused():
    server, accepted = _listening_server()
    port = server.getsockname()[1]
    for code in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                 f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
                 "import _socket", "import ctypes"):
        r = run_python(code, FAST)
        assert not r.ok and "not allowed" in r.error, (code, r)
    server.close()
    assert not accepted


@pytest.mark.skipif(network_isolation() != "namespace", reason="no network namespace on this machine")
def test_the_network_namespace_alone_has_no_route():
    server, accepted = _listening_server()
    port = server.getsockname()[1]
    r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", FAST, _audit=False)
    server.close()
    assert not r.ok and ("unreachable" in r.error or "refused" in r.error.lower()), r
    assert not accepted


def test_the_trainers_files_and_environment_are_not_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_TEST_SECRET", "hunter2")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("hunter2\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    attacks = (f"print(open({str(run_dir / 'metrics.jsonl')!r}).read())",
               f"import os\nprint(os.listdir({str(run_dir)!r}))",
               f"print(open({os.path.join(repo, 'pyproject.toml')!r}).read())",
               "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
               "print(open('/proc/self/environ').read())",
               "print(open('/etc/passwd').read())",
               f"import os\nos.symlink({str(run_dir / 'metrics.jsonl')!r}, 'm')\nprint(open('m').read())")
    for code in attacks:
        r = run_python(code, FAST)
        assert not r.ok and "hunter2" not in r.stdout and "not allowed" in r.error, (code, r)
    env = run_python("import os\nprint(sorted(os.environ))", FAST)
    assert env.ok and "LMFORGE_TEST_SECRET" not in env.stdout and "PATH" not in env.stdout.replace("'", " ").split()


def test_the_standard_library_only_unless_configured(tmp_path):
    r = run_python("import torch", FAST)
    assert not r.ok and "ModuleNotFoundError" in r.error
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    r = run_python("import helper_mod\nprint(helper_mod.VALUE)", SandboxLimits(timeout_s=3, python_paths=(str(tmp_path),)))
    assert r.ok and r.stdout == "7"
