"""Are the cost model's numbers those of another commit? A refactoring's check (`--base REV`).

Draws seeded cases that cover every strategy option value, stack preset, compiler and hardware profile
(training estimates with their predicted collectives under each compiler, inference estimates, plans),
evaluates them in this tree and in a git worktree of REV (the same cases: this script runs in both), and
prints the count of cases per value and the largest relative difference of any figure (0, or float noise
<= 1e-12, is what a refactoring must show). Only public entry points are called, so both trees answer:
    python scripts/same_numbers.py --base HEAD~3 [--train 5000 --inference 200 --plans 12]
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPILER_NAMES = ("gpu", "tpu", "cpu")


def factor(devices: int, rng: random.Random, axes: tuple[str, ...]) -> dict[str, int]:
    """A random split of `devices` (a power of two) over the mesh axes."""
    sizes = dict.fromkeys(axes, 1)
    n = devices
    while n > 1:
        sizes[rng.choice(axes)] *= 2
        n //= 2
    return sizes


def draw_options(sizes: dict[str, int], units: int, rng: random.Random, choices: dict) -> dict:
    """Options that mostly apply to `sizes` (validate.check refuses the rest)."""
    o = {"remat": rng.choice(choices["remat"]), "dtype": rng.choice(choices["dtype"]),
         "grad_dtype": rng.choice(choices["grad_dtype"]), "attention_kernel": rng.choice(choices["attention_kernel"]),
         "moe_kernel": rng.choice(choices["moe_kernel"]), "zero": rng.choice((None, 0, 1, 3)),
         "xla_preset": rng.choice(choices["xla_preset"]) if rng.random() < 0.25 else "none"}
    if sizes["context"] > 1:
        o["attention"] = rng.choice(("ring", "allgather"))
        o["cp_layout"] = rng.choice(choices["cp_layout"])
    if sizes["tensor"] > 1:
        o["sequence_parallel"] = rng.random() < 0.6
        if o["sequence_parallel"] and rng.random() < 0.3:
            o["overlap"] = rng.choice(("collective_matmul", "collective_matmul_bidir"))
    if sizes["pipeline"] > 1:
        o["pp_schedule"] = rng.choice(choices["pp_schedule"])
        o["microbatches"] = rng.choice((1, 2, 4, 8, 16))
        if o["pp_schedule"] != "gpipe":
            o["pp_repeats"] = rng.choice((1, 2))
    if rng.random() < 0.2:
        o["grad_accum"] = rng.choice((2, 4))
    if rng.random() < 0.1:
        o["fsdp_prefetch"] = True
        o["remat"], o["zero"] = "full", 3
    return o


def training_cases(n: int, seed: int) -> list[dict]:
    """`n` valid training questions (spec dicts: model, mesh, options, hardware, software, batch, seq)."""
    from jaxpar.core import validate
    from jaxpar.core.strategy import AXES, CHOICES, Strategy, make_options
    from jaxpar.cost.hardware import known_profiles
    from jaxpar.cost.software import SOFTWARE, refusal
    from jaxpar.cost.estimate import check_modelled_layout
    from jaxpar.errors import ConfigError
    from jaxpar.models.config import PRESETS, parse_model

    rng, out = random.Random(seed), []
    hardware, software = sorted(known_profiles()), sorted(SOFTWARE)
    while len(out) < n:
        name = rng.choice(sorted(PRESETS))
        m = parse_model(name)
        devices = rng.choice((1, 2, 4, 8, 16, 64, 256, 1024, 4096))
        sizes = factor(devices, rng, AXES)
        if m.moe_layers == 0:
            sizes["data"] *= sizes["expert"]
            sizes["expert"] = 1
        options = draw_options(sizes, m.units, rng, CHOICES)
        soft = SOFTWARE["jaxpar" if rng.random() < 0.4 else rng.choice(software)]
        if soft.jaxpar_program:   # the precisions jaxpar's program trains in
            options["dtype"], options["grad_dtype"] = rng.choice(("float32", "bfloat16")), "float32"
        try:
            st = Strategy(name="case", mesh=tuple((a, sizes[a]) for a in AXES), options=make_options(options, "case"))
            dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
            per = st.options.grad_accum * (st.options.microbatches if sizes["pipeline"] > 1 else 1)
            batch = dp * per * rng.choice((1, 2, 4, 8))
            seq = min(m.max_seq, rng.choice((256, 1024, 2048, 4096, 8192, 32768)))
            validate.check(m, st, batch=batch, seq=seq, padded_zero=True, program=soft.jaxpar_program)
            check_modelled_layout(m, st)
            if refusal(st, soft):
                continue
        except (ConfigError, ZeroDivisionError, ValueError):
            continue
        out.append({"model": name, "mesh": sizes, "options": options, "hardware": rng.choice(hardware),
                    "software": soft.name, "batch": batch, "seq": seq,
                    "imbalance": rng.choice((1.0, 1.0, 1.3)), "headroom": rng.choice((0.0, 0.08))})
    return out


def inference_cases(n: int, seed: int) -> list[dict]:
    from jaxpar.core.strategy import AXES
    from jaxpar.cost.hardware import known_profiles
    from jaxpar.cost.software import SOFTWARE
    from jaxpar.models.config import PRESETS

    rng, out = random.Random(seed + 1), []
    for _ in range(n):
        sizes = factor(rng.choice((1, 2, 8, 16, 64)), rng, ("data", "context", "expert", "tensor"))
        sizes = {a: sizes.get(a, 1) for a in AXES}
        out.append({"model": rng.choice(sorted(PRESETS)), "mesh": sizes, "hardware": rng.choice(sorted(known_profiles())),
                    "software": rng.choice(sorted(SOFTWARE)), "batch": sizes["data"] * sizes["expert"] * rng.choice((1, 4, 32)),
                    "prompt": rng.choice((16, 128, 1024)), "generate": rng.choice((1, 16, 256)),
                    "phase": rng.choice(("prefill", "decode")),
                    "options": {"dtype": rng.choice(("bfloat16", "float32")),
                                "cp_layout": rng.choice(("contiguous", "zigzag")),
                                "attention": "ring" if sizes["context"] > 1 else "dense",
                                "moe_kernel": rng.choice(("grouped", "padded"))}})
    return out


PLANS = [("llama3-8b", "h100-sxm", 8, 4096, 256, "jaxpar"), ("llama3-8b", "h100-sxm", 64, 8192, 512, "megatron-core"),
         ("llama3-70b", "h100-sxm", 64, 4096, 256, "torchtitan"), ("mixtral-8x7b", "h100-sxm", 64, 4096, 256, "jaxpar"),
         ("mamba2-2.7b", "a100-80gb", 16, 2048, 256, "jaxpar"), ("llama3-8b", "tpu-v5p", 64, 4096, 256, "maxtext"),
         ("llama-tiny", "h100-sxm", 8, 256, 64, "jaxpar"), ("hybrid-tiny", "tpu-v5e", 16, 256, 64, "jaxpar"),
         ("qwen3-30b-a3b", "b200", 64, 4096, 512, "megatron-core"), ("llama3-70b", "a100-80gb", 256, 4096, 1024, "llm-foundry"),
         ("jamba-tiny", "h100-sxm", 8, 256, 32, "jaxpar"), ("llama3-405b", "h100-sxm", 1024, 8192, 2048, "megatron-lm")]


def flatten(value, prefix: str = "") -> dict[str, object]:
    """Every leaf of a JSON value by its path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def answer(fn) -> object:
    """`fn()`'s JSON value, or the error it raises as text."""
    try:
        return fn()
    except Exception as e:   # the same error in both trees is the same answer
        return f"error {type(e).__name__}: {e}"


def emit(args) -> None:
    """Evaluate the cases in the tree this process imports jaxpar from; write {case: value} JSON."""
    from jaxpar.core.strategy import AXES, Strategy, make_options
    from jaxpar.cost import comm, shape
    from jaxpar.cost.estimate import estimate
    from jaxpar.cost.inference import inference_estimate
    from jaxpar.cost.software import SOFTWARE
    from jaxpar.models.config import parse_model
    from jaxpar.planning.planner import plan

    cases = json.loads(pathlib.Path(args.cases).read_text())
    out = {}
    for i, c in enumerate(cases["train"]):
        m, soft = parse_model(c["model"]), SOFTWARE[c["software"]]
        st = Strategy(name="case", mesh=tuple((a, c["mesh"][a]) for a in AXES), options=make_options(c["options"], "case"))

        def train():
            e = estimate(m, st, c["hardware"], c["batch"], c["seq"], soft, imbalance=c["imbalance"], headroom=c["headroom"])
            sh = shape.step_shape(m, st, c["batch"], c["seq"])
            colls = {cc: {f"{r.kind} {','.join(r.axes)} {r.phase}": [r.count, r.bytes, r.wire_bytes]
                          for r in comm.collectives(m, st, sh, soft, cc)} for cc in COMPILER_NAMES}
            out = e.to_json()
            out["collectives"] = {f"{c['kind']} {','.join(c['axes'])} {c['phase']}": c for c in out["collectives"]}
            return {"estimate": out, "collectives": colls, "fits": e.fits, "mfu": e.mfu}
        out[f"train{i}"] = answer(train)
    for i, c in enumerate(cases["inference"]):
        m, soft = parse_model(c["model"]), SOFTWARE[c["software"]]
        st = Strategy(name="case", mesh=tuple((a, c["mesh"][a]) for a in AXES), options=make_options(c["options"], "case"))
        def infer(cc):
            if "request" in inspect.signature(inference_estimate).parameters:   # a tree with the Request record
                from jaxpar.cost.inference import Request   # noqa: PLC0415 (only trees that have it)
                est = inference_estimate(m, st, c["hardware"], Request(c["phase"], c["batch"], c["prompt"], c["generate"]),
                                         soft, cc)
            else:
                est = inference_estimate(m, st, c["hardware"], c["batch"], c["prompt"], c["generate"], c["phase"], soft, cc)
            out = est.to_json()
            out["collectives"] = {f"{c['kind']} {','.join(c['axes'])}": c for c in out["collectives"]}
            return out
        out[f"inference{i}"] = {cc: answer(lambda: infer(cc)) for cc in ("gpu", "cpu")}
    for i, (model, hw, devices, seq, batch, software) in enumerate(PLANS[:args.plans]):
        def planned():
            best, considered, valid = plan(parse_model(model), hw, devices, seq, batch, top=10, software=SOFTWARE[software])
            return {"considered": considered, "valid": valid,
                    "plans": [[st.name, st.describe_options(), e.step_time_s, e.memory.total] for e, st in best]}
        out[f"plan{i}"] = answer(planned)
    pathlib.Path(args.out).write_text(json.dumps(out))


def worktree(rev: str) -> pathlib.Path:
    """A worktree of `rev` whose jaxpar package finds its own models/ and mesh_configs/ (the editable install
    maps them to this checkout's)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    path = pathlib.Path(tempfile.gettempdir()) / f"jaxpar-base-{sha[:12]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True, capture_output=True)
    for name in ("models", "mesh_configs"):
        link = path / "jaxpar" / name
        if not link.exists():
            link.symlink_to(path / name)
    return path


def run_tree(tree: pathlib.Path, cases: str, out: str, plans: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, __file__, "--emit", "--cases", cases, "--out", out, "--plans", str(plans)],
                   cwd=tree, env=env, check=True)
    return json.loads(pathlib.Path(out).read_text())


def relative(a, b) -> float:
    """The relative difference of two leaves (inf where they differ in kind or text)."""
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return 0.0 if a == b else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def coverage(cases: list[dict]) -> dict[str, collections.Counter]:
    count: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in cases:
        for key in ("software", "hardware", "model"):
            count[key][c[key]] += 1
        for key, value in c["options"].items():
            count[key][str(value)] += 1
    return count


def compare(args) -> int:
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        cases = {"train": training_cases(args.train, args.seed), "inference": inference_cases(args.inference, args.seed)}
        path = pathlib.Path(tmp) / "cases.json"
        path.write_text(json.dumps(cases))
        here = run_tree(ROOT, str(path), str(pathlib.Path(tmp) / "here.json"), args.plans)
        base = run_tree(worktree(args.base), str(path), str(pathlib.Path(tmp) / "base.json"), args.plans)
    for kind in ("train", "inference"):
        print(f"{kind}: {len(cases[kind])} cases")
        for key, counter in sorted(coverage(cases[kind]).items()):
            print(f"  {key}: " + ", ".join(f"{v} {n}" for v, n in sorted(counter.items())))
    print(f"compilers: {', '.join(COMPILER_NAMES)} on every training case; plans: {args.plans}")
    worst, where, errors, differing = 0.0, "", 0, []
    for case in base:
        a, b = flatten(base[case]), flatten(here.get(case))
        errors += isinstance(base[case], str)
        keys = [key for key in sorted(set(a) | set(b)) if relative(a.get(key), b.get(key)) > args.tolerance]
        if keys:
            differing.append(case)
        for key in keys[:args.show]:
            print(f"  {case}{key}: base {a.get(key)!r}, here {b.get(key)!r}")
        for key in keys:
            d = relative(a.get(key), b.get(key))
            if d > worst:
                worst, where = d, f"{case}{key}: base {a.get(key)!r}, here {b.get(key)!r}"
    if differing:
        print(f"{len(differing)} cases differ: {' '.join(differing[:40])}")
        for case in differing[:args.show]:
            kind, i = case.rstrip("0123456789"), int(case.lstrip("traininferencplan"))
            if kind in cases:
                print(f"  {case}: {json.dumps(cases[kind][i])}")
    print(f"cases answered with an error in the base tree (compared as text): {errors}")
    print(f"largest relative difference: {worst:.3g}" + (f" at {where}" if worst else ""))
    return 0 if worst <= args.tolerance else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the commit to compare with")
    p.add_argument("--train", type=int, default=5000)
    p.add_argument("--inference", type=int, default=200)
    p.add_argument("--plans", type=int, default=len(PLANS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-12)
    p.add_argument("--show", type=int, default=0, help="print this many differing figures per case, and cases")
    p.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.emit:
        emit(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
