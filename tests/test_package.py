"""The package as a user gets it: a wheel that runs from any directory, imports that run one way,
modules a newcomer can read, and a README layout that names every folder."""
import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (pyproject.toml [tool.setuptools.package-dir]).
SOURCES = {"jaxpar": ROOT / "jaxpar", "jaxpar.models": ROOT / "models"}
# A smoke detector, not a rule: modules are split by concept, never by length; one that passes this
# has probably taken in a second concept.
MAX_LINES = 600


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file, lazy imports included, type-only
    imports not).
    `from pkg import sub` is an edge to pkg.sub when sub is a module, else to pkg."""
    mods = modules()
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in mods]
                if len(targets) < len(subs):
                    targets.append(node.module)
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_run_one_way():
    graph = import_graph()
    assert "jaxpar.models.mamba" in graph and "jaxpar.ops.attention" in graph  # the walk sees both trees
    assert cycles(graph) == []
    for name, targets in graph.items():
        if name.startswith("jaxpar.ops"):  # kernels never import models
            assert not {t for t in targets if t.startswith("jaxpar.models")}, (name, targets)
        if name.startswith(("jaxpar.cost", "jaxpar.collectives")):  # the analytic model reads no compiled program
            assert not {t for t in targets if t.startswith("jaxpar.analysis")}, (name, targets)
    assert not {t for t in graph["jaxpar.core.validate"] if t.startswith(("jaxpar.models", "jaxpar.ops"))}
    upper = ("jaxpar.models", "jaxpar.ops", "jaxpar.pipeline", "jaxpar.training", "jaxpar.serving", "jaxpar.cost",
             "jaxpar.analysis", "jaxpar.planning", "jaxpar.cli")
    for name, targets in graph.items():
        if name.startswith("jaxpar.core"):  # the idea sits below everything that runs it
            assert not {t for t in targets if t.startswith(upper)}, (name, targets)
        if name.startswith("jaxpar.models"):  # models know no schedule, trainer, server or cost model
            assert not {t for t in targets if t.startswith(upper[2:])}, (name, targets)


def test_modules_stay_small():
    long = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_readme_layout_names_every_folder():
    """The layout is a tree: jaxpar's folders are branches of `jaxpar/`, the others top-level entries
    (tests/test_docs.py also checks that every path it names exists)."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    folders = [f"── {p.name}/" for p in (ROOT / "jaxpar").iterdir() if (p / "__init__.py").exists()]
    for folder in [*folders, "\njaxpar/", "\nmodels/", "\nmesh_configs/", "\nexperiments/", "\ndocs/", "\ntests/"]:
        assert folder in layout, f"README's layout does not name {folder.strip()}"


def test_docs_are_in_the_repository():
    """Docstrings point to docs/design.md, which a clone contains (no DESIGN.md outside the repo)."""
    assert (ROOT / "docs" / "design.md").exists()
    stale = [str(p.relative_to(ROOT)) for p in modules().values() if "DESIGN.md" in p.read_text()]
    assert stale == []


@pytest.mark.skipif(sys.platform != "linux", reason="venv layout")
def test_wheel_installs_and_trains_from_any_directory(tmp_path):
    """Build the wheel, install it (no dependencies: those come from this environment, read-only) in a
    fresh venv, and train on dp8 from an empty directory: the strategy catalogue and the models ship
    inside the package, and no top-level `models` package is installed."""
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("jaxpar", "models", "mesh_configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("jaxpar-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    # the dependencies (jax, flax, ...) from this environment; its .pth files (the editable jaxpar)
    # are not processed from a plain path entry, so only the wheel provides jaxpar
    deps = next(p for p in map(pathlib.Path, sys.path) if p.name == "site-packages" and (p / "jax").exists())
    (site / "deps.pth").write_text(str(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    assert not (site / "models").exists(), "the wheel installed a top-level `models` package"
    assert (site / "jaxpar" / "models" / "lm.py").exists() and (site / "jaxpar" / "mesh_configs" / "dp8.toml").exists()
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    out = subprocess.run([str(venv / "bin" / "jaxpar"), "train", "--model", "llama-tiny", "--mesh", "dp8",
                          "--devices", "8", "--steps", "2", "--batch", "8", "--seq", "16", "--no-progress"],
                         cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strategy dp8 [data=8]" in out.stdout and "final loss" in out.stdout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import jaxpar; print(jaxpar.__file__)"],
                           cwd=run_dir, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(site)), where.stdout
