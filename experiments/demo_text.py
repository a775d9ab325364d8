"""Train llama-tiny on real text, the Python standard library's own source files, on 8 simulated CPU devices.

    python experiments/demo_text.py            # the `make demo-text` run (a few minutes on 2 cores)
    python experiments/demo_text.py --quick    # smoke test: fewer files and steps

1. `jaxpar data`'s preparation (jaxpar/training/corpus.py) of --files .py files of this Python's standard
   library (`sysconfig.get_paths()["stdlib"]`, every machine has them): a byte-level BPE of --vocab ids
   trained on them, 5% of the files held out, packed shards and a manifest; its tokens/s.
2. The loader (jaxpar/training/loader.py, Grain) alone: tokens/s of one process reading every row of
   the global batch (with packing), beside the training step's tokens/s below.
3. Training from the same parameters on the same batches: 1 device, then each strategy on 8 devices;
   each strategy's losses must equal the 1-device run's (float32 rounding), and the held-out loss
   (eval every --eval-every steps on the validation split) must fall.
4. A greedy continuation of a text prompt by the trained model (fsdp8's parameters, served under tp8), decoded.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import sysconfig
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.serving.generate import Generator, Sampling  # noqa: E402
from jaxpar.training import corpus, loader  # noqa: E402
from jaxpar.training import tokenizer as tokenizers  # noqa: E402
from jaxpar.training.data import local_batch  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer, gather, train  # noqa: E402

MESHES = ["fsdp8", "dp2-tp4", "dp2-fsdp2-tp2"]
QUICK = dict(files=40, steps=12, eval_every=6, meshes=["fsdp8"])
PROMPT = "def __init__(self"


def stdlib_files(count: int) -> list[str]:
    """The first `count` top-level .py files of the standard library, by name (the same on every run)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(root.glob("*.py"))[:count]]


def loader_tokens_per_s(source, tc: TrainConfig, steps: int = 20) -> float:
    """Tokens/s of one process reading every row of `steps` global batches (what a 1-process run reads)."""
    t0 = time.perf_counter()
    for step in range(steps):
        local_batch(source, step, range(tc.batch), tc.seq)
    return steps * tc.batch * tc.seq / (time.perf_counter() - t0)


def run(model, mesh: str, devices: int, tc: TrainConfig, params, data: loader.Dataset, eval_every: int) -> dict:
    """Train from `params` on the train split; evaluate on 4 batches of the validation split."""
    trainer = Trainer(model, parse_strategy(mesh), tc, devices=jax.devices()[:devices])
    source = loader.PreparedSource(data, "train", tc.seed, tc.batch)
    held = loader.PreparedSource(data, "val", 0, tc.batch, shuffle=False)
    rows: list[dict] = []

    def evaluate(step, state):
        return trainer.evaluate(state, held, 4) if step == 1 or step % eval_every == 0 else {}

    state = train(trainer, source, state=trainer.state_from_params(params), on_step=lambda s, m: rows.append(m),
                  evaluate=evaluate)
    step_time = statistics.median(r["step_time_s"] for r in rows[2:] or rows)
    return {"name": mesh if devices > 1 else "1 device", "mesh": trainer.strategy.describe(),
            "losses": [r["loss"] for r in rows], "evals": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
            "tokens_per_s": tc.batch * tc.seq / step_time, "state": state}


def continuation(model, params, tok: tokenizers.Tokenizer, new_tokens: int) -> str:
    gen = Generator(model, parse_strategy("tp8"), [tok.encode(PROMPT)], new_tokens, Sampling())
    gen.compile()
    result = gen.generate(gen.place_params(params), [tok.encode(PROMPT)])
    return tok.decode(result.tokens[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--files", type=int, default=200, help="standard-library .py files to train on")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--meshes", nargs="+", default=MESHES)
    ap.add_argument("--quick", action="store_true", help="smoke test (see above)")
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    model = parse_model(f"llama-tiny:vocab={args.vocab}")
    tc = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, lr=3e-3, warmup=5)
    with tempfile.TemporaryDirectory() as tmp:
        files = stdlib_files(args.files)
        done = corpus.prepare(files, f"{tmp}/data", vocab=args.vocab, progress=False)
        m = done.manifest
        tokens = sum(s["tokens"] for s in m["splits"].values())
        print(f"jaxpar data: {len(files)} standard-library files -> {m['splits']['train']['documents']} train / "
              f"{m['splits']['val']['documents']} held-out documents, {tokens:,} tokens (vocab {m['vocab']}, "
              f"{m['dtype']}) in {done.seconds:.1f} s: {tokens / done.seconds:,.0f} tokens/s", flush=True)
        data = loader.Dataset(f"{tmp}/data", model.vocab)
        tok = tokenizers.load(f"{tmp}/data")
        loader_rate = loader_tokens_per_s(loader.PreparedSource(data, "train", tc.seed, tc.batch), tc)
        params = gather(Trainer(model, parse_strategy("data=1"), tc, devices=jax.devices()[:1]).init_state().params)
        results = []
        for mesh, devices in [("data=1", 1)] + [(m, 8) for m in args.meshes]:
            print(f"  training {mesh} on {devices} device(s) ...", flush=True)
            results.append(run(model, mesh, devices, tc, params, data, args.eval_every))
        report(results, loader_rate, tc)
        print(f"\ngreedy continuation of {PROMPT!r} by the fsdp8-trained model:")
        print(PROMPT + continuation(model, gather(results[1]["state"].params), tok, 24))


def report(results: list[dict], loader_rate: float, tc: TrainConfig) -> None:
    """The table, and the two claims checked: each strategy's losses equal the 1-device run's, and the
    held-out loss falls."""
    ref = results[0]
    print(f"\n{'strategy':<16}{'final loss':>12}{'max |loss - 1-device|':>24}{'step tokens/s':>15}   "
          "held-out loss (at step)")
    for r in results:
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        evals = "  ".join(f"{loss:.3f} ({step})" for step, loss in r["evals"])
        print(f"{r['name']:<16}{r['losses'][-1]:>12.5f}{diff:>24.2e}{r['tokens_per_s']:>15,.0f}   {evals}")
    print(f"\nloader: {loader_rate:,.0f} tokens/s per process (every row of a {tc.batch} x {tc.seq} batch, "
          f"packed), {loader_rate / ref['tokens_per_s']:.0f}x the 1-device step's {ref['tokens_per_s']:,.0f}")
    worst = max(max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) for r in results)
    first, last = ref["evals"][0][1], ref["evals"][-1][1]
    ok = worst < 1e-3 and last < first
    print(f"{'OK' if ok else 'FAILED'}: every strategy within {worst:.1e} of the 1-device losses; held-out loss "
          f"{first:.3f} -> {last:.3f}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
