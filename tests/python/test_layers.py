"""The package layout is the architecture (docs/ARCHITECTURE.md, "Layout"): ``python/baton``'s
layer packages import only from the layers below them, at module level and inside functions
alike. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "python" / "baton"

# lowest first; the base (0) is Baton's top-level modules that every layer may use
LAYERS = {"tracing": 1, "planning": 2, "emit": 3, "running": 4, "measure": 5, "frontend": 6}
BASE = {"", "errors", "_jax_compat", "_core", "mesh", "schedules", "runtime", "layout",
        "auto_schedule", "__version__"}
ABOVE = 7  # everything else (autoplan, init, data, checkpoint, scale, integrations, ...)


def layer(module: str) -> int:
    """The layer of a module named relative to ``baton`` (``running.step``)."""
    head = module.split(".")[0]
    if head in LAYERS:
        return LAYERS[head]
    return 0 if head in BASE else ABOVE


def imported(path: Path, root: Path) -> list[tuple[str, int]]:
    """Every Baton module ``path`` imports (relative to ``baton``), with its line: the module
    of each ``from X import y`` and, where X is a package, ``X.y`` too."""
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
            elif node.module and (node.module == "baton" or node.module.startswith("baton.")):
                base = []
                node_module = node.module.split(".", 1)[1] if "." in node.module else None
                target = base + (node_module.split(".") if node_module else [])
                out += [(".".join(target + [a.name]), node.lineno) for a in node.names]
                continue
            else:
                continue
            target = base + (node.module.split(".") if node.module else [])
            out += [(".".join(target + [a.name]), node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".", 1)[1], node.lineno) for a in node.names
                    if a.name.startswith("baton.")]
    return out


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_of(path, root)
        mine = layer(me)
        if mine == ABOVE or me == "":
            continue
        for target, line in imported(path, root):
            if layer(target) > mine:
                bad.append(f"{path.relative_to(root)}:{line} imports {target}")
    return bad


def test_each_layer_imports_only_the_layers_below_it():
    assert violations() == []


def test_every_layer_package_exists_and_the_old_flat_folder_is_gone():
    for name in LAYERS:
        assert (ROOT / name / "__init__.py").is_file(), name
    assert sorted(p.name for p in (ROOT / "frontend").glob("*.py")) == [
        "__init__.py", "api.py", "arguments.py", "checks.py", "inspection.py"]


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: an emitter module importing the step inside a function is
    reported; the step importing the emitter is not."""
    fake = tmp_path / "baton"
    (fake / "emit").mkdir(parents=True)
    (fake / "running").mkdir()
    (fake / "emit" / "x.py").write_text("def f():\n    from ..running.step import S\n")
    (fake / "running" / "step.py").write_text("from ..emit import x\n")
    assert violations(fake) == ["emit/x.py:2 imports running.step.S"]
