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
* Functions that take few parameters: none with more than MAX_PARAMETERS (keyword-only ones and defaults
  included; self and cls not counted), but at most MAX_EXEMPT, each saying why with a `# many parameters:
  <why>` comment on its `def` line (pass a record instead: a frozen dataclass of the related values).
* Docstrings are contracts: a module's at most MAX_MODULE_DOCSTRING lines, a function's MAX_DOCSTRING
  (derivations and design stories go to docs/), and no module over MAX_MODULE_LINES lines.
* Small helpers once: the one-liner that writes mesh axes as a PartitionSpec entry (`x[0] if len(x) == 1
  else x`) exists once (jaxpar.core.rules.spec_entry).
* The model reads as its equations: no branch in models/ on how the run executes (a test that reads the
  RunConfig, `run`): the implementations are chosen once, outside it (jaxpar/training/trainer.py run_config).
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
MAX_PARAMETERS, MAX_EXEMPT = 8, 3
MAX_MODULE_DOCSTRING, MAX_DOCSTRING, MAX_MODULE_LINES = 40, 25, 600
MAX_INNER_IMPORTS = 10
MAX_TOP_MODULES = 8
REASON = re.compile(r"#\s*(deferred|cycle):\s*\S")
MANY = re.compile(r"#\s*many parameters:\s*\S")


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, line, length) of every function longer than `limit` lines."""
    return [(f.name, f.lineno, n) for f in _functions(ast.parse(source))
            if (n := f.end_lineno - f.lineno + 1) > limit]


def parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters of `f`: positional, keyword-only (defaults included), not self or cls, not *args / **kwargs."""
    a = f.args
    named = a.posonlyargs + a.args + a.kwonlyargs
    return len(named) - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def many_parameters(source: str, limit: int = MAX_PARAMETERS) -> list[tuple[str, int, int, bool]]:
    """(name, line, parameters, exempt by its `# many parameters:` comment) of every function over `limit`."""
    lines = source.splitlines()
    return [(f.name, f.lineno, n, bool(MANY.search(lines[f.lineno - 1])))
            for f in _functions(ast.parse(source)) if (n := parameters(f)) > limit]


def essays(source: str) -> list[tuple[str, int]]:
    """(where, lines) of a module docstring over MAX_MODULE_DOCSTRING lines or a function's over MAX_DOCSTRING."""
    tree = ast.parse(source)
    out = []
    doc = ast.get_docstring(tree)
    if doc and doc.count("\n") + 1 > MAX_MODULE_DOCSTRING:
        out.append(("module", doc.count("\n") + 1))
    for f in _functions(tree):
        doc = ast.get_docstring(f)
        if doc and doc.count("\n") + 1 > MAX_DOCSTRING:
            out.append((f.name, doc.count("\n") + 1))
    return out


def spec_one_liners(source: str) -> list[int]:
    """Lines of every `x[0] if len(x) == 1 else x` (a dim's mesh axes as one PartitionSpec entry)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.IfExp) and isinstance(node.body, ast.Subscript) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Call) and getattr(node.test.left.func, "id", "") == "len"
                and ast.unparse(node.body.value) == ast.unparse(node.orelse) == ast.unparse(node.test.left.args[0])):
            out.append(node.lineno)
    return out


def option_branches(source: str) -> list[int]:
    """Lines of every branch (if, conditional expression, while) whose test reads how the run executes: a name
    or attribute `run`."""
    def reads_run(test: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and n.id == "run") or (isinstance(n, ast.Attribute) and n.attr == "run")
                   for n in ast.walk(test))
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.If, ast.IfExp, ast.While)) and reads_run(n.test)]


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


def test_parameter_and_docstring_finders_find_planted_ones():
    many = ("def f(a, b, c, d, e, f, g, h, i): pass\n"
            "def g(a, b, c, d, e, f, g, h, *, i=1): pass  # many parameters: a public entry point\n"
            "class C:\n    def m(self, a, b, c, d, e, f, g, h): pass\n")
    assert many_parameters(many) == [("f", 1, 9, False), ("g", 2, 9, True)]
    essay = '"""' + "x\n" * MAX_MODULE_DOCSTRING + 'x"""\ndef f():\n    """' + "x\n" * MAX_DOCSTRING + 'x"""\n'
    assert essays(essay) == [("module", MAX_MODULE_DOCSTRING + 1), ("f", MAX_DOCSTRING + 1)]
    assert essays('"""' + "x\n" * (MAX_MODULE_DOCSTRING - 1) + 'x"""\n') == []


def test_one_liner_and_option_branch_finders_find_planted_ones():
    assert spec_one_liners("a = axes[0] if len(axes) == 1 else axes\nb = x[0] if len(y) == 1 else x\n") == [1]
    planted = ("def f(self, x, run):\n    if self.run.overlap == 'none':\n        pass\n"
               "    y = 1 if run.remat == 'full' else 2\n    z = x if self.cfg.qk_norm else 0\n")
    assert option_branches(planted) == [2, 4]


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


def test_functions_take_few_parameters():
    found = [(f"{path}:{line} {name} ({n})", exempt) for path, src, _ in _sources().values()
             for name, line, n, exempt in many_parameters(src)]
    loose = [where for where, exempt in found if not exempt]
    assert loose == [], (f"functions with more than {MAX_PARAMETERS} parameters (pass a record, or say why with "
                         f"`# many parameters: ...`): {loose}")
    assert len(found) <= MAX_EXEMPT, f"{len(found)} functions exempt from {MAX_PARAMETERS} parameters: {found}"


def test_docstrings_are_contracts_and_modules_short():
    long = [f"{path} {where} ({n} lines)" for path, src, _ in _sources().values() for where, n in essays(src)]
    assert long == [], f"docstrings over {MAX_MODULE_DOCSTRING} (module) / {MAX_DOCSTRING} lines: move the story to docs/: {long}"
    big = [f"{path} ({src.count(chr(10))} lines)" for path, src, _ in _sources().values()
           if src.count("\n") > MAX_MODULE_LINES]
    assert big == [], f"modules over {MAX_MODULE_LINES} lines (split by concept): {big}"


def test_small_helpers_are_written_once():
    copies = [f"{path}:{line}" for path, src, _ in _sources().values() for line in spec_one_liners(src)]
    assert len(copies) == 1 and copies[0].startswith("jaxpar/core/rules.py"), copies


def test_the_model_has_no_option_branch():
    branches = [f"{path}:{line}" for path, src, _ in _sources().values() if path.startswith("models/")
                for line in option_branches(src)]
    assert branches == [], f"models/ branch on how the run executes (choose the implementation in run_config): {branches}"


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
