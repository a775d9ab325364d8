"""The shape of the code a reader meets, checked over the installed package (jaxpar/ and models/).

These limits are smoke detectors, not goals: code is split by concept, never by line count, and a
function cut into parts that make no sense alone is worse than one long function. The rules:

* Functions a person can hold in mind: none over MAX_FUNCTION_LINES lines, counted from the `def`
  line to the last line of the body (decorators not counted; a nested function counts on its own
  and inside its parent).
* Private names stay in their module: no `from jaxpar.x import _name` (nor the relative form), and no
  `x._name` where `x` is a package module imported by name (`from jaxpar import distributed`,
  `import jaxpar.core.mesh as mesh`). Dunder names (`__version__`) are not private.
* Imports at the top of a module, so its dependencies are read at its top. An import inside a
  function (any depth) is allowed only where it breaks a real import cycle or keeps a heavy or optional
  dependency off a path that does not need it, and says which with a comment on the import's line:
  `# cycle: <the cycle>` or `# deferred: <what is deferred, and for whom>`. At most MAX_INNER_IMPORTS
  such imports in all.
* `jaxpar/` keeps at most MAX_TOP_MODULES modules at its top level: the *.py files directly in
  jaxpar/, `__init__.py` included; everything else lives in a package named for its concept.
* The pipeline is one package, `jaxpar/pipeline/` (an `__init__.py`, its public API), with no
  `pipeline*.py` module beside it at the top level.

Each checker is a plain function over source text, tested first on a planted offender, so that a
checker that finds nothing is known to be able to find something.
"""
import ast
import re

from tests.test_package import ROOT, modules

MAX_FUNCTION_LINES = 80
MAX_INNER_IMPORTS = 10
MAX_TOP_MODULES = 8
REASON = re.compile(r"#\s*(deferred|cycle):\s*\S")


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, line, length) of every function longer than `limit` lines."""
    return [(f.name, f.lineno, n) for f in _functions(ast.parse(source))
            if (n := f.end_lineno - f.lineno + 1) > limit]


def inner_imports(source: str) -> list[tuple[int, bool]]:
    """(line, has its reason comment) of every import inside a function, each counted once."""
    lines = source.splitlines()
    found: dict[int, bool] = {}
    for f in _functions(ast.parse(source)):
        for node in ast.walk(f):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                found[node.lineno] = bool(REASON.search(text))
    return sorted(found.items())


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str | None:
    """The absolute module an ImportFrom reads from (resolving `from . import x` inside `module`)."""
    if node.level == 0:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[:len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(source: str, module: str, package_modules: set[str], is_package: bool = False) -> list[str]:
    """Private names of other package modules that `module` imports or reads as `alias._name`."""
    out, aliases = [], {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            origin = _absolute(module, node, is_package)
            if origin is None or origin.split(".")[0] != "jaxpar" or origin == module:
                continue
            for a in node.names:
                if _private(a.name) and f"{origin}.{a.name}" not in package_modules:
                    out.append(f"line {node.lineno}: from {origin} import {a.name}")
                if f"{origin}.{a.name}" in package_modules:
                    aliases[a.asname or a.name] = f"{origin}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in package_modules and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr) and aliases[node.value.id] != module):
            out.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return out


# ---- the checkers, on planted offenders ---------------------------------------------------------


def test_long_function_finder_finds_a_planted_one():
    body = "".join(f"        x{i} = {i}\n" for i in range(80))
    source = f"class C:\n    def short(self):\n        return 0\n\n    def long(self):\n{body}"
    assert long_functions(source) == [("long", 5, 81)]  # the def line and 80 more
    assert long_functions(source.replace("        x79 = 79\n", "")) == []  # 80 lines: at the limit


def test_inner_import_finder_reads_the_reason_comment():
    source = ("import os\n\n"
              "def f():\n"
              "    import jax  # deferred: JAX stays out of `jaxpar estimate`\n"
              "    from a import (b,  # cycle: a imports this module\n"
              "                   c)\n"
              "    import json\n"
              "    def g():\n"
              "        import numpy  # noqa: PLC0415\n")
    assert inner_imports(source) == [(4, True), (5, True), (7, False), (9, False)]


def test_private_use_finder_finds_planted_ones():
    mods = {"jaxpar.a", "jaxpar.b", "jaxpar.pkg", "jaxpar.pkg.c"}
    planted = ("from jaxpar.b import _hidden, shown\n"
               "from jaxpar.pkg.c import __version__\n"
               "from jaxpar import b\n"
               "import jaxpar.pkg.c as c\n"
               "from . import _x\n"
               "def f():\n"
               "    return b._state, c._cache, c.public, _own()\n")
    assert private_uses(planted, "jaxpar.a", mods) == [
        "line 1: from jaxpar.b import _hidden", "line 5: from jaxpar import _x",
        "line 7: b._state (jaxpar.b)", "line 7: c._cache (jaxpar.pkg.c)"]
    # a package's __init__ reading its own private name, and relative imports inside a package
    assert private_uses("from ._impl import _y\n", "jaxpar.pkg", mods | {"jaxpar.pkg._impl"}, is_package=True) == [
        "line 1: from jaxpar.pkg._impl import _y"]
    assert private_uses("from jaxpar.b import shown\nimport os\nos._exit(0)\n", "jaxpar.a", mods) == []


# ---- the package --------------------------------------------------------------------------------


def _sources() -> dict[str, tuple[str, str, bool]]:
    """module -> (path relative to the repository, source, is a package __init__)."""
    return {name: (str(path.relative_to(ROOT)), path.read_text(), path.name == "__init__.py")
            for name, path in modules().items()}


def test_no_function_over_80_lines():
    long = [f"{path}:{line} {name} ({n} lines)" for path, src, _ in _sources().values()
            for name, line, n in long_functions(src)]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines (split them by concept): {long}"


def test_no_private_name_crosses_a_module():
    sources = _sources()
    names = set(sources)
    found = [f"{path} {use}" for module, (path, src, package) in sources.items()
             for use in private_uses(src, module, names, package)]
    assert found == [], f"private names used outside their module (make them public, or move the code): {found}"


def test_imports_inside_functions_are_few_and_say_why():
    inner = [(path, line, ok) for path, src, _ in _sources().values() for line, ok in inner_imports(src)]
    unexplained = [f"{path}:{line}" for path, line, ok in inner if not ok]
    assert unexplained == [], ("imports inside functions without a `# deferred: ...` or `# cycle: ...` comment "
                               f"(move them to the top, or say why not): {unexplained}")
    assert len(inner) <= MAX_INNER_IMPORTS, (f"{len(inner)} imports inside functions, at most {MAX_INNER_IMPORTS}: "
                                             f"{[f'{p}:{n}' for p, n, _ in inner]}")


def test_top_level_keeps_few_modules():
    top = sorted(p.name for p in (ROOT / "jaxpar").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in jaxpar/ (at most {MAX_TOP_MODULES}): {top}"


def test_pipeline_is_one_package():
    assert (ROOT / "jaxpar" / "pipeline" / "__init__.py").exists(), "jaxpar/pipeline/ is not a package"
    loose = sorted(p.name for p in (ROOT / "jaxpar").glob("pipeline*.py"))
    assert loose == [], f"pipeline modules outside jaxpar/pipeline/: {loose}"
