"""The cost model's two layers (jaxpar/cost/__init__.py): the textbook modules import nothing of the
implementation layer (software presets, compiler traits, jaxpar's program's adjustments, the predicted
collectives of the compiled program); the modules of the collectives each parallelism issues import no
software preset and none of jaxpar's program's adjustments, take no `jaxpar_program`, and only those in
COMPILER_BRANCHES read a compiler trait themselves (the others leave it to compiler.py's `site`); and
"is this jaxpar's own program?" is asked one way, `Software.jaxpar_program`. Each checker is tested
first on a planted offender."""
import ast
import pathlib

COST = pathlib.Path(__file__).resolve().parent.parent / "jaxpar" / "cost"
TEXTBOOK = ("hardware", "params", "flops", "shape", "memory", "held", "floor", "time", "energy")
# the collectives each parallelism issues: textbook, with XLA's passes applied through compiler.py
COLLECTIVES = ("comm_data", "comm_tensor", "comm_context", "comm_pipeline", "comm_expert")
COMPILER_KIN = {"Compiler", "site", "together", "reductions", "ar_bytes", "scattered", "input_grads", "weight_buffers", "weight_buckets",
                "input_grad_sums"}   # the passes as compiler.py applies them
# still branching on a trait of its own (XLA:CPU's unhoisted loop sums and its combiner's grouping)
COMPILER_BRANCHES = ("comm_data",)
# the implementation layer, and the modules over both layers (estimate, inference)
IMPLEMENTATION = ("software", "compiler", "compiler_comm", "inventory_jax", "program_memory", "program_flops",
                  "program_comm", "program_pipeline", "comm", "overlap", "estimate", "inference", "band")
TRAITS = ("reduce_scatter", "reassociate", "combine", "hoist", "fold", "promote_bf16")   # compiler.Compiler's
KIND_NAMES = {"AR", "AG", "RS", "A2A", "PERMUTE"}   # the collective kinds' names (compiler.py): no trait
# the spellings the one question had besides `jaxpar_program`
OTHER_SPELLINGS = ("jax_program", "jax_activations", "jaxpar_pipeline", "scatter_gather is None", "JAXPAR.name")


def implementation_imports(source: str) -> list[str]:
    """`module.name` of every name a module imports from the implementation layer (kind names aside)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxpar.cost":
                found += [a.name for a in node.names if a.name in IMPLEMENTATION]
            elif node.module.startswith("jaxpar.cost.") and node.module.split(".")[2] in IMPLEMENTATION:
                found += [f"{node.module.split('.')[2]}.{a.name}" for a in node.names if a.name not in KIND_NAMES]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[-1] in IMPLEMENTATION
                      and a.name.startswith("jaxpar.cost.")]
    return found


def test_the_checker_finds_a_planted_offender():
    planted = ("from jaxpar.cost.compiler import AR, CPU\nfrom jaxpar.cost import software, params\n"
               "from jaxpar.cost.params import block_counts\n")
    assert implementation_imports(planted) == ["compiler.CPU", "software"]


def trait_reads(source: str) -> list[str]:
    """Every `x.trait` a module reads, trait one of `Compiler`'s."""
    tree = ast.parse(source)
    return [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in TRAITS]


def test_the_layers_name_every_module():
    names = {p.stem for p in COST.glob("*.py")} - {"__init__", "report", "defaults"}
    assert names == set(TEXTBOOK) | set(COLLECTIVES) | set(IMPLEMENTATION)


def test_textbook_modules_import_no_implementation():
    found = {name: implementation_imports((COST / f"{name}.py").read_text()) for name in TEXTBOOK}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_trait_checker_finds_a_planted_read():
    assert trait_reads("x = a if cc.hoist else b\nsite(cc, AR)\n") == ["hoist"]


def test_collective_modules_import_no_software_and_no_program():
    found = {name: [n for n in implementation_imports((COST / f"{name}.py").read_text())
                    if n.split(".")[-1] not in COMPILER_KIN] for name in COLLECTIVES}
    assert {k: v for k, v in found.items() if v} == {}
    assert [name for name in COLLECTIVES if "jaxpar_program" in (COST / f"{name}.py").read_text()] == []


def test_only_the_listed_collective_modules_read_a_compiler_trait():
    reads = {name: trait_reads((COST / f"{name}.py").read_text()) for name in COLLECTIVES}
    assert {k for k, v in reads.items() if v} == set(COMPILER_BRANCHES)


def test_one_name_for_jaxpars_own_program():
    sources = {p.name: p.read_text() for p in COST.glob("*.py")}
    assert "jaxpar_program: bool = True" in sources["software.py"]
    assert [(name, s) for name, src in sources.items() for s in OTHER_SPELLINGS if s in src] == []
