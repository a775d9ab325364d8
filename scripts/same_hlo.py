"""Is the compiled program that of another commit? A refactoring's check of the models and kernels (`--base REV`).

Lowers the training step of every 8-device strategy in mesh_configs/ (each on the model the catalogue tests
run it on) and of the option variants that choose a kernel or an implementation (collective matmul,
selective and full remat, FSDP prefetch, the attention kernels, Mamba-2 under context parallelism, 1F1B,
the MoE kernels), and generation's prefill and decode steps, on 8 simulated CPU devices; hashes each
StableHLO text (`Lowered.as_text()`, no source locations; generation's compiled HLO, its op metadata and
source tables removed) in this tree and in a git worktree of REV, and prints which are byte-identical:
    python scripts/same_hlo.py --base HEAD~3
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from same_numbers import worktree  # noqa: E402  (the same worktree of REV)

VARIANTS = [  # (model, mesh, options): what the catalogue's defaults leave unexercised
    ("llama-tiny", "tp4-sp", {"overlap": "collective_matmul"}),
    ("llama-tiny", "tp4-sp", {"overlap": "collective_matmul_bidir", "remat": "full"}),
    ("llama-tiny", "dp2-fsdp2-tp2", {"remat": "selective"}),
    ("llama-tiny", "dp2-fsdp2-tp2", {"remat": "full"}),
    ("llama-tiny", "fsdp8", {"remat": "full", "fsdp_prefetch": True}),
    ("llama-tiny", "fsdp8", {"remat": "dots", "attention_kernel": "blockwise"}),
    ("llama-tiny", "cp8-ring", {"remat": "dots_no_batch"}),
    ("llama-tiny", "dp8", {"remat": "offload"}),
    ("hybrid-tiny", "dp2-cp4-zigzag", {}),
    ("hybrid-tiny", "fsdp4-tp2-sp", {"remat": "full"}),
    ("mamba2-tiny", "cp8-ring", {}),
    ("llama-tiny:layers=8", "pp4-dp2", {"pp_schedule": "1f1b", "microbatches": 4}),
    ("llama-tiny:layers=8", "pp2-tp2-dp2", {"pp_schedule": "1f1b", "pp_repeats": 2, "microbatches": 4}),
    ("moe-tiny", "ep8", {"moe_kernel": "padded"}),
    ("moe-tiny", "ep4-tp2", {"moe_kernel": "grouped", "remat": "full"}),
    ("moe-tiny:shared_experts=1", "fsdp2-ep4", {}),
    ("jamba-tiny", "dp2-ep4", {}),
]
GENERATE = [("llama-tiny", "infer-tp8"), ("llama-tiny", "infer-prefill-cp2-decode-tp4"),
            ("moe-tiny", "data=2,expert=2,tensor=2"), ("hybrid-tiny", "data=4,tensor=2")]
METADATA = re.compile(r", metadata=\{[^}]*\}")   # op names and source lines, which move with the code
DEBUG_TABLES = re.compile(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:\d+ [^\n]*\n)*")   # the same


def model_for(strategy) -> str:
    if strategy.size("expert") > 1:
        return "moe-tiny"
    return "llama-tiny:layers=8" if strategy.size("pipeline") > 1 else "llama-tiny"


def emit(out: str) -> None:
    """Hash every case's lowered StableHLO in the tree this process imports jaxpar from."""
    from jaxpar.devices import simulate_cpu_devices
    simulate_cpu_devices(8)
    import jax
    from jaxpar.core.strategy import catalogue, parse_strategy
    from jaxpar.models.config import parse_model
    from jaxpar.serving.generate import Generator
    from jaxpar.training.trainer import TrainConfig, Trainer

    seen, cases = set(), []
    for st in sorted(catalogue(), key=lambda s: s.name):
        if st.num_devices == 8 and (st.mesh, st.options) not in seen:
            seen.add((st.mesh, st.options))
            cases.append((model_for(st), st.name, {}))
    hashes = {}
    for model, mesh, options in cases + VARIANTS:
        key = f"train {model} {mesh} {json.dumps(options, sort_keys=True)}"
        try:
            st = parse_strategy(mesh).with_options(**options)
            tr = Trainer(parse_model(model), st, TrainConfig(batch=16, seq=32), devices=jax.devices()[:8])
            hashes[key] = hashlib.sha256(tr.lower_step().as_text().encode()).hexdigest()
        except Exception as e:   # the same refusal in both trees is the same answer
            hashes[key] = f"error {type(e).__name__}: {e}"
        print(key, hashes[key][:16], flush=True)
    for model, mesh in GENERATE:
        key = f"generate {model} {mesh}"
        try:
            gen = Generator(parse_model(model), parse_strategy(mesh), [[1, 2, 3, 4]] * 4, 4, devices=jax.devices()[:8])
            texts = (DEBUG_TABLES.sub("\n", METADATA.sub("", c.as_text())) for c in gen.compiled_steps())
            hashes[key] = "+".join(hashlib.sha256(t.encode()).hexdigest() for t in texts)
        except Exception as e:
            hashes[key] = f"error {type(e).__name__}: {e}"
        print(key, hashes[key][:16], flush=True)
    pathlib.Path(out).write_text(json.dumps(hashes, indent=1))


def run_tree(tree: pathlib.Path, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, __file__, "--emit", out], cwd=tree, env=env, check=True)
    return json.loads(pathlib.Path(out).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the commit to compare with")
    p.add_argument("--emit", metavar="FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.emit:
        emit(args.emit)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        here = run_tree(ROOT, f"{tmp}/here.json")
        base = run_tree(worktree(args.base), f"{tmp}/base.json")
    same = [k for k in base if here.get(k) == base[k]]
    differ = [k for k in base if k not in same]
    print(f"{len(same)} of {len(base)} lowered programs byte-identical to {args.base}"
          f" ({sum(1 for k in same if base[k].startswith('error'))} of them refused in both)")
    for k in differ:
        print(f"  differs: {k}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
