"""Study (d), blocks compared: GQA attention, the SwiGLU MLP and the Mamba-2 mixer under DP, TP, SP and CP.

    python experiments/study_blocks.py            # full: 8 compiles (2 models x 4 layouts), about a minute
    python experiments/study_blocks.py --quick    # 1 compile (llama-tiny under SP), the rest from the model

Question. What does each block cost (FLOPs, weights and bytes moved per device, forward and backward)
under each way of splitting it, and from which sequence length does the Mamba-2 mixer undercut attention?

Method. (1) Compiled (the results' appendix: jaxpar's own program on XLA:CPU): one training step of a 2-layer llama-tiny (GQA: 16 query, 8 KV heads) and of
mamba2-tiny on 8 simulated CPU devices under data=8 (DP), data=4 x tensor=2 (TP), the same with sequence
parallelism (SP) and data=2 x context=4 (CP; attention by all-gather). Each `dot` and each collective of the
compiled HLO is attributed to a block through the Python stack XLA keeps in its metadata (the
`StackFrames` table): under `Attention.__call__` -> attention, `MLP.__call__` -> MLP,
`MambaBlock.__call__` -> Mamba-2 (the sequence-parallel gathers before each norm, in
`AttentionBlock.attend`, go to the sub-block they feed). Beside each figure stands the analytic one:
FLOPs from jaxpar/cost/flops.py (forward x 3 for forward + backward, per device), weights from the
arrays' shardings vs jaxpar/cost/params.py, and the block's collectives from the Megatron f/g rules as
jaxpar/cost/comm.py applies them for XLA:CPU (`block_collectives` below splits its per-layer terms by
block). The gradient all-reduces over data (and context) stand apart, for the whole step: XLA
combines a layer's gradient reductions into one op, so no block owns them; they are compared per
layout with jaxpar/cost/comm.py's. (2) At scale, from the model (the guidance): llama3-8b's blocks
and a Mamba-2 mixer of the same width (d=4096, expand 2, d_state 128, head 64, 8 groups) at 8k tokens
per sequence on one 8-GPU H100 node, GPU traits (reduce-scatters, one backward all-reduce per
sub-block), DP and CP paying each block's float32 gradient all-reduce. (3) The crossover: forward FLOPs per token
of causal attention (its projections plus a fused kernel's half of the s x s scores) against the Mamba-2
mixer, and inference state per sequence (KV cache against the fixed SSM + conv state), as the context grows.
Writes experiments/results/study_blocks.md and .png.
"""
from __future__ import annotations

import inspect
import os
import pathlib
import re
import sys

if "--quick" in sys.argv[1:]:  # before JAX starts: XLA reads its flags once (compiles faster)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxpar.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _study import arguments, band_line, finish, md_table, progress  # noqa: E402

from jaxpar.analysis import comm as analysis_comm  # noqa: E402
from jaxpar.analysis.hlo_text import executed_instructions, parse_module  # noqa: E402
from jaxpar.analysis.patterns import one_dot_flops  # noqa: E402
from jaxpar.analysis.tally import collective_ops  # noqa: E402
from jaxpar.collectives import wire_factor  # noqa: E402
from jaxpar.cost import comm as cost_comm, flops  # noqa: E402
from jaxpar.cost.shape import step_shape  # noqa: E402
from jaxpar.cost.hardware import load_hardware  # noqa: E402
from jaxpar.cost.params import mamba_dims  # noqa: E402
from jaxpar.models.config import parse_model  # noqa: E402
from jaxpar.core.strategy import parse_inline  # noqa: E402
from jaxpar.training.trainer import TrainConfig, Trainer  # noqa: E402
from models import transformer  # noqa: E402

STEM = "study_blocks"
MODELS = {"attention": "llama-tiny", "mlp": "llama-tiny", "mamba2": "mamba2-tiny"}
LAYOUTS = {"DP": ("data=8", {}), "TP": ("data=4,tensor=2", {}),
           "SP": ("data=4,tensor=2", {"sequence_parallel": True}),
           "CP": ("data=2,context=4", {"attention": "allgather"})}
QUICK = [("llama-tiny", "SP")]
FRAMES = {"Attention.__call__": "attention", "MLP.__call__": "mlp", "MambaBlock.__call__": "mamba2"}
GRADIENT_AXES = {"data", "context"}
BIG_ATTN = "llama3-8b"
BIG_MAMBA = "mamba2-2.7b:d_model=4096,ngroups=8"
F32 = 4


# ---- reading the compiled step ----------------------------------------------------------------------

def _attend_lines() -> dict[int, str]:
    """Lines of AttentionBlock.attend / __call__ whose ops belong to one sub-block: the norms and the
    residual constraints (under SP: the gathers before each sub-block and the scatters after it)."""
    out = {}
    for fn in (transformer.AttentionBlock.attend, transformer.AttentionBlock.__call__):
        lines, start = inspect.getsourcelines(fn)
        out |= {(fn.__qualname__, start + i): ("attention" if "self.attn" in text else "mlp")
                for i, text in enumerate(lines) if re.search(r"self\.(attn|mlp)", text) and "def " not in text}
    return out


def stack_reader(hlo: str):
    """block(stack_frame_id) from the module's FunctionNames / FileLocations / StackFrames tables."""
    tables, current = {}, None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and re.match(r"\d+ ", line):
            key, rest = line.split(" ", 1)
            current[int(key)] = rest
        elif line.startswith(("%", "ENTRY")):
            break
    names = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {k: (int(re.search(r"function_name_id=(\d+)", v)[1]), int(re.search(r"\bline=(\d+)", v)[1]))
            for k, v in tables.get("FileLocations", {}).items()}
    frames = {k: (int(re.search(r"file_location_id=(\d+)", v)[1]), int(re.search(r"parent_frame_id=(\d+)", v)[1]))
              for k, v in tables.get("StackFrames", {}).items()}
    attend = _attend_lines()

    def block(frame: int) -> str:
        while frame in frames:  # parent_frame_id is the parent's id + 1 (0: none)
            loc, parent = frames[frame]
            fn, line = locs[loc]
            if names[fn] in FRAMES:
                return FRAMES[names[fn]]
            if (names[fn], line) in attend:
                return attend[(names[fn], line)]
            frame = parent - 1
        return "other"
    return block


def compiled_blocks(model: str, layout: str, batch: int, seq: int) -> dict:
    """Per block: dot FLOPs per device per step, non-gradient collective bytes per device per step (by
    kind and phase), and weight bytes per device from the arrays' shardings."""
    mesh, opts = LAYOUTS[layout]
    tr = Trainer(parse_model(model), parse_inline(mesh).with_options(**opts), TrainConfig(batch=batch, seq=seq))
    hlo = tr.lower_step().compile(analysis_comm.ANALYSIS_COMPILER_OPTIONS).as_text()
    block_of, module = stack_reader(hlo), parse_module(hlo)

    home = {i.name: comp for comp, instrs in module.computations.items() for i in instrs}
    fused_by = {callee: i for instrs in module.computations.values() for i in instrs
                for callee in re.findall(r"calls=%([\w.\-]+)", i.text)}

    named = {i.name: i for instrs in module.computations.values() for i in instrs}

    def owner(instr, depth: int = 0) -> str:
        """An op inside a fusion has no metadata: the fusion's then; a fusion without metadata (XLA:CPU's
        YNNPACK dot fusions): that of its first operand that has some (the producer of the dot's input)."""
        while not (m := re.search(r"stack_frame_id=(\d+)", instr.text)):
            caller = fused_by.get(home[instr.name])
            if caller is not None:
                instr = caller
                continue
            for name in instr.operands if depth < 6 else ():
                if name in named and (b := owner(named[name], depth + 1)) != "other":
                    return b
            return "other"
        return block_of(int(m[1]))
    shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
    out, by_name, grads = {}, {}, 0
    for instr, times, _ in executed_instructions(module):
        by_name[instr.name] = instr
        if instr.opcode == "dot" and times:
            b = out.setdefault(owner(instr), {"flops": 0.0, "comm": {}, "weights": 0})
            b["flops"] += times * one_dot_flops(instr, shapes)
    shape = tuple(tr.mesh.shape.values())
    for op in collective_ops(module, tr.mesh.axis_names, np.arange(int(np.prod(shape))).reshape(shape)):
        if gradient(op):
            grads += op.times * (op.bytes - op.scalar_bytes)
            continue  # gradient synchronisation: combined across blocks by XLA, counted for the whole step
        b = out.setdefault(owner(by_name[op.name]), {"flops": 0.0, "comm": {}, "weights": 0})
        key = (op.kind, "fwd" if op.phase == "forward" else "bwd")
        b["comm"][key] = b["comm"].get(key, 0) + op.times * (op.bytes - op.scalar_bytes)
    shardings = jax.tree.leaves(tr.param_shardings)
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(tr.abstract_params), shardings):
        keys = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        kind = ("mlp" if "/mlp/" in keys else "attention" if "/attn/" in keys else
                "mamba2" if tr.model_cfg.pattern == "M" and keys.startswith("runs/") and "/norm/" not in keys
                else None)
        if kind:
            local = sharding.shard_shape(leaf.shape)
            out.setdefault(kind, {"flops": 0.0, "comm": {}, "weights": 0})["weights"] += int(np.prod(local)) * leaf.dtype.itemsize
    return {"trainer": tr, "blocks": out, "grads": grads}


def gradient(op) -> bool:
    """A gradient reduction: a backward all-reduce over data and/or context only (compiled op or predicted)."""
    return op.kind == "all-reduce" and op.phase != "forward" and set(op.axes) <= GRADIENT_AXES


# ---- the analytic side --------------------------------------------------------------------------------

def block_flops(m, block: str, b_loc: float, seq: int, shards: int) -> float:
    """Forward + backward matmul FLOPs of one layer's block per device: 3 x the forward of the device's
    b_loc sequences (jaxpar/cost/flops.py, attention over all seq keys, Mamba-2 chunked over the whole
    sequence as flops.step_flops counts it), split evenly over the `shards` = tensor x context devices."""
    if block == "attention":
        fwd = flops.attention_projection_flops(m, b_loc * seq).matmul + flops.attention_core_flops(m, b_loc, seq).matmul
    elif block == "mlp":
        fwd = flops.mlp_flops(m, b_loc * seq).matmul
    else:
        fwd = flops.mamba_block_flops(m, b_loc, seq).matmul
    return 3 * fwd / shards


def block_collectives(m, block: str, layout: str, b_loc: float, s_loc: float, sizes: dict, gpu=False) -> dict:
    """One layer's non-gradient collectives of `block`, {(kind, fwd|bwd): bytes per device}, as
    jaxpar/cost/comm_tensor.py and comm_context.py price them (tp_attention, tp_mamba, sp_norms, context_parallel;
    compiler_comm.sp_norms_in_loop where the compiler leaves the norms' sums in the layer loop), split by block.
    XLA:CPU (gpu=False): reduce-scatters stay all-reduces of the full buffer, and each projection's
    input gradient is its own all-reduce (q, k, v: 3; gate, up: 2); GPU: one per sub-block, reassociated."""
    t, c, act = sizes.get("tensor", 1), sizes.get("context", 1), 2 if gpu else F32
    x = b_loc * s_loc * m.d_model * act
    out: dict = {}

    def add(kind, phase, nbytes):
        out[(kind, phase)] = out.get((kind, phase), 0) + nbytes
    if layout in ("TP", "SP"):
        sp = layout == "SP"
        fwd, fx = (("reduce-scatter", x) if gpu else ("all-reduce", x)) if sp else ("all-reduce", x)
        add(fwd, "fwd", fx)
        if sp:
            add("all-gather", "fwd", x)
            add("all-gather", "bwd", x)
        backward = 1 if gpu or block == "mamba2" else {"attention": 3, "mlp": 2}[block]
        add("reduce-scatter" if sp and gpu else "all-reduce", "bwd", backward * fx)
        if sp and block != "mlp":  # the norm weights' gradients (sequence-sharded inputs): compiler_comm.sp_norms_in_loop
            add("all-reduce", "bwd", (1 if block == "mamba2" else 2) * m.d_model * F32)  # sums both in one op
    if layout == "CP" and block == "attention":
        kv = b_loc * s_loc * m.kv_heads * m.head_dim / min(t, m.kv_heads) * act * c  # K or V, gathered
        add("all-gather", "fwd", 2 * kv)
        add("reduce-scatter", "bwd", 2 * kv)
    if layout == "CP" and block == "mamba2":
        _, conv_dim, heads = mamba_dims(m)
        add("collective-permute", "fwd", b_loc * (m.d_conv - 1) * conv_dim / t * act)
        add("collective-permute", "bwd", b_loc * (m.d_conv - 1) * conv_dim / t * act)
        state = b_loc * heads / t * (m.ssm_head_dim * m.d_state + 1) * F32 * c
        add("all-gather", "fwd", state)
        add("reduce-scatter", "bwd", state)
    return out


def weight_bytes(m, block: str, sizes: dict) -> float:
    """Weights per device: TP splits every matmul weight (the norm weight stays whole; GQA's K/V heads
    replicate once tensor exceeds them); DP, SP's data part and CP replicate."""
    t = sizes.get("tensor", 1)
    if block == "attention":
        hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        return (2 * m.d_model * hq / t + 2 * m.d_model * hkv / min(t, m.kv_heads)) * F32
    if block == "mlp":
        return 3 * m.d_model * m.mlp_dim / t * F32
    d_in_proj, conv_dim, heads = mamba_dims(m)
    mats = (m.d_model * d_in_proj + m.d_inner * m.d_model) / t
    small = (conv_dim * (m.d_conv + 1) + 3 * heads + m.d_inner) / t  # conv, A_log, D, dt_bias, gate norm
    return (mats + small) * F32


# ---- the study ------------------------------------------------------------------------------------------

def compiled_rows(jobs, batch: int, seq: int, bar) -> tuple[list[dict], list[dict]]:
    """Per (block, layout): the block's compiled figures beside the model's; per layout: the whole step's
    gradient all-reduces, compiled beside jaxpar/cost/comm.py's (XLA:CPU traits)."""
    rows, grads = [], []
    for model, layout in jobs:
        bar.set_description(f"compile {model} {layout}")
        r = compiled_blocks(model, layout, batch, seq)
        m, sizes = r["trainer"].model_cfg, dict(r["trainer"].strategy.sizes)
        b_loc, c = batch / sizes["data"], sizes["context"]
        st = r["trainer"].strategy
        predicted = cost_comm.collectives(m, st, step_shape(m, st, batch, seq), compiler="cpu")
        grads.append({"model": model, "layout": layout, "mesh": LAYOUTS[layout][0], "grad_hlo": r["grads"],
                      "grad_pred": sum(op.bytes for op in predicted if gradient(op))})
        for block in (("mamba2",) if m.pattern == "M" else ("attention", "mlp")):
            got = r["blocks"].get(block, {"flops": 0.0, "comm": {}, "weights": 0})
            pred = {k: v * m.layers for k, v in block_collectives(m, block, layout, b_loc, seq / c, sizes).items()}
            if layout == "CP" and block == "attention":  # the key positions, gathered once per step
                pred[("all-gather", "fwd")] += b_loc * seq / c * 4 * c
            rows.append({"block": block, "layout": layout, "mesh": LAYOUTS[layout][0], "model": model,
                         "flops_pred": block_flops(m, block, b_loc, seq, sizes["tensor"] * c) * m.layers,
                         "flops_hlo": got["flops"], "weights_pred": weight_bytes(m, block, sizes) * m.layers,
                         "weights_hlo": got["weights"], "comm_pred": pred, "comm_hlo": got["comm"]})
        bar.update()
    return rows, grads


def at_scale(hw_name: str = "h100-sxm", seq: int = 8192) -> list[dict]:
    """llama3-8b's blocks and a Mamba-2 mixer of its width on one 8-GPU node, one sequence per device
    (DP: 8 sequences), bf16 activations, GPU traits: per layer and device."""
    hw, rows = load_hardware(hw_name), []
    attn, mamba = parse_model(BIG_ATTN), parse_model(BIG_MAMBA)
    for layout, sizes in (("DP", {"data": 8}), ("TP", {"tensor": 8}), ("SP", {"tensor": 8}), ("CP", {"context": 8})):
        t, c = sizes.get("tensor", 1), sizes.get("context", 1)
        b_loc = 8 / sizes.get("data", 1)  # a global batch of 8 sequences
        for block, m in (("attention", attn), ("mlp", attn), ("mamba2", mamba)):
            comm = block_collectives(m, block, layout, b_loc, seq / c, sizes, gpu=True)
            act = sum(comm.values())
            wire = sum(v * wire_factor(kind, t * c) for (kind, _), v in comm.items())  # ring: what a device sends
            # float32 gradients, all-reduced over data or context (Megatron reduces a bf16 run's gradients in float32)
            grads = weight_bytes(m, block, sizes) if layout in ("DP", "CP") else 0.0
            f = block_flops(m, block, b_loc, seq, t * c)
            rows.append({"block": block, "layout": layout, "gflops": f / 1e9, "act_mib": act / 2**20,
                         "grad_mib": grads / 2**20, "weights_mib": weight_bytes(m, block, sizes) / 2 / 2**20,
                         "compute_ms": 1e3 * f / (hw.peak_flops * hw.matmul_efficiency),
                         "comm_ms": 1e3 * (wire + grads * wire_factor("all-reduce", 8)) / (hw.intra_bw * hw.link_efficiency)})
    return rows


def crossover(seqs) -> tuple[list[dict], int, int]:
    """Forward FLOPs per token (causal attention: projections + half the scores; the Mamba-2 mixer) and
    inference state per sequence (KV cache; SSM + conv state), bf16, per layer, as the context grows;
    the first sequence length (a multiple of the chunk) where attention costs more, for each."""
    attn, mamba = parse_model(BIG_ATTN), parse_model(BIG_MAMBA)
    _, conv_dim, heads = mamba_dims(mamba)
    state = (heads * mamba.ssm_head_dim * mamba.d_state + (mamba.d_conv - 1) * conv_dim) * 2
    kv_per_token = 2 * attn.kv_heads * attn.head_dim * 2

    def attn_flops(s):
        return (flops.attention_projection_flops(attn, s).matmul + flops.attention_core_flops(attn, 1, s, True).matmul) / s

    def mamba_flops(s):
        return flops.mamba_block_flops(mamba, 1, s).matmul / s
    rows = [{"seq": s, "attn_flops": attn_flops(s), "mamba_flops": mamba_flops(s),
             "kv_mib": s * kv_per_token / 2**20, "state_mib": state / 2**20} for s in seqs]
    step = mamba.chunk
    s = step
    while attn_flops(s) <= mamba_flops(s):
        s += step
    return rows, s, -(-state // kv_per_token)


def comm_text(d: dict) -> str:
    return ", ".join(f"{k[0]} {k[1]} {v / 2**10:,.1f}" for k, v in sorted(d.items())) or "none"


SHORT_BLOCK = {"attention": "attn", "mlp": "MLP", "mamba2": "Mamba-2"}


def figure(plt, comp, grads, scale, cross, flop_x, mem_x):
    fig = plt.figure(figsize=(14, 8.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.05])
    ax, bx, cx = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    # (1) per block: the block's own collectives; then per layout, the whole step's gradient all-reduces
    labels = [f"{SHORT_BLOCK[r['block']]}\n{r['layout']}" for r in comp] + \
             [f"grads\n{g['layout']}" + ("" if g["model"].startswith("llama") else "\n(M-2)") for g in grads]
    pred = [sum(r["comm_pred"].values()) / 2**10 for r in comp] + [g["grad_pred"] / 2**10 for g in grads]
    got = [sum(r["comm_hlo"].values()) / 2**10 for r in comp] + [g["grad_hlo"] / 2**10 for g in grads]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], pred, 0.4, label="cost model")
    ax.bar([i + 0.2 for i in x], got, 0.4, label="compiled HLO")
    ax.axvspan(len(comp) - 0.5, len(labels) - 0.5, color="0.9", zorder=0)
    ax.text(len(comp) - 0.4, max(pred + got) * 1.04, "gradient all-reduces over data / context, whole step "
            "(all blocks: XLA combines them)", fontsize=8, va="bottom")
    ax.set_ylim(0, max(pred + got) * 1.18)
    for i, (p_, g_) in enumerate(zip(pred, got)):
        if p_ == g_ == 0:
            ax.text(i, max(pred + got) * 0.01, "0", ha="center", fontsize=7)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="KiB per device per step",
           title="(1) appendix: jaxpar's own program on XLA:CPU (8 simulated devices, float32): block collectives "
                 "and gradient all-reduces, model vs compiled")
    ax.legend(fontsize=8, loc="upper left")
    blocks = ("attention", "mlp", "mamba2")
    layouts = ("DP", "TP", "SP", "CP")
    for j, block in enumerate(blocks):
        vals = [next(r for r in scale if r["block"] == block and r["layout"] == lay) for lay in layouts]
        bx.bar([i + (j - 1) * 0.27 for i in range(4)], [v["comm_ms"] / v["compute_ms"] for v in vals], 0.27, label=block)
    bx.axhline(1.0, color="black", linestyle="--", linewidth=1, label="comm = compute")
    bx.set_xticks(range(4), layouts)
    bx.set_yscale("log")
    bx.set(ylabel="NVLink time / matmul time (per layer)",
           title=f"(2) {BIG_ATTN}-sized blocks, 8 H100, 8k tokens (model)\nDP and CP include the gradient all-reduce")
    bx.legend(fontsize=7)
    seqs = [r["seq"] for r in cross]
    cx.plot(seqs, [r["attn_flops"] / 1e6 for r in cross], marker="o", label="attention (causal), MFLOP/token")
    cx.plot(seqs, [r["mamba_flops"] / 1e6 for r in cross], marker="s", label="Mamba-2 mixer, MFLOP/token")
    cx.axvline(flop_x, color="#000000", linestyle=":", linewidth=1)
    cx.annotate(f"FLOPs cross at {flop_x:,}", (flop_x, cross[0]["mamba_flops"] / 1e6), fontsize=7, rotation=90,
                va="bottom", ha="right")
    cx.set_xscale("log", base=2)
    cx.set(xlabel="sequence length, tokens", ylabel="forward MFLOP per token per layer",
           title=f"(3) per token: Mamba-2 mixer vs attention\n(state: KV cache > Mamba-2 state from {mem_x:,} tokens)")
    cx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(__doc__, dict(batch=8, seq=32), batch=(int, 8, "global batch, sequences"),
                     seq=(int, 64, "sequence length"))
    jobs = QUICK if args.quick else [(MODELS[b], lay) for b in ("attention", "mamba2") for lay in LAYOUTS]
    with progress(len(jobs), "compile") as bar:
        comp, grads = compiled_rows(jobs, args.batch, args.seq, bar)
    scale = at_scale()
    cross, flop_x, mem_x = crossover([2 ** k for k in range(9, 18)])

    def err(pred, got):
        return f"{pred / got - 1:+.2%}" if got else "n/a"
    body = [band_line("h100-sxm", "megatron-core"), "The at-scale figures below are per-layer costs, not step "
            "times; read ratios closer than the band as ties.", "",
            "Tokens per step at scale: 8 sequences of 8,192 on one 8-GPU node (65,536 tokens, one sequence per GPU "
            "under DP; 8k: Llama 3's pre-training sequence length, Dubey et al. 2024 sec. 3.4.1). Per-layer bytes "
            "and FLOPs scale with the tokens, so the comm / compute ratios hold for any number of sequences.", "",
            "No MFU: this study compares FLOPs and bytes per block. FLOPs are matmul FLOPs, forward + backward = 3 x "
            "the forward; attention's scores counted in full (s x s) in (1) and the appendix, causal (half) in the "
            "crossover (2), as a fused causal kernel computes them.", "",
            f"## (1) At scale (model): {BIG_ATTN} blocks and a Mamba-2 mixer of width 4096 ({BIG_MAMBA}), "
            "8 H100, 8 sequences of 8,192 tokens, bf16, per layer and device", "",
            *md_table(["block", "layout", "GFLOP", "activation comm MiB", "gradient MiB", "weights MiB",
                       "matmul ms", "NVLink ms", "comm / compute"],
                      [[r["block"], r["layout"], f"{r['gflops']:.1f}", f"{r['act_mib']:.1f}", f"{r['grad_mib']:.1f}",
                        f"{r['weights_mib']:.1f}", f"{r['compute_ms']:.2f}", f"{r['comm_ms']:.2f}",
                        f"{r['comm_ms'] / r['compute_ms']:.2f}"] for r in scale]), "",
            "Activation comm: TP/SP move the residual stream (2 passes), CP the K/V blocks (attention) or the "
            "conv halo and chunk states (Mamba-2); gradient: the block's float32 gradients (Megatron reduces a bf16 "
            "run's gradients in float32, as the cost model's megatron-core preset does), all-reduced over data or "
            "context (so DP is not free: its NVLink ms is the gradient all-reduce). NVLink ms: the bytes each "
            "device sends under ring algorithms (all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter "
            "(n-1)/n) at the profile's achieved bandwidth; matmul ms: the FLOPs at its achieved peak. SP moves "
            "twice TP's buffers but the same wire bytes.", "",
            f"## (2) Crossover (model): forward per token per layer, {BIG_ATTN} attention (causal) vs the Mamba-2 mixer", "",
            *md_table(["seq", "attention MFLOP/token", "Mamba-2 MFLOP/token", "KV cache MiB/sequence", "Mamba-2 state MiB/sequence"],
                      [[f"{r['seq']:,}", f"{r['attn_flops'] / 1e6:.1f}", f"{r['mamba_flops'] / 1e6:.1f}",
                        f"{r['kv_mib']:.2f}", f"{r['state_mib']:.2f}"] for r in cross]), "",
            f"FLOPs crossover: attention costs more per token from {flop_x:,} tokens (first multiple of the chunk, "
            f"{parse_model(BIG_MAMBA).chunk}). State crossover: the KV cache outgrows the Mamba-2 state from "
            f"{mem_x:,} tokens of context.", "",
            "## APPENDIX: jaxpar's own program compiled on 8 simulated CPU devices (XLA:CPU), not hardware guidance", "",
            f"Batch {args.batch} x {args.seq} (tiny, so that each compile takes seconds), float32, per device per step. "
            "Blocks of the 2 layers together; collectives of the block in KiB by (kind, pass); the gradient "
            "all-reduces over data/context are in the table after (XLA combines them across blocks).", "",
            *md_table(["block", "layout", "mesh", "GFLOP (model)", "GFLOP (compiled)", "FLOPs error",
                       "weights KiB (model)", "weights KiB (compiled)", "comm KiB (model)", "comm KiB (compiled)",
                       "comm error", "compiled collectives"],
                      [[r["block"], r["layout"], r["mesh"], f"{r['flops_pred'] / 1e9:.4f}", f"{r['flops_hlo'] / 1e9:.4f}",
                        err(r["flops_pred"], r["flops_hlo"]), f"{r['weights_pred'] / 2**10:.1f}",
                        f"{r['weights_hlo'] / 2**10:.1f}", f"{sum(r['comm_pred'].values()) / 2**10:.1f}",
                        f"{sum(r['comm_hlo'].values()) / 2**10:.1f}",
                        err(sum(r["comm_pred"].values()), sum(r["comm_hlo"].values()))
                        if r["comm_hlo"] or r["comm_pred"] else "+0.00%", comm_text(r["comm_hlo"])]
                       for r in comp]), "",
            "Gradient all-reduces over data and context, whole step (every block, the embedding and the norms), "
            "compiled against jaxpar/cost/comm.py with XLA:CPU traits:", "",
            *md_table(["model", "grads layout", "mesh", "gradient KiB (model)", "gradient KiB (compiled)", "gradient error"],
                      [[g["model"], g["layout"], g["mesh"], f"{g['grad_pred'] / 2**10:.1f}", f"{g['grad_hlo'] / 2**10:.1f}",
                        err(g["grad_pred"], g["grad_hlo"])] for g in grads])]
    print("\n".join(body))
    finish(args, STEM, "Study (d): blocks compared", body,
           lambda plt: figure(plt, comp, grads, scale, cross, flop_x, mem_x))


if __name__ == "__main__":
    main()
