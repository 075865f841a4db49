"""The model layer's boundaries: code outside ``lmforge/models`` never names a decoder's submodules (the
family's spec and the model's own methods answer for them), and ``models/`` has no import circle beyond
the family registry's registration."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lmforge"
SUBMODULES = {"wq", "wk", "wv", "wo", "w1", "w2", "w3", "feed_forward", "attention_norm", "ffn_norm",
              "post_attention_norm", "post_ffn_norm", "tok_embeddings", "q_norm", "k_norm", "shared_experts",
              "q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "correction_bias"}
"""Names of modules and parameters inside lmforge's decoders."""
_PATH = re.compile(r"\b(attention|feed_forward|experts|router|layers\.\d+)\.\w+")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            for stmt in body:  # the docstring and attribute docstrings (a bare string statement)
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                    ids.add(id(stmt.value))
    return ids


def named_submodules(path: Path) -> list[str]:
    """Where ``path``'s code (not its docstrings or comments) names a decoder submodule."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SUBMODULES:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            words = set(re.findall(r"\w+", node.value))
            if node.value in SUBMODULES or _PATH.search(node.value) or (words & SUBMODULES and "." in node.value
                                                                          and " " not in node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return sorted(found)


def test_no_module_outside_models_names_decoder_submodules():
    offenders = [hit for path in sorted(SRC.rglob("*.py")) if "models" not in path.relative_to(SRC).parts[:1]
                 for hit in named_submodules(path)]
    assert offenders == []


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """The scan above can fail: it flags an attribute, a module path in a string, and not a docstring."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""mentions model.tok_embeddings in prose"""\n'
                     'def f(model):\n    return model.tok_embeddings.weight, "feed_forward.w1"\n')
    assert named_submodules(probe) == ["probe.py:3: 'feed_forward.w1'", "probe.py:3: .tok_embeddings"]


def _imports(path: Path) -> set[str]:
    """The ``lmforge.models`` modules ``path`` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmforge.models"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if (SRC.parent / (full.replace(".", "/") + ".py")).exists()
                        or (SRC.parent / full.replace(".", "/")).is_dir() else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lmforge.models"))
    return out


def test_models_has_no_import_circle_beyond_registration():
    """The only cycle allowed in ``models/`` runs through the registry's registration: the registry's
    lookups (``args.load_families``, ``spec``) import the families on first use and they import ``args``
    and ``spec`` to register. Without those registration edges ``models/`` has no cycle at all."""
    modules = {}
    for path in (SRC / "models").rglob("*.py"):
        name = "lmforge." + ".".join(path.relative_to(SRC.parent).with_suffix("").parts[1:])
        modules[name.removesuffix(".__init__")] = _imports(path)
    registration = {("lmforge.models.args", "lmforge.models.families"), ("lmforge.models.spec", "lmforge.models.families")}
    graph = {m: {d for d in deps if d in modules and d != m and (m, d) not in registration}
             for m, deps in modules.items()}

    def reaches(start: str, goal: str, avoid: set[str]) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            for d in graph.get(m, ()):
                if d == goal:
                    return True
                if d not in seen and d not in avoid:
                    seen.add(d)
                    todo.append(d)
        return False

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert circles == []
