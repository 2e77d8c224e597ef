"""The packages meet only where DESIGN §2 lets them: an AST walk over every module.

- gpu_backend never imports dpu_frontend (not even lazily inside a function);
- shared_layout imports neither side, nor torch (the DPU installs it);
- dpu_frontend never imports torch, and reaches gpu_backend only by name in the CLI's
  subcommand table or a child process's command line (strings, not imports).

Every `import` and `from ... import` is checked, wherever it sits in the module, and a
relative import is resolved against the module's own package first.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package -> top-level names its modules must never import
FORBIDDEN = {
    "gpu_backend": {"dpu_frontend", "bench"},
    "shared_layout": {"dpu_frontend", "gpu_backend", "bench", "torch"},
    "dpu_frontend": {"gpu_backend", "bench", "torch"},
}


def imported_names(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in the module at `path`, in line order."""
    package = list(path.relative_to(root).parts[:-1])      # a module's package; __init__'s own
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return sorted(out)


def modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_the_design_allows(package):
    files = modules(package)
    assert files, f"no modules found under {package}/"
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in files for line, name in imported_names(path)
           if name.split(".")[0] in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative one are both found."""
    pkg = tmp_path / "gpu_backend" / "sub"
    pkg.mkdir(parents=True)
    mod = pkg / "m.py"
    mod.write_text("def f():\n    from dpu_frontend.app import x\n\nfrom ..engine import y\n")
    assert imported_names(mod, root=tmp_path) == [(2, "dpu_frontend.app"), (4, "gpu_backend.engine")]
