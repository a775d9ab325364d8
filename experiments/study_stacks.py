"""How well the cost model predicts published runs of other stacks, per source, in and out of sample.

Reads the published runs of other stacks kept in the repository (jaxpar/cost/published.py, the collection
published_runs_stacks: torchtitan, MaxText on TPU and
GPU, llm-foundry, NeMo and Megatron-Bridge runs: model shapes, layouts, precision, recompute and the
throughput each published) and asks `jaxpar.cost.estimate` each training row's question with the row's
own stack preset (jaxpar/cost/software.py) on its hardware profile. Each source's rows are read by one
function below that maps its columns onto jaxpar's axes and options, stating what it assumes; nothing in
them is fitted. The metric is tokens/s per device; a source that publishes TFLOP/s or MFU only is turned
into tokens/s with that source's own FLOP convention (its `flops_convention`).

Two tables:
  in sample     the profiles' constants as committed (jaxpar/cost/hardware/*.toml);
  out of sample leave one source out: for each source, the one calibrated constant of each hardware family
                (matmul_efficiency) is re-fitted on the other sources' rows of that family (the median
                absolute log error over a grid), and the held-out source is predicted with it; a family
                no other source covers keeps its profile's value (said so in the table).
Rows of architectures the cost model does not represent (multi-head latent attention, sliding-window
attention, leading dense layers) are listed, not predicted. The issue's goal: each source's median within
15%, its worst within 25%; the tables show where it holds and where not. The in-sample residuals per
(hardware family, stack) are the error bands `estimate` and `plan` print (jaxpar/cost/band.py).

A third table gives the same residuals per (stack, hardware family): the bands bands.toml holds. The
figure (results/study_stacks.png, and small under experiments/figures/) plots every predicted row out of
sample against its published figure on log-log axes beside y = x and the guide's default band
(megatron-core on the H100 family), and each (stack, family)'s errors beside its own band.

    python experiments/study_stacks.py                 # prints the tables, writes results/study_stacks.md and .png
    python experiments/study_stacks.py --write-bands   # ... and jaxpar/cost/bands.toml
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "experiments"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _study import FIGURES, OKABE_ITO, pyplot  # noqa: E402

from jaxpar.core import validate  # noqa: E402
from jaxpar.core.strategy import Strategy, parse_inline  # noqa: E402
from jaxpar.cost import SOFTWARE, estimate, load_hardware  # noqa: E402
from jaxpar.cost.band import (REGIME_MIN_RUNS, Band, PairedBand, RegimeBand, band_for, paired_errors, quantile_band, regime,  # noqa: E402
                              to_toml)
from jaxpar.cost import published  # noqa: E402
from jaxpar.cost.defaults import stack_defaults  # noqa: E402
from jaxpar.cost.software import check_runs  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.models.config import ModelConfig  # noqa: E402

COLLECTION = "published_runs_stacks"   # jaxpar/cost/published/, as it arrived in ../shared/reference/
RESULTS = ROOT / "experiments/results/study_stacks.md"
BANDS = ROOT / "jaxpar/cost/bands.toml"
GRID = [round(0.30 + 0.02 * i, 2) for i in range(31)]   # matmul_efficiency 0.30 .. 0.90


@dataclasses.dataclass(frozen=True)
class Row:
    source: str
    label: str
    model: ModelConfig
    strategy: Strategy
    hardware: str
    software: str
    global_batch: int
    seq: int
    published: float          # tokens/s per device
    unsupported: str = ""     # why the cost model cannot represent it ("" = it can)
    memory_gib: float = 0.0   # the peak memory per device the source published (GiB; 0: not published)


# ---- models ----------------------------------------------------------------------------------------

def model_from(name: str, spec: dict, seq: int) -> tuple[ModelConfig, str]:
    """The reference's model table as a ModelConfig, or why not. Non-gated ReLU and squared-ReLU MLPs cost
    as GeLU (one up and one down matrix, the same FLOPs and parameters); learned position tables (MPT,
    GPT-3: seq x d parameters, under 0.1% of these models) are not counted."""
    if spec.get("attention") == "mla":
        return None, "multi-head latent attention"
    if "attention_note" in spec:
        return None, "sliding-window attention"
    if spec.get("first_dense_layers"):
        return None, "leading dense layers"
    gated = spec["ffn_type"] == "swiglu"
    common = dict(name=name, layers=spec["layers"], d_model=spec["d_model"], heads=spec["heads"],
                  kv_heads=spec.get("kv_heads", spec["heads"]), head_dim=spec.get("head_dim", spec["d_model"] // spec["heads"]),
                  mlp_dim=spec["ffn"], mlp_type="swiglu" if gated else "gelu", vocab=spec["vocab"], max_seq=seq,
                  tie_embeddings=spec.get("tied_embeddings", False))
    if spec.get("experts"):
        common |= dict(pattern="E", experts=spec["experts"], top_k=spec["top_k"], expert_mlp_dim=spec["ffn"],
                       shared_experts=spec.get("shared_experts", 0))
    return ModelConfig(**common), ""


def tokens_from_tflops(tflops: float, m: ModelConfig, seq: int, causal: bool) -> float:
    """tokens/s per device from a source's TFLOP/s per device under its convention: 6N per token (N with
    the embedding, as MaxText's 2023 and 2024 formulas count it) + the attention's 12 L H d_head s, halved
    where the source counts causal attention."""
    n = m.layers * (m.d_model * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
                    + m.d_model * m.mlp_dim * (3 if m.mlp_type == "swiglu" else 2)) + m.vocab * m.d_model
    attention = 12 * m.layers * m.heads * m.head_dim * seq * (0.5 if causal else 1.0)
    return tflops * 1e12 / (6 * n + attention)


def mesh(**sizes: int) -> Strategy:
    spec = ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "data=1"
    return parse_inline(spec)


# ---- one reader per source ---------------------------------------------------------------------------

def torchtitan(src, row, models) -> Row:
    """fsdp = data_parallel_shard_degree (FSDP2); context parallelism as PyTorch runs it (the torchtitan
    preset's cp_* traits: K and V all-gathered, dK/dV around the ring) over the load-balanced layout
    (its round-robin load balancer: rank r holds chunks r and 2c-1-r = zigzag); float8 linears;
    op-level selective AC (torchtitan's default: the outputs of matmuls and of the attention kernel saved,
    the elementwise ops recomputed) = JAX's dots policy (torchtitan also recomputes every second matmul;
    not counted); async TP = collective matmul; micro-batches = pp; the
    hardware its `hardware_note` describes (96 GB H100 at 500 W: profile h100-96gb-500w)."""
    seq = row["seq"]
    m, why = model_from(row["model"], models[row["model"]], seq)
    pp, cp = row.get("pp", 1), row.get("cp", 1)
    st = mesh(fsdp=row["fsdp"], pipeline=pp, context=cp, tensor=row["tp"])
    remat = {"selective_op": "dots", "full": "full"}[row["activation_ckpt"]]
    opts = dict(remat=remat, dtype="float8", overlap="collective_matmul" if row["async_tp"] and row["tp"] > 1 else "none")
    opts |= dict(attention="ring", cp_layout="zigzag") if cp > 1 else {}
    opts |= dict(microbatches=pp, pp_schedule="1f1b") if pp > 1 else {}
    label = f"{row.get('table', 'asyncTP')} {row['model']} {row['gpus']} GPUs fsdp{row['fsdp']} tp{row['tp']} pp{pp} cp{cp}"
    return Row(src["id"], label, m, st.with_options(**opts), "h100-96gb-500w", "torchtitan", row["global_batch"], seq,
               row["tokens_per_s_per_gpu"], why, row.get("memory_gib", 0.0))


def maxtext_v6e(src, row, models) -> Row:
    """fsdp x fsdp_transpose = one fsdp axis (both shard the weights over every chip); offload remat
    policies = remat offload; bfloat16; splash attention."""
    seq = row["seq"]
    m, why = model_from(row["model"], models[row["model"]], seq)
    st = mesh(fsdp=row["fsdp"] * row["fsdp_transpose"], tensor=row["tp"], expert=row["ep"])
    st = st.with_options(remat="offload", dtype="bfloat16")
    return Row(src["id"], f"{row['model']} {row['device_type']}", m, st, "tpu-v6e", "maxtext", row["global_batch"], seq,
               row["tokens_per_s_per_device"], why)


def maxtext_2023(src, row, models) -> Row:
    """fsdp (and tensor) inside a slice, data parallelism across slices over DCN; remat minimal = MaxText's
    checkpoint_dots_with_no_batch_dims (jaxpar's dots_no_batch); TFLOP/s per chip into tokens/s with the non-causal
    2023 formula (the source says the v5p rows may count causal attention: ambiguous)."""
    seq, chips, slices = row["seq"], row["chips"], row["slices"]
    m, why = model_from(row["model"], models[row["model"]], seq)
    hw = "tpu-v5e" if row["device_type"].startswith("v5e") else "tpu-v5p"
    st = mesh(data=slices, fsdp=row["fsdp_per_slice"], tensor=row["tp"])
    st = dataclasses.replace(st, dcn=(("data", slices),) if slices > 1 else ())
    st = st.with_options(remat="full" if row["remat"] == "full" else "dots_no_batch", dtype="bfloat16")
    tokens = tokens_from_tflops(row["tflops_per_chip"], m, seq, causal=False) if m else 0.0
    return Row(src["id"], f"{row['model']} {row['device_type']} x{slices}", m, st, hw, "maxtext",
               row["per_device_batch"] * chips, seq, tokens, why)


def maxtext_a3(src, row, models) -> Row:
    """ici_fsdp inside a node, dcn data (and dcn fsdp) across; remat minimal_flash = MaxText's minimal
    (checkpoint_dots_with_no_batch_dims: jaxpar's dots_no_batch) with the flash kernel's output saved; TFLOP/s per GPU
    into tokens/s with the causal formula the April 2024 code used."""
    seq = row["seq"]
    m, why = model_from(row["model"], models[row["model"]], seq)
    st = mesh(data=row["dcn_dp"], fsdp=row["ici_fsdp"] * row["dcn_fsdp"])
    st = st.with_options(remat="dots_no_batch", dtype="bfloat16")
    hw = "h200-sxm" if "a3u" in row["system"].lower() or "h200" in row["system"].lower() else "h100-sxm"
    tokens = (row["tokens_per_s_per_device"] if isinstance(row["tokens_per_s_per_device"], (int, float))
              else tokens_from_tflops(row["tflops_per_device"], m, seq, causal=True))
    return Row(src["id"], f"{row['model']} {row['system']}", m, st, hw, "maxtext", row["global_batch"], seq, tokens, why)


def llm_foundry(src, row, models) -> Row:
    """FULL_SHARD = fsdp over every GPU; SHARD_GRAD_OP (ZeRO-2, parameters replicated) costed as ZeRO-1 on
    data, its nearest stage here; activation checkpointing = remat full; gradient accumulation as given."""
    seq = row["seq"]
    m, why = model_from(row["model"], models[row["model"]], seq)
    st = mesh(fsdp=row["gpus"]) if row["sharding"] == "FULL_SHARD" else mesh(data=row["gpus"]).with_options(zero=1)
    st = st.with_options(remat="full" if row["act_ckpt"] else "none", dtype="bfloat16", grad_accum=row["grad_accum"])
    hw = "a100-80gb" if row["gpu"].startswith("a100") else "h100-sxm"
    return Row(src["id"], f"{row['model']} {row['gpus']} {row['gpu']} seq{seq}", m, st, hw, "llm-foundry",
               row["global_batch"], seq, row["tokens_per_s_per_gpu"], why)


# NeMo's own configs for these models reduce the gradients in bf16 (optim.grad_sync_dtype: bf16 in
# NeMo-Framework-Launcher conf/training/gpt3/175b_fp8_performance.yaml and nemotron/nemotron_340b.yaml);
# its Llama configs leave the optimizer's float32
NEMO_BF16_GRADS = ("gpt3_175b", "nemotron4_340b")


def megatron(src, row, models) -> Row:
    """NeMo 24.07 and Megatron-Bridge 25.11: data = gpus / (tp pp cp); interleaved 1F1B with vp model
    chunks per stage; micro-batches = gbs / (mbs dp); float8 where the row says so; no recompute; bf16
    gradients where NeMo's config for the model says so (`NEMO_BF16_GRADS`); the stack's defaults
    (distributed optimizer, sequence parallelism) as `estimate` applies them."""
    seq, tp, pp, cp = row["seq"], row["tp"], row["pp"], row["cp"]
    m, why = model_from(row["model"], models[row["model"]], seq)
    ep = row.get("ep", 1)
    dp = row["gpus"] // (tp * pp * cp)
    st = mesh(data=dp // ep if ep > 1 else dp, expert=ep, pipeline=pp, context=cp, tensor=tp)
    fp8 = "precision" not in row or row["precision"].upper().startswith("FP8")
    per_step = row["gbs"] // (row["mbs"] * dp)
    opts = dict(dtype="float8" if fp8 else "bfloat16", remat="none")
    opts |= dict(grad_dtype="bfloat16") if src["id"].startswith("nemo_") and row["model"] in NEMO_BF16_GRADS else {}
    opts |= dict(attention="ring") if cp > 1 else {}
    vp = row.get("vp", 1) if isinstance(row.get("vp", 1), int) else 1
    opts |= (dict(microbatches=per_step, pp_schedule="1f1b", pp_repeats=vp) if pp > 1 else dict(grad_accum=per_step))
    hw = "b200" if "B200" in row.get("system", "") else "h100-sxm"
    return Row(src["id"], f"{row['model']} {row['gpus']} {hw} tp{tp} pp{pp} cp{cp}", m, st.with_options(**opts), hw,
               "megatron-core", row["gbs"], seq, row["tokens_per_s_per_gpu"], why)


READERS = {"torchtitan_h100_2024": torchtitan, "torchtitan_asynctp_h100_2025": torchtitan,
           "maxtext_tpu_recipes_v6e": maxtext_v6e, "maxtext_readme_2023_v5e_v5p": maxtext_2023,
           "maxtext_gpu_a3": maxtext_a3, "llm_foundry_mpt": llm_foundry, "nemo_2407_h100_fp8": megatron,
           "megatron_bridge_2511": megatron}


def read_rows(path: pathlib.Path | None = None) -> tuple[list[Row], list[str]]:
    """(the training rows, the sources not read: serving rows and any source without a reader) of the
    collection in the repository, or of the file `path` (new rows before scripts/import_published.py)."""
    data = published.load(COLLECTION) if path is None else tomllib.loads(path.read_text())
    rows, skipped = [], []
    for src in data["source"]:
        reader = READERS.get(src["id"])
        if reader is None:
            skipped.append(f"{src['id']} ({src['kind']}: not read by this study)")
            continue
        for raw in src["rows"]:
            rows.append(reader(src, dict(zip(src["columns"], raw)), data["models"]))
    return rows, skipped


def family(hardware: str) -> str:
    """The calibration family of a hardware profile (Hardware.family: one constant set each)."""
    return load_hardware(hardware).family


# ---- predicting ------------------------------------------------------------------------------------

def question(row: Row) -> Strategy:
    """The row's strategy with its stack's own defaults where the reader left an option at jaxpar's
    (jaxpar.cost.defaults.stack_defaults: the distributed optimizer, sequence parallelism, 1F1B), checked
    as `estimate --software` checks it: what the stack runs, no constraint of jaxpar's own program."""
    st = row.strategy.resolved(row.strategy.num_devices)
    changes, _ = stack_defaults(st, SOFTWARE[row.software], set())
    st = st.with_options(**changes) if changes else st
    validate.check(row.model, st, batch=row.global_batch, seq=row.seq, padded_zero=True, program=False)
    check_runs(st, SOFTWARE[row.software])
    return st


def predict(row: Row, st: Strategy, efficiency: float | None = None):
    """(predicted tokens/s per device, fits in HBM) with the profile's constants, or `efficiency` for
    matmul_efficiency."""
    hw = load_hardware(row.hardware)
    if efficiency is not None:
        hw = dataclasses.replace(hw, matmul_efficiency=efficiency)
    est = estimate(row.model, st, hw, row.global_batch, row.seq, SOFTWARE[row.software])
    return est.tokens_per_s / st.num_devices, est.fits


def predictions(rows: list[Row]) -> tuple[list[tuple[Row, Strategy]], list[tuple[Row, str]]]:
    """(expressible rows with their strategies, refused rows with why)."""
    ok, refused = [], []
    for row in rows:
        if row.unsupported:
            refused.append((row, f"not modelled: {row.unsupported}"))
            continue
        try:
            ok.append((row, question(row)))
        except ConfigError as e:
            refused.append((row, str(e)))
    return ok, refused


def log_error(pred: float, pub: float) -> float:
    return abs(math.log(pred / pub))


def leave_one_source_out(ok: list[tuple[Row, Strategy]]) -> dict[int, tuple[float, str]]:
    """{index in ok: (out-of-sample prediction, the efficiency used and where from)} (module docstring)."""
    grid = {(i, e): predict(row, st, e)[0] for i, (row, st) in enumerate(ok) for e in GRID}
    out = {}
    for held in {row.source for row, _ in ok}:
        for fam in {family(row.hardware) for row, _ in ok if row.source == held}:
            others = [i for i, (row, _) in enumerate(ok) if row.source != held and family(row.hardware) == fam]
            best = None
            if others:
                best = min(GRID, key=lambda e: statistics.median(log_error(grid[i, e], ok[i][0].published)
                                                                 for i in others))
            for i, (row, st) in enumerate(ok):
                if row.source == held and family(row.hardware) == fam:
                    out[i] = ((grid[i, best], f"{best:.2f} fitted on {len(others)} rows") if best is not None
                              else (predict(row, st)[0], "profile's (no other source)"))
    return out


# ---- reporting -------------------------------------------------------------------------------------

def memory_check(ok: list[tuple[Row, Strategy]]) -> list[tuple[Row, float]]:
    """(row, predicted memory per device in GiB) for the rows whose source publishes its peak memory."""
    out = []
    for row, st in ok:
        if row.memory_gib:
            est = estimate(row.model, st, load_hardware(row.hardware), row.global_batch, row.seq, SOFTWARE[row.software])
            out.append((row, est.memory.total / 2**30))
    return out


MEMORY_HEAD = ("Memory, where the source publishes it: torchtitan logs `torch.cuda.max_memory_reserved` (its "
               "DeviceMemoryMonitor's max_reserved_gib), what PyTorch's caching allocator held at its peak. The "
               "model counts what the step keeps (weights, gradients, optimizer state, activations, the loss's "
               "logits); the allocator also holds its fragmentation and the rounding of its blocks, so the "
               "prediction is a lower bound of the published figure, and their ratio is the share of the "
               "reserved memory the model accounts for.")


def memory_table(checked: list[tuple[Row, float]]) -> list[str]:
    if not checked:
        return []
    ratios = [pred / row.memory_gib for row, pred in checked]
    lines = ["## Memory where a source publishes it", "", MEMORY_HEAD, "",
             "| source | run | published peak GiB | predicted GiB | predicted / published |", "|---|---|---|---|---|"]
    lines += [f"| {row.source} | {row.label} | {row.memory_gib:.1f} | {pred:.1f} | {pred / row.memory_gib:.2f} |"
              for row, pred in checked]
    lines += ["", f"{len(checked)} runs: the model accounts for {min(ratios):.0%} to {max(ratios):.0%} of the reserved "
              f"peak (median {statistics.median(ratios):.0%}); {sum(r <= 1 for r in ratios)} of {len(checked)} "
              "predictions are at or below it. A layout the model puts near the HBM's edge may not fit a PyTorch stack: "
              "`--hbm-headroom` keeps the rest free.", ""]
    return lines


def summary(errors: dict[str, list[float]], alone: dict[str, int] | None = None) -> list[str]:
    """Per source: rows, median and worst |error|, and whether the issue's goal holds; `alone`: per source, its
    rows on a hardware family no other source covers (their "out of sample" constants were fitted on them)."""
    lines = ["| source | rows | median error | worst error | goal (15% / 25%) |", "|---|---|---|---|---|"]
    for source, errs in sorted(errors.items()):
        med, worst = statistics.median(abs(e) for e in errs), max(abs(e) for e in errs)
        k = (alone or {}).get(source, 0)
        mark = f" ({k} of them in sample: no other source on their hardware)" if k else ""
        lines.append(f"| {source}{mark} | {len(errs)} | {med:.1%} | {worst:.1%} | "
                     f"{'holds' if med <= 0.15 and worst <= 0.25 else 'misses'} |")
    return lines


def error_bands(ok: list[tuple[Row, Strategy]], loso: dict[int, tuple[float, str]]) -> list[Band]:
    """Per (hardware family, stack): the residuals of the committed profiles, and those out of sample where
    another source covers the family (jaxpar/cost/band.py's bands)."""
    ins: dict[tuple[str, str], list[float]] = {}
    outs: dict[tuple[str, str], list[float]] = {}
    for i, (row, st) in enumerate(ok):
        key = (family(row.hardware), SOFTWARE[row.software].name)
        ins.setdefault(key, []).append(abs(predict(row, st)[0] / row.published - 1))
        if "no other source" not in loso[i][1]:
            outs.setdefault(key, []).append(abs(loso[i][0] / row.published - 1))
    def r(x):   # to the 4 decimals bands.toml records, so that the study prints what the file holds
        return None if x is None else round(x, 4)
    return [Band(f, sw, len(e), r(statistics.median(e)), r(max(e)),
                 r(statistics.median(outs[f, sw])) if (f, sw) in outs else None,
                 r(max(outs[f, sw])) if (f, sw) in outs else None) for (f, sw), e in sorted(ins.items())]


def row_regime(row: Row, st: Strategy) -> str:
    """The row's regime (jaxpar.cost.band.regime): its stack, family, precision and scale flags."""
    return regime(SOFTWARE[row.software].name, family(row.hardware), st.options.dtype, st.sizes,
                  bool(row.model.moe_layers))


def regime_bands(ok: list[tuple[Row, Strategy]], loso: dict[int, tuple[float, str]]) -> list[RegimeBand]:
    """Per regime, over its rows predicted out of sample (a family no other source covers is left out): the
    10th to 90th percentile of predicted / published - 1 where at least 8 runs fall in it, and its coverage:
    the share of its runs inside the band that the other sources' runs of the regime give (where >= 8)."""
    errs: dict[str, list[tuple[str, float]]] = {}
    for i, (row, st) in enumerate(ok):
        if "no other source" not in loso[i][1]:
            errs.setdefault(row_regime(row, st), []).append((row.source, loso[i][0] / row.published - 1))
    out = []
    for name, runs in sorted(errs.items()):
        band = quantile_band([e for _, e in runs]) or (None, None)
        held = [(e, quantile_band([f for s, f in runs if s != src])) for src, e in runs]
        inside = [b[0] <= e <= b[1] for e, b in held if b]
        out.append(RegimeBand(name, len(runs), *band, round(sum(inside) / len(inside), 4) if inside else None))
    return out


def layout_pairs(ok: list[tuple[Row, Strategy]], loso: dict[int, tuple[float, str]]) -> list[tuple[int, int]]:
    """(i, j) of every two rows of one source, model, hardware, sequence length and precision that differ in
    layout or scale, each predicted out of sample (a family no other source covers is left out)."""
    def key(row: Row, st: Strategy):
        return row.source, row.model.name, row.hardware, row.seq, st.options.dtype
    usable = [i for i in range(len(ok)) if "no other source" not in loso[i][1]]
    return [(i, j) for n, i in enumerate(usable) for j in usable[n + 1:]
            if key(*ok[i]) == key(*ok[j]) and (ok[i][1].sizes, ok[i][0].global_batch) != (ok[j][1].sizes, ok[j][0].global_batch)]


def paired_band(ok: list[tuple[Row, Strategy]], loso: dict[int, tuple[float, str]]) -> PairedBand:
    """The band of the error of two layouts' ratio (jaxpar.cost.band.paired_errors) over `layout_pairs`."""
    pairs = layout_pairs(ok, loso)
    errors = paired_errors([(loso[i][0], loso[j][0], ok[i][0].published, ok[j][0].published) for i, j in pairs])
    band = (quantile_band(errors) if len(pairs) >= REGIME_MIN_RUNS else None) or (None, None)
    return PairedBand(len(pairs), len({ok[i][0].source for i, _ in pairs}), *band)


def pair_table(ok: list[tuple[Row, Strategy]], loso: dict[int, tuple[float, str]]) -> list[str]:
    """Each layout pair: its two runs, the published and the predicted ratio of their speeds, the error."""
    lines = ["| source | run a | run b | published a / b | predicted a / b | error |", "|---|---|---|---:|---:|---:|"]
    for i, j in layout_pairs(ok, loso):
        (a, _), (b, _) = ok[i], ok[j]
        pub, pred = a.published / b.published, loso[i][0] / loso[j][0]
        lines.append(f"| {a.source} | {a.label} | {b.label} | {pub:.3f} | {pred:.3f} | {pred / pub - 1:+.1%} |")
    return lines


def regime_summary(regimes: list[RegimeBand]) -> list[str]:
    """Per regime: its runs, its band (or none) and the coverage of held-out sources' runs."""
    lines = ["| regime | runs | 10th percentile | 90th percentile | held-out runs inside |", "|---|---:|---:|---:|---:|"]
    for r in regimes:
        band = ("no calibrating run", "") if r.low is None else (f"{r.low:+.1%}", f"{r.high:+.1%}")
        lines.append(f"| {r.regime} | {r.count} | {band[0]} | {band[1]} | "
                     f"{'-' if r.coverage is None else f'{r.coverage:.0%}'} |")
    return lines


def stack_summary(bands: list[Band]) -> list[str]:
    """Per (stack, hardware family): runs, median and worst |error| in sample and out of sample (`-` where no
    other source covers the family), the figures jaxpar/cost/bands.toml records and the guide calls ties within."""
    lines = ["| stack | hardware family | runs | median in sample | worst in sample | median out of sample | "
             "worst out of sample | the guide's band |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for b in sorted(bands, key=lambda b: (b.software, b.family)):
        oos = ("-", "-") if b.oos_median is None else (f"{b.oos_median:.1%}", f"{b.oos_worst:.1%}")
        lines.append(f"| {b.software} | {b.family} | {b.runs} | {b.median:.1%} | {b.worst:.1%} | {oos[0]} | {oos[1]} | "
                     f"±{b.guide():.1%} |")
    return lines


MARKERS = {"megatron-core": "o", "torchtitan": "s", "maxtext": "^", "llm-foundry": "D"}


def points(ok: list[tuple[Row, Strategy]], loso: dict[int, tuple[float, str]]) -> list[dict]:
    """One entry per predicted row: its stack, family, published and out-of-sample tokens/s per device, fit."""
    return [{"stack": SOFTWARE[row.software].name, "family": family(row.hardware), "published": row.published,
             "predicted": loso[i][0], "fits": predict(row, st)[1]} for i, (row, st) in enumerate(ok)]


def figure(plt, pts: list[dict], bands: list[Band]):
    """Left: predicted (out of sample) vs published tokens/s per device, log-log, y = x and the default band
    shaded; right: each (stack, family)'s signed errors beside its own band. Hollow: predicted not to fit."""
    fams = sorted({p["family"] for p in pts})
    colour = {f: OKABE_ITO[i % len(OKABE_ITO)] for i, f in enumerate(fams)}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [1.1, 1]})
    lo, hi = min(min(p["published"], p["predicted"]) for p in pts) / 1.5, max(max(p["published"], p["predicted"]) for p in pts) * 1.5
    xs = [lo, hi]
    default = band_for("h100-sxm", "megatron-core")
    if default is not None:
        for share, alpha, what in ((default.oos_worst or default.worst, 0.15, "worst"), (default.guide(), 0.35, "median")):
            ax.fill_between(xs, [x * (1 - share) for x in xs], [x * (1 + share) for x in xs], color="0.5", alpha=alpha,
                            lw=0, label=f"megatron-core on h100-sxm, out of sample: ±{share:.1%} ({what})")
    ax.plot(xs, xs, color="black", lw=0.8, label="predicted = published")
    for p in pts:
        c = colour[p["family"]]
        ax.scatter(p["published"], p["predicted"], marker=MARKERS.get(p["stack"], "o"), s=36, zorder=3,
                   facecolors=c if p["fits"] else "none", edgecolors=c, linewidths=1.2)
    ax.set(xscale="log", yscale="log", xlim=xs, ylim=xs, xlabel="published tokens/s per device",
           ylabel="predicted tokens/s per device (out of sample)",
           title="Every published run in its own layout and stack preset")
    handles = ax.get_legend_handles_labels()
    for stack, m in MARKERS.items():
        handles[0].append(ax.scatter([], [], marker=m, facecolors="0.3", edgecolors="0.3")), handles[1].append(stack)
    for f in fams:
        handles[0].append(ax.scatter([], [], marker="o", color=colour[f])), handles[1].append(f)
    handles[0].append(ax.scatter([], [], marker="o", facecolors="none", edgecolors="0.3"))
    handles[1].append("hollow: predicted not to fit in HBM")
    ax.legend(*handles, fontsize=7, loc="upper left", frameon=False)
    pairs = sorted({(p["stack"], p["family"]) for p in pts})
    by = {(b.software, b.family): b for b in bands}
    for j, pair in enumerate(pairs):
        b = by.get(pair)
        if b is not None:
            for share, alpha in (((b.oos_worst if b.oos_worst is not None else b.worst), 0.15), (b.guide(), 0.35)):
                bx.fill_between([j - 0.35, j + 0.35], [-100 * share] * 2, [100 * share] * 2, color="0.5", alpha=alpha, lw=0)
        errs = [p for p in pts if (p["stack"], p["family"]) == pair]
        for k, p in enumerate(errs):
            c = colour[p["family"]]
            bx.scatter(j - 0.25 + 0.5 * k / max(len(errs) - 1, 1), 100 * (p["predicted"] / p["published"] - 1),
                       marker=MARKERS.get(p["stack"], "o"), s=28, zorder=3, facecolors=c if p["fits"] else "none",
                       edgecolors=c, linewidths=1.2)
    bx.axhline(0, color="black", lw=0.8)
    bx.set_xticks(range(len(pairs)), [f"{s}\n{f}" for s, f in pairs], fontsize=7, rotation=30, ha="right",
                  rotation_mode="anchor")
    bx.set(ylabel="predicted / published - 1 (%), out of sample",
           title="Errors per stack and hardware family beside its band: dark median, light worst\n"
                 "(out of sample; in sample where no other source covers the family)")
    fig.tight_layout()
    return fig


def write_figure(pts: list[dict], bands: list[Band], out: pathlib.Path) -> str:
    """<out>.png beside the results file, and a small copy under experiments/figures/ when `out` is the default."""
    plt = pyplot()
    if plt is None:
        return "no figure: matplotlib is not installed"
    fig = figure(plt, pts, bands)
    fig.savefig(out.with_suffix(".png"), dpi=110)
    if out.resolve() == RESULTS.resolve():
        FIGURES.mkdir(parents=True, exist_ok=True)
        fig.savefig(FIGURES / "study_stacks.png", dpi=80)
    plt.close(fig)
    return f"figure: {out.with_suffix('.png')}"


def analyse(rows: list[Row]) -> tuple[list[tuple[Row, Strategy]], list[tuple[Row, str]], dict[int, tuple[float, str]]]:
    """(expressible rows with their strategies, refused rows with why, the leave-one-source-out predictions)."""
    ok, refused = predictions(rows)
    return ok, refused, leave_one_source_out(ok)


HEAD = ["Each published training run predicted in its own layout, with its own stack's preset "
        "(jaxpar/cost/software.py) on its hardware profile, at the run's own global batch and sequence length "
        "(each row's tokens per step are the ones it published). The metric is tokens/s per device; a source that "
        "publishes TFLOP/s or MFU only is turned into tokens/s with that source's own FLOP convention.", ""]


def report(rows: list[Row], skipped: list[str], write_bands: bool = False, analysed=None) -> str:
    ok, refused, loso = analysed or analyse(rows)
    bands, regimes, paired = error_bands(ok, loso), regime_bands(ok, loso), paired_band(ok, loso)
    if write_bands:
        BANDS.write_text(to_toml(bands, regimes, paired))
    lines = ["# Published runs of other stacks against the cost model", "",
             "mode: full (the study has one mode); written by `python experiments/study_stacks.py`", "", *HEAD,
             "| source | run | hardware | stack | published tok/s/dev | in sample | error | out of sample | error | "
             "fits | out-of-sample efficiency |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ins, outs, not_fit = {}, {}, 0
    alone: dict[str, int] = {}
    for i, (row, _) in enumerate(ok):
        if "no other source" in loso[i][1]:
            alone[row.source] = alone.get(row.source, 0) + 1
    for i, (row, st) in enumerate(ok):
        pred, fits = predict(row, st)
        not_fit += not fits
        oos, how = loso[i]
        ins.setdefault(row.source, []).append(pred / row.published - 1)
        outs.setdefault(row.source, []).append(oos / row.published - 1)
        lines.append(f"| {row.source} | {row.label} | {row.hardware} | {row.software} | {row.published:,.0f} | "
                     f"{pred:,.0f} | {pred / row.published - 1:+.1%} | {oos:,.0f} | {oos / row.published - 1:+.1%} | "
                     f"{'yes' if fits else 'NO'} | {how} |")
    lines += ["", "In sample (the committed profiles):", "", *summary(ins), "",
              "Out of sample (leave one source out):", "", *summary(outs, alone), "",
              "## Per stack and hardware family: the error bands (jaxpar/cost/bands.toml)", "", *stack_summary(bands), "",
              "## Per regime: the bands `estimate` prints (jaxpar/cost/bands.toml)", "",
              "Out of sample: the 10th to 90th percentile of predicted / published - 1 over a regime's runs where at "
              f"least 8 fall in it, else no calibrating run; `held-out runs inside`: the share of its runs inside "
              "the band its other sources' runs give (where those are 8 or more).", "", *regime_summary(regimes), "",
              "## Pairs: how well the model tells two published layouts apart (jaxpar/cost/bands.toml [paired])", "",
              "Two runs of one source, model, machine type, sequence length and precision in different layouts or at "
              "different scales, each predicted out of sample; the error is predicted a / b over published a / b, "
              "less 1. `plan` ties plans within the band (both orders of each pair: symmetric in the log).", "",
              *pair_table(ok, loso), "", paired.describe(), "",
              *memory_table(memory_check(ok))]
    lines += [f"{len(ok)} rows predicted, {not_fit} of them predicted not to fit in HBM; "
              f"{len(refused)} not expressible:", ""]
    lines += [f"- {row.source} {row.label}: {why}" for row, why in refused]
    lines += [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", type=pathlib.Path, default=None,
                   help="a file of published runs to read instead of the repository's (jaxpar/cost/published.py)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument("--write-bands", action="store_true", help=f"write the residuals (in and out of sample) to {BANDS.relative_to(ROOT)}")
    args = p.parse_args(argv)
    rows, skipped = read_rows(args.reference)
    analysed = analyse(rows)
    text = report(rows, skipped, write_bands=args.write_bands, analysed=analysed)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    ok, _, loso = analysed
    print(write_figure(points(ok, loso), error_bands(ok, loso), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
