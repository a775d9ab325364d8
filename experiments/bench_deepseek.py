"""DeepSeek's model on 8 devices: multi-head latent attention against GQA of the same heads, training and decoding.

    python experiments/bench_deepseek.py [--steps 3] [--batch 32] [--seq 128] [--out DIR]
    python experiments/bench_deepseek.py --quick      # smoke test: a few seconds

Two models of equal width: `deepseek-tiny` (latent attention: a 16-value K/V latent and a 4-value RoPE key,
4 heads of q/k 12 and v 8; a dense first layer, then 3 MoE layers of 8 routed experts and a shared one,
group-limited sigmoid routing) and the same with GQA (kv_lora_rank 0: K and V projected straight to the 4
heads of 12). For each:
    training under ep8 (experts one per device): tokens/s (fastest of --steps after a compile step) and
        XLA's peak memory per device;
    decoding (jaxpar generate's decode step, data=8): the cache per token and layer (XLA's memory
        analysis of the cache arrays, against the hand count: kv_lora_rank + qk_rope_head_dim values for
        latent attention, 2 x heads x head_dim for GQA) and the decode step's bytes accessed (XLA's cost
        analysis of the compiled step, at a cache of --cache slots), with latent attention's cache read
        absorbed and expanded (jaxpar/ops/latent_attention.py).
Prints the tables and writes them to experiments/results/bench_deepseek.md (or --out DIR). CPU figures:
simulated devices share this host's cores; the bytes are the layouts' own.

--quick: batch 16 x seq 32, 1 timed step, a 64-slot cache, XLA's backend optimisations off.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from _bench import compiled_step  # noqa: E402 (experiments/_bench.py)
from jaxpar.core.strategy import parse_strategy  # noqa: E402
from jaxpar.models import decode  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.models.lm import LM  # noqa: E402
from jaxpar.models.run import RunConfig  # noqa: E402
from jaxpar.ops.latent_attention import absorbed_read, expanded_read  # noqa: E402

MODELS = {"latent attention": "deepseek-tiny", "GQA": "deepseek-tiny:kv_lora_rank=0"}
RESULTS = ROOT / "experiments" / "results"


def training(model: str, batch: int, seq: int, steps: int) -> dict:
    r = compiled_step(model, parse_strategy("expert=8"), batch, seq, steps)
    mem = r["memory"]
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return {"tokens_per_s": r["tokens"] / r["step_s"], "peak": peak}


def decode_step(model: str, read, batch: int, slots: int) -> dict:
    """The decode step of one token per sequence over a cache of `slots`, compiled on one device: XLA's
    bytes accessed, and the cache's bytes per token and layer (XLA's memory analysis of the cache)."""
    cfg = parse_model(model)
    run = RunConfig(mla_decode=read)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: LM(cfg, run, rngs=nnx.Rngs(0))))
    layout = decode.cache_layout(cfg, run, batch, slots)
    cache = jax.eval_shape(lambda: decode.init_cache(layout))

    def step(params, cache, token, position):
        return decode.forward(nnx.merge(graphdef, params), token, position, cache, slots - 1, prefill=False)
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    compiled = jax.jit(step).lower(params, cache, token, token).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    held = jax.jit(lambda: decode.init_cache(layout)["runs"]).lower().compile().memory_analysis().output_size_in_bytes
    attention_layers = cfg.attention_layers + cfg.moe_layers
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) if cfg.mla else 2 * cfg.kv_heads * cfg.head_dim
    return {"bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "cache_per_token_layer": held / (batch * slots * attention_layers), "hand_count": per_token * 4}


def markdown(train: dict, dec: list[tuple], args) -> str:
    lines = ["# DeepSeek-tiny: latent attention vs GQA of the same heads", "",
             f"Training under ep8, batch {args.batch} x seq {args.seq}, 8 simulated CPU devices.", "",
             "| attention | tokens/s | peak MiB/device |", "|---|---|---|"]
    lines += [f"| {name} | {r['tokens_per_s']:,.0f} | {r['peak'] / 2**20:.2f} |" for name, r in train.items()]
    lines += ["", f"Decoding one token per sequence, batch {args.batch}, a cache of {args.cache} slots, one device.", "",
              "| attention | cache read | cache B per token and layer | hand count B | decode step bytes accessed |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {read} | {r['cache_per_token_layer']:.0f} | {r['hand_count']} | {r['bytes_accessed']:,.0f} |"
              for name, read, r in dec]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--cache", type=int, default=1024)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.batch, args.seq, args.steps, args.cache = 16, 32, 1, 64
    train = {name: training(model, args.batch, args.seq, args.steps) for name, model in MODELS.items()}
    dec = [("latent attention", "absorbed", decode_step(MODELS["latent attention"], absorbed_read, args.batch, args.cache)),
           ("latent attention", "expanded", decode_step(MODELS["latent attention"], expanded_read, args.batch, args.cache)),
           ("GQA", "K/V", decode_step(MODELS["GQA"], absorbed_read, args.batch, args.cache))]
    text = markdown(train, dec, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_deepseek.md").write_text(text)
    plot(dec, args.out / "bench_deepseek.png")
    print(f"written to {args.out / 'bench_deepseek.md'} and bench_deepseek.png")


def plot(dec: list[tuple], path: pathlib.Path) -> None:
    """PNG: the cache per token and layer, and the decode step's bytes accessed, of each way to attend."""
    import matplotlib  # noqa: PLC0415 (deferred: only a run that draws needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [f"{name}\n{read}" for name, read, _ in dec]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.bar(names, [r["cache_per_token_layer"] for *_, r in dec], color="#0072B2")
    ax1.set_ylabel("cache bytes per token and layer")
    ax2.bar(names, [r["bytes_accessed"] / 2**20 for *_, r in dec], color="#E69F00")
    ax2.set_ylabel("decode step: MiB accessed (XLA)")
    fig.suptitle("deepseek-tiny decoding: the latent cache against GQA's K/V")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
