"""The cost model's two layers (jaxpar/cost/__init__.py). The textbook modules (the hardware, the algorithm,
and the collectives each parallelism issues) import nothing of the implementation layer (software presets,
compiler traits, overlap, jaxpar's program's adjustments, the recipe that applies them) and take no program
or compiler flag: what XLA, a stack or jaxpar's program makes of the textbook is applied afterwards, by name.
"Is this jaxpar's own program?" is asked one way, `Software.jaxpar_program`. Each checker is tested first on a
planted offender."""
import ast
import pathlib

COST = pathlib.Path(__file__).resolve().parent.parent / "jaxpar" / "cost"
TEXTBOOK = ("hardware", "params", "flops", "shape", "memory", "held", "floor", "time", "energy", "sites",
            "comm_data", "comm_tensor", "comm_context", "comm_pipeline", "comm_expert", "weight_moves")
# the implementation layer, and the modules over both layers (estimate, inference, the recipe comm, the
# published runs and the bands read from them)
IMPLEMENTATION = ("software", "compiler", "compiler_comm", "inventory_jax", "program_memory", "program_flops",
                  "program_comm", "program_pipeline", "comm", "overlap", "estimate", "inference", "band",
                  "published")
# parameter names that carry a compiler, a stack or jaxpar's program into a function: none in the textbook
PROGRAM_FLAGS = {"cc", "compiler", "software", "own", "piped", "one_f", "rerun_chunk", "jaxpar_program",
                 "departures", "copies", "label_phase", "hoist", "combine", "program"}
PROGRAM_TYPES = ("Compiler", "Software")
# the spellings the one question had besides `jaxpar_program`
OTHER_SPELLINGS = ("jax_program", "jax_activations", "jaxpar_pipeline", "scatter_gather is None", "JAXPAR.name")


def implementation_imports(source: str) -> list[str]:
    """`module.name` of every name a module imports from the implementation layer."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxpar.cost":
                found += [a.name for a in node.names if a.name in IMPLEMENTATION]
            elif node.module.startswith("jaxpar.cost.") and node.module.split(".")[2] in IMPLEMENTATION:
                found += [f"{node.module.split('.')[2]}.{a.name}" for a in node.names]
            elif node.module in ("jaxpar.xla_workarounds", "jaxpar.xla_presets"):
                found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[-1] in IMPLEMENTATION
                      and a.name.startswith("jaxpar.cost.")]
    return found


def program_parameters(source: str) -> list[str]:
    """`function(parameter)` of every parameter named as a program or compiler flag, or annotated with a
    compiler or a stack."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                hint = ast.unparse(arg.annotation) if arg.annotation else ""
                if arg.arg in PROGRAM_FLAGS or any(t in hint for t in PROGRAM_TYPES):
                    found.append(f"{node.name}({arg.arg})")
    return found


def test_the_checkers_find_planted_offenders():
    planted = ("from jaxpar.cost.compiler import AR, CPU\nfrom jaxpar.cost import software, params\n"
               "from jaxpar.cost.params import block_counts\nfrom jaxpar.xla_workarounds import gathered\n")
    assert implementation_imports(planted) == ["compiler.AR", "compiler.CPU", "software", "jaxpar.xla_workarounds.gathered"]
    assert program_parameters("def f(m, st, cc, act, *, own=False): pass\ndef g(x: 'Compiler'): pass\n"
                              "def h(m, shape, act): pass\n") == ["f(cc)", "f(own)", "g(x)"]


def test_the_layers_name_every_module():
    names = {p.stem for p in COST.glob("*.py")} - {"__init__", "report", "defaults"}
    assert names == set(TEXTBOOK) | set(IMPLEMENTATION)


def test_textbook_modules_import_no_implementation():
    found = {name: implementation_imports((COST / f"{name}.py").read_text()) for name in TEXTBOOK}
    assert {k: v for k, v in found.items() if v} == {}


def test_textbook_functions_take_no_program_or_compiler():
    found = {name: program_parameters((COST / f"{name}.py").read_text()) for name in TEXTBOOK}
    assert {k: v for k, v in found.items() if v} == {}
    assert [name for name in TEXTBOOK if "jaxpar_program" in (COST / f"{name}.py").read_text()] == []


def test_one_name_for_jaxpars_own_program():
    sources = {p.name: p.read_text() for p in COST.glob("*.py")}
    assert "jaxpar_program: bool = trait(True" in sources["software.py"]
    assert [(name, s) for name, src in sources.items() for s in OTHER_SPELLINGS if s in src] == []
