"""Build lmforge's API reference from its docstrings with pdoc: ``python docs/build_api.py [OUT_DIR]``.

Every public module gets a page, also those a package leaves out of its ``__all__`` (pdoc follows
``__all__`` when it walks a package, so the modules are named here one by one). A module that cannot
be imported stops the build with its traceback and a non-zero exit: a broken import never ships as a
silently missing page. ``make docs`` runs this into ``docs/api/`` (git-ignored).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pdoc
import pdoc.render

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
IMPORT_FAILURES = ("Couldn't import", "Error loading", "Cannot find spec")
"""The starts of pdoc's warnings for a module it could not import (it skips the module otherwise)."""


def public_modules(package: str = "lmforge") -> list[str]:
    """Dotted names of every module and package under ``src/<package>`` without a ``_`` part."""
    names = []
    for f in sorted((SRC / package).rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            names.append(".".join(parts))
    return names


def build(out: Path) -> list[str]:
    """Write the reference into ``out``; returns the modules documented."""
    modules = public_modules()
    pdoc.render.configure(docformat="restructuredtext", footer_text="lmforge", show_source=False)
    # Each package is named beside its modules, which pdoc reports as a repeat; and annotations that name
    # what only a type checker imports (`if TYPE_CHECKING:`) are shown as written, which it also reports.
    warnings.filterwarnings("ignore", message="The module specification")
    warnings.filterwarnings("ignore", message="Error parsing type annotation")
    for message in IMPORT_FAILURES:
        warnings.filterwarnings("error", message=message)
    pdoc.pdoc(*modules, output_directory=out)
    missing = [m for m in modules if not (out / (m.replace(".", "/") + ".html")).is_file()]
    if missing:
        raise SystemExit(f"error: no page written for {', '.join(missing)}")
    return modules


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "docs" / "api"
    sys.path.insert(0, str(SRC))
    modules = build(out)
    print(f"API reference: {len(modules)} modules in {out}/index.html")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
