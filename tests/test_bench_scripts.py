"""Every benchmark and example script parses and its imports resolve: they run outside the suite (minutes
each), so a refactor that breaks or moves what one imports would otherwise go unnoticed until someone
reruns a table."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py")])

# Runs each script's module body (its imports and definitions; `main()` stays behind its __name__ guard)
# in one fresh process, and prints the scripts that fail.
_IMPORT_EACH = """
import importlib.util, sys
from pathlib import Path
for p in map(Path, sys.argv[1:]):
    sys.path.insert(0, str(p.parent))
    spec = importlib.util.spec_from_file_location(f"_script_{p.parent.name}_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        print(f"{p.parent.name}/{p.name}: {type(e).__name__}: {e}")
"""


def test_there_are_scripts_to_check() -> None:
    assert len(SCRIPTS) > 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_compiles(script: Path, tmp_path: Path) -> None:
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_every_script_imports() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *map(str, SCRIPTS)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", "scripts whose imports fail:\n" + done.stdout
