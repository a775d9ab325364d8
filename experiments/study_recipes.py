"""Study (j), the decision procedure: which layout to rent for a model, a cluster and a sequence, beside the
published recipe nearest to it.

    python experiments/study_recipes.py           # full: 5 models x 8..16,384 H100 x 8k and 128k, ~2 min
    python experiments/study_recipes.py --quick   # 70B and 405B on 64 GPUs (NeMo's 70B recipe), seconds

Question. For Llama 3 8B / 70B / 405B, Mixtral 8x7B and a Mamba-2 hybrid of 8B shape, on 8 to 16,384 H100 at
8k and 128k tokens: which layout, how its memory splits per device (weights, gradients, optimizer state,
activations), what MFU to expect and with what band, and how it compares with the published recipe at that
scale or the nearest one (Llama 3, NeMo / Megatron-Core, torchtitan).

Method. Each row searches the planner's candidates (experiments/_study.py `search`: data or fsdp, pipeline
<= 16, context <= 16, tensor <= 8 inside the NVLink node, with remat, accumulation, ZeRO, micro-batches and
schedules) under the stack's preset (megatron-core unless the row's recipe ran on another stack), ranked
by the cost model's tokens/s. Where a published recipe exists at that model, GPU count and sequence, its own
mesh is priced too (its best options in the same search), and the row recommends the recipe unless the best
plan is predicted faster by more than the band, which the row then says: the recipe ran for months; the
model's claim to beat it is worth no more than the model's error on published runs (the band: the
out-of-sample median of jaxpar/cost/bands.toml for the stack on H100; a claim beyond the band's worst is
flagged as the model's, not a recommendation).

Tokens per step: 16M (2,048 sequences of 8k, 128 of 128k), the batch Llama 3 405B trained with (Dubey et
al. 2024, section 3.4.1), on every row without a recipe; a recipe's row uses the recipe's own batch (its
batch decides which layouts exist: the batch wall). MFU: 6 N + attention FLOPs counted causal (half the
s x s scores, what a causal fused kernel computes) over 989 TFLOP/s dense bf16 (jaxpar.cost prints the
convention with every estimate). bf16 everywhere: the float8 recipes (NeMo 24.07) are priced in bf16 too,
so that layouts are compared, not precisions.
"""
from __future__ import annotations

import dataclasses

from _study import OKABE_ITO, arguments, band, band_line, finish, layout, md_table, options, pct, progress, search

from jaxpar.core.strategy import AXES, Strategy
from jaxpar.cost import SOFTWARE, estimate, load_hardware
from jaxpar.errors import ConfigError
from jaxpar.planning import planner
from jaxpar.cost.band import band_for
from jaxpar.models.config import parse_model

STEM = "study_recipes"
HARDWARE = "h100-sxm"
TOKENS = 2 ** 24
# NVIDIA's Mamba-2-Hybrid 8B shape (Waleffe et al. 2024, "An Empirical Study of Mamba-based Language Models",
# table 1: d_model 4096, 8 B/C groups, state 128, GQA 32/8 heads) with one attention block in seven
HYBRID = ("hybrid-tiny:pattern=MMMMMMA,layers=56,d_model=4096,heads=32,kv_heads=8,head_dim=128,mlp_dim=14336,"
          "vocab=128256,max_seq=131072,d_state=128,d_conv=4,expand=2,ssm_head_dim=64,ngroups=8,chunk=256")
# (label, model at 8k, model at 128k or None)
MODELS = (("Llama 3 8B", "llama3-8b", "llama3.1-8b"), ("Llama 3 70B", "llama3-70b", "llama3.1-70b"),
          ("Llama 3 405B", "llama3-405b", "llama3.1-405b"), ("Mixtral 8x7B", "mixtral-8x7b", None),
          ("Mamba-2 hybrid 8B", HYBRID, HYBRID))
DEVICES = (8, 64, 512, 4096, 16384)
SEQS = (8192, 131072)


@dataclasses.dataclass(frozen=True)
class Recipe:
    model: str          # label, as in MODELS
    devices: int
    seq: int
    batch: int          # sequences per step
    mesh: dict
    stack: str          # megatron-core or torchtitan
    source: str
    published_mfu: float | None = None   # bf16 runs only (the float8 ones are not comparable with a bf16 price)


RECIPES = (
    Recipe("Llama 3 8B", 8, 8192, 128, dict(context=2, data=4), "megatron-core",
           "NeMo 24.07 (Megatron-Core) H100: TP1 PP1 CP2, 128 x 8k"),
    Recipe("Llama 3 70B", 64, 8192, 128, dict(tensor=4, pipeline=4, context=2, data=2), "megatron-core",
           "NeMo 24.07 (Megatron-Core) H100: TP4 PP4 CP2 VP5, 128 x 8k"),
    Recipe("Llama 3 70B", 256, 8192, 512, dict(tensor=8, fsdp=32), "torchtitan",
           "torchtitan 2024 H100: FSDP32 TP8, 512 x 8k"),
    Recipe("Llama 3 405B", 512, 8192, 256, dict(tensor=8, pipeline=8, fsdp=8), "torchtitan",
           "torchtitan 2024 H100: FSDP8 TP8 PP8, 256 x 8k"),
    Recipe("Llama 3 405B", 8192, 8192, 2048, dict(tensor=8, pipeline=16, data=64), "megatron-core",
           "Llama 3 (Dubey et al. 2024, table 4): TP8 PP16 DP64, 2,048 x 8k", 430e12 / 989e12),
    Recipe("Llama 3 405B", 16384, 8192, 2048, dict(tensor=8, pipeline=16, data=128), "megatron-core",
           "Llama 3 (Dubey et al. 2024, table 4): TP8 PP16 DP128, 2,048 x 8k", 400e12 / 989e12),
    Recipe("Llama 3 405B", 16384, 131072, 128, dict(tensor=8, context=16, pipeline=16, data=8), "megatron-core",
           "Llama 3 (Dubey et al. 2024, table 4): TP8 CP16 PP16 DP8, 128 x 128k", 380e12 / 989e12),
    Recipe("Mixtral 8x7B", 64, 8192, 512, dict(pipeline=4, expert=8, data=2), "megatron-core",
           "NeMo mixtral_8x7b pretrain recipe (Megatron-Core): TP1 PP4 VP8 EP8, 512 x 8k"),
)
STACKS = {name: SOFTWARE[name] for name in ("megatron-core", "torchtitan")}
QUICK = dict(models="Llama 3 70B,Llama 3 405B", devices="64", seqs="8192")   # NeMo's 70B recipe; 405B fits nothing


def keep(sizes) -> bool:
    """The layouts practitioners run: no HSDP (data or fsdp), pipeline and context up to 16."""
    return (sizes["data"] == 1 or sizes["fsdp"] == 1) and sizes["pipeline"] <= 16 and sizes["context"] <= 16


def memory_split(est) -> str:
    m, g = est.memory, 2 ** 30
    return f"{m.params / g:.1f} / {m.grads / g:.1f} / {m.optimizer / g:.1f} / {m.activations / g:.1f}"


def mfu_band(est, share: float) -> str:
    return f"{pct(est.mfu)} ({pct(est.mfu * (1 - share))}-{pct(est.mfu * (1 + share))})"


def describe(est, st) -> str:
    """'TP8 PP16 DP64 ZeRO-1 (dots, interleaved 1F1B v=7 M=32)': the layout, its recompute and its schedule
    (the stacks run 1F1B, interleaved over v chunks per stage: Software.pp_1f1b)."""
    o = st.options
    if st.size("pipeline") == 1:
        return f"{layout(st)} ({o.remat})"
    sched = (o.pp_schedule if est.software == "jaxpar" else
             f"interleaved 1F1B v={o.pp_repeats}" if o.pp_repeats > 1 else "1F1B")
    return f"{layout(st)} ({o.remat}, {sched}{f' v={o.pp_repeats}' if est.software == 'jaxpar' else ''} M={o.microbatches})"


def nearest(label: str, devices: int, seq: int) -> Recipe | None:
    """The published recipe of the same model nearest in GPU count (then in sequence length)."""
    mine = [r for r in RECIPES if r.model == label]
    return min(mine, key=lambda r: (abs(r.devices - devices) / max(r.devices, devices), abs(r.seq - seq)),
               default=None)


def row(label: str, name: str, devices: int, seq: int) -> dict:
    """One table row: the best plan, the recipe at this scale (if any) priced in its own mesh, the verdict."""
    recipe = next((r for r in RECIPES if (r.model, r.devices, r.seq) == (label, devices, seq)), None)
    stack = STACKS[recipe.stack if recipe else "megatron-core"]
    batch = recipe.batch if recipe else TOKENS // seq
    hw, model = load_hardware(HARDWARE), parse_model(name)
    share = band(HARDWARE, stack.name)
    found = search(model, hw, devices, seq, batch, stack, keep=keep)
    best = found.get(0)
    out = dict(label=label, devices=devices, seq=seq, batch=batch, stack=stack.name, share=share, best=best,
               recipe=recipe, own=None, verdict="", chosen=best)
    if recipe is not None:
        own = own_layout(model, hw, devices, seq, batch, stack, {a: recipe.mesh.get(a, 1) for a in AXES})
        out["own"] = own
        out["chosen"], out["verdict"] = verdict(best, own, band_for(hw.family, stack.name))
    return out


def own_layout(model, hw, devices: int, seq: int, batch: int, stack, sizes: dict):
    """The recipe's own mesh at its fastest fitting options: the stack's candidates (`options`: its
    schedules, the recipes' interleaved 1F1B among them), each also with selective recompute (the attention
    core recomputed: Korthikanti et al. 2022, what Megatron-Core's recipes turn on when memory is tight) and
    with every matmul output kept (`dots`), where the stack's own policies leave them out."""
    best = None
    mesh = tuple((a, sizes[a]) for a in AXES)
    for o in options(sizes, batch, model.units, stack):
        for opts in [dataclasses.replace(o, remat=r) for r in dict.fromkeys((o.remat, "selective", "dots"))]:
            st = Strategy(name="recipe", mesh=mesh, options=opts)
            try:
                planner.check_plannable(model, st, batch, seq, stack.jaxpar_program)
            except ConfigError:
                continue
            est = estimate(model, st, hw, batch, seq, stack)
            if est.fits and (best is None or est.tokens_per_s > best[0].tokens_per_s):
                best = (est, st)
    return best


def verdict(best, own, b) -> tuple:
    """(the recommended (estimate, strategy), why): the recipe unless the best plan beats it by more than the
    band; a plan beyond the band's worst is the model's claim, not a recommendation."""
    if own is None:
        return best, "the recipe's mesh does not fit the model's memory estimate: the model cannot price it"
    gain = best[0].tokens_per_s / own[0].tokens_per_s - 1
    if gain <= b.guide():
        return own, f"the recipe: the best plan ({describe(*best)}) is a tie ({gain:+.1%}, band ±{b.guide():.1%})"
    worst = b.oos_worst if b.oos_worst is not None else b.worst
    if gain <= worst:
        return own, (f"the recipe: the best plan ({describe(*best)}) is predicted {gain:+.1%}, beyond the median "
                     f"band but inside the model's worst miss ({worst:.0%})")
    return own, (f"the recipe: the model predicts {describe(*best)} {gain:+.1%} faster, beyond its worst miss "
                 f"({worst:.0%}): a claim of the model, not a recommendation (see the notes)")


def difference(r: dict) -> str:
    """The nearest published recipe, and where it is elsewhere how the recommendation differs and why."""
    near = nearest(r["label"], r["devices"], r["seq"])
    if near is None:
        return "no published recipe for this model in the reference data"
    if r["recipe"] is not None:
        return near.source
    if r["chosen"] is None:
        return f"{near.source} (nothing fits here)"
    return f"{near.source}; here {layout(r['chosen'][1])}: {'; '.join(reasons(r, near)) or 'the same axes'}"


def reasons(r: dict, near: Recipe) -> list[str]:
    """Why the recommended layout differs from the recipe's: the longer sequence (context), the batch wall
    (more GPUs than sequences per step: data ranks cannot take them all), or the state sharded over data
    ranks (fsdp) where the recipe splits the layers (tensor, pipeline)."""
    st, out = r["chosen"][1], []
    mine, theirs = st.sizes, {a: near.mesh.get(a, 1) for a in AXES}
    if r["seq"] > near.seq and mine["context"] > theirs["context"]:
        out.append(f"CP{mine['context']} for {r['seq'] // 1024}k-token sequences")
    if r["devices"] > r["batch"]:
        out.append(f"the batch wall: {r['batch']:,} sequences for {r['devices']:,} GPUs need "
                   f"{r['devices'] // r['batch']}-way model parallelism at least")
    split = mine["tensor"] * mine["pipeline"] < theirs["tensor"] * theirs["pipeline"]
    if mine["fsdp"] > 1 and split:
        out.append(f"FSDP over {mine['fsdp']} ranks holds the state, so fewer layers are split than in the recipe")
    if r["devices"] != near.devices:
        out.append(f"{r['devices'] / near.devices:g}x the recipe's {near.devices:,} GPUs")
    return out


def cells(r: dict) -> list:
    chosen = r["chosen"]
    head = [r["label"], f"{r['devices']:,}", f"{r['seq'] // 1024}k", f"{r['batch'] * r['seq'] / 2**20:.0f}M",
            r["stack"]]
    if chosen is None:
        return head + ["nothing fits", "-", "-", "-", difference(r)]
    est, st = chosen
    who = "recipe" if r["recipe"] is not None else "plan"
    return head + [f"{describe(est, st)} [{who}]", memory_split(est), mfu_band(est, r["share"]),
                   r["verdict"] or "-", difference(r)]


def rows(args) -> list[dict]:
    wanted = [m for m in MODELS if m[0] in args.models.split(",")]
    devices = [int(d) for d in args.devices.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    grid = [(label, name, n, s) for label, short, long in wanted for s in seqs
            for name in [short if s <= 8192 else long] if name for n in devices]
    grid += [(r.model, next(m for m in MODELS if m[0] == r.model)[1 if r.seq <= 8192 else 2], r.devices, r.seq)
             for r in RECIPES if r.model in {m[0] for m in wanted} and r.seq in seqs
             and (r.devices in devices or not args.quick)]
    grid = sorted(set(grid), key=lambda g: ([m[0] for m in MODELS].index(g[0]), g[3], g[2]))
    out = []
    with progress(len(grid), "row") as bar:
        for g in grid:
            out.append(row(*g))
            bar.update()
    return out


def body(results: list[dict]) -> list[str]:
    lines = [band_line(HARDWARE, "megatron-core"), band_line(HARDWARE, "torchtitan"), "",
             "Tokens per step: 16M on rows without a recipe (Llama 3 405B's batch, Dubey et al. 2024), the "
             "recipe's own batch on a recipe's row. MFU: 6N + attention counted causal, over 989 TFLOP/s bf16; "
             "the band in brackets is the stack's out-of-sample median error.", "",
             "## Recommended layouts", "",
             *md_table(["model", "GPUs", "seq", "tokens/step", "stack", "recommended layout",
                        "memory GiB/GPU (weights / grads / optimizer / activations)", "predicted MFU (band)",
                        "against the recipe at this scale", "nearest published recipe"],
                       [cells(r) for r in results]), "",
             "## Published recipes priced in their own layouts", "",
             *md_table(["recipe", "stack", "published MFU", "recipe's prediction", "best plan",
                        "best plan's prediction", "gain", "band (median / worst)"], recipe_rows(results)), "",
             "Notes on where the model and the recipes part (the recipes keep the recommendation):", "",
             "- Llama 3 405B's TP8 PP16 layouts: under 1F1B the first of 16 stages holds 16 micro-batches of "
             "activations, which with the state exceed the HBM unless recompute trims them, so the model prices the "
             "recipe with every matmul output kept and the rest recomputed (dots), below the published MFU; what "
             "Llama 3 did to fit beyond rebalancing the first and last stages (Dubey et al. 2024, section 3.3.2) "
             "the model does not know.",
             "- Mixtral's NeMo recipe (EP8 PP4): the model hides TP8's traffic for the experts under megatron-core's "
             "calibrated overlap, fitted on dense models; with it exposed EP8 leads (study (h, MoE)).", "",
             "Published MFU: Llama 3's bf16 runs (Dubey et al. 2024, table 4: 430, 400 and 380 TFLOP/s per GPU, "
             "its attention convention not stated); the NeMo and torchtitan recipes ran in float8, not comparable "
             "with a bf16 price ('-')."]
    return lines


def recipe_rows(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        if r["recipe"] is None:
            continue
        b = band_for(load_hardware(HARDWARE).family, r["stack"])
        own, best = r["own"], r["best"]
        gain = f"{best[0].tokens_per_s / own[0].tokens_per_s - 1:+.1%}" if own and best else "-"
        pub = r["recipe"].published_mfu
        out.append([r["recipe"].source, r["stack"], pct(pub) if pub else "-",
                    mfu_band(own[0], r["share"]) if own else "does not fit",
                    describe(*best) if best else "-", pct(best[0].mfu) if best else "-", gain,
                    f"{b.guide():.1%} / {b.oos_worst if b.oos_worst is not None else b.worst:.1%}"])
    return out


def figure(results: list[dict]):
    """Per sequence length: the recommended plan's MFU with its band over GPUs (16M-token rows), and each
    published recipe's layout as the model prices it (star) beside its published MFU (cross) where known."""
    def draw(plt):
        labels = [m[0] for m in MODELS if any(r["label"] == m[0] for r in results)]
        fig, axes = plt.subplots(1, len(SEQS), figsize=(11, 4.2), sharey=True)
        for ax, seq in zip(axes, SEQS):
            for i, label in enumerate(labels):
                colour = OKABE_ITO[i % len(OKABE_ITO)]
                pts = [r for r in results if r["label"] == label and r["seq"] == seq and r["chosen"]
                       and r["recipe"] is None]
                if pts:
                    ax.errorbar([r["devices"] for r in pts], [100 * r["chosen"][0].mfu for r in pts],
                                yerr=[100 * r["chosen"][0].mfu * r["share"] for r in pts], marker="o",
                                color=colour, capsize=3, label=label)
                for r in results:
                    if r["label"] == label and r["seq"] == seq and r["recipe"] is not None and r["own"]:
                        ax.scatter([r["devices"]], [100 * r["own"][0].mfu], marker="*", s=150, color=colour,
                                   edgecolor="black", zorder=5)
                        if r["recipe"].published_mfu:
                            ax.scatter([r["devices"]], [100 * r["recipe"].published_mfu], marker="X", s=70,
                                       color=colour, edgecolor="black", zorder=5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(DEVICES, [f"{d:,}" for d in DEVICES])
            ax.set_xlabel("H100 GPUs")
            ax.set_title(f"{seq // 1024}k tokens per sequence")
        axes[0].set_ylabel("MFU, % (bars: the stack's out-of-sample band)")
        axes[0].scatter([], [], marker="*", s=150, color="grey", edgecolor="black",
                        label="a published recipe's layout, as the model prices it")
        axes[0].scatter([], [], marker="X", s=70, color="grey", edgecolor="black", label="its published MFU")
        axes[0].legend(fontsize=7, loc="lower left")
        fig.suptitle("Recommended layouts (study j): the best plan per cluster at 16M tokens per step; "
                     "published recipes at their own batch", fontsize=9)
        fig.tight_layout()
        return fig
    return draw


def main() -> None:
    args = arguments(__doc__, QUICK, models=(str, ",".join(m[0] for m in MODELS), "comma-separated model labels"),
                     devices=(str, ",".join(map(str, DEVICES)), "comma-separated GPU counts"),
                     seqs=(str, ",".join(map(str, SEQS)), "comma-separated sequence lengths"))
    results = rows(args)
    for r in results:
        print(" | ".join(str(c) for c in cells(r)))
    finish(args, STEM, "Study (j): recommended layouts beside the published recipes", body(results), figure(results))


if __name__ == "__main__":
    main()
