"""Step time from FLOPs, HBM traffic and collectives: alpha-beta per link tier, overlap, bubble.

compute     = matmul FLOPs / (peak * matmul_efficiency) + elementwise HBM bytes / hbm_bw
              + the seconds a projection GEMM below the roofline's ridge waits on HBM (`gemm_excess`)
              (roofline, scaling book "All about rooflines"; the elementwise bytes are the activation
              inventory of memory.py produced once per forward, with `elementwise_passes` HBM passes
              per byte forward and 2x that backward, plus what the remat policy recomputes)
collective  = count * alpha * hops + wire bytes / (bandwidth * link_efficiency), hierarchically
              (hops as NCCL's tuning model counts them, `_latency`: all-gathers and reduce-scatters are
              rings through every rank, all-reduces trees across nodes):
              a group with k members per node and m nodes moves (k-1)/k of its buffer over the
              intra-node links and (m-1)/m of a 1/k slice over each device's inter-node link
              (2x both for all-reduce; NCCL tree/ring over NVLink+IB, TPU ICI+DCN)
step        = compute / (1 - bubble) + tensor comm + context comm not hidden under attention
              + pipeline permutes + expert all-to-alls (the experts wait for their tokens; x the load
              imbalance under routed dispatch) + data-parallel comm + optimizer, where the tensor,
              pipeline, expert and data-parallel terms lose what the software overlaps with compute
              (`Software.tp_overlap`, `pp_overlap`, `ep_overlap`, `dp_overlap`: explicit, sourced, per software)
Layout: canonical axis order data -> fsdp -> pipeline -> context -> expert -> tensor, innermost
fastest; `devices_per_node` consecutive devices share a node (unless the strategy names dcn parts).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

from jaxpar.collectives import A2A, AG, AR, PERMUTE, RS
from jaxpar.cost.hardware import Hardware
from jaxpar.core.strategy import AXES, Strategy
from jaxpar.errors import ConfigError

ADAMW_BYTES_PER_PARAM = 28.0  # read p, g, m, v (16) + write p, m, v (12), float32


class StepTime(NamedTuple):
    compute: float       # matmul + elementwise, per device, without the bubble
    bubble: float        # idle pipeline time added to compute
    tensor: float        # tensor / sequence parallel collectives (exposed)
    context: float       # context-parallel collectives left after overlap with attention
    pipeline: float      # stage-to-stage permutes (exposed)
    data: float          # data-parallel / ZeRO / FSDP collectives left after overlap
    optimizer: float     # AdamW update, HBM-bound
    data_total: float    # data-parallel collectives before overlap
    expert: float = 0.0  # expert-parallel all-to-alls (exposed)
    host: float = 0.0    # remat offload's copies to and from host memory beyond the compute they hide under

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tensor + self.context + self.pipeline + self.expert
                + self.data + self.optimizer + self.host)

    def terms(self) -> dict[str, float]:
        return {"compute": self.compute, "bubble": self.bubble, "tensor comm": self.tensor,
                "context comm": self.context, "pipeline comm": self.pipeline, "expert comm": self.expert,
                "data comm": self.data, "optimizer": self.optimizer, "host transfers": self.host}


def host_seconds(host_bytes: float, compute: float, hw: Hardware) -> float:
    """Exposed seconds of remat offload's host copies: each offloaded byte goes to the host in the forward
    pass and back in the backward, at the host link's achieved bandwidth (host_bw x link_efficiency);
    XLA issues them asynchronously beside the layers' compute (its host-offloading pass; MaxText's offload
    policies rely on it), so only what exceeds the compute shows."""
    if not host_bytes:
        return 0.0
    if hw.host_bw <= 0:
        raise ConfigError(f"remat=offload needs the host link's bandwidth: hardware {hw.name} gives no [links] host_bw")
    return max(0.0, 2 * host_bytes / (hw.host_bw * hw.link_efficiency) - compute)


def axis_span(axes: tuple[str, ...], st: Strategy, devices_per_node: int) -> tuple[int, int]:
    """(members per node k, nodes m) of a group over `axes`. Strides follow the canonical order; a
    strategy's `dcn` entries, when given, fix the across-node part of an axis instead."""
    return _span(axes, st.mesh, st.dcn, devices_per_node)


@functools.lru_cache(maxsize=4096)
def _span(axes: tuple[str, ...], mesh: tuple, dcn_parts: tuple, devices_per_node: int) -> tuple[int, int]:
    sizes, dcn = dict(mesh), dict(dcn_parts)
    k = n = 1
    stride = 1
    for axis in reversed(AXES):  # innermost first
        size = sizes[axis]
        if axis in axes:
            n *= size
            if dcn:
                k *= size // dcn.get(axis, 1)
            elif stride < devices_per_node:
                k *= min(size, max(1, devices_per_node // stride))
        stride *= size
    k = max(1, min(k, devices_per_node, n))
    return k, n // k


def slice_chips(st: Strategy, hw: Hardware) -> int:
    """Chips per node (TPU slice) under `st`: the strategy's devices over its dcn parts where it names them,
    else the devices up to one node's."""
    parts = 1
    for _, n in st.dcn:
        parts *= n
    return st.num_devices // parts if st.dcn else min(st.num_devices, hw.devices_per_node)


def collective_seconds(kind: str, axes: tuple[str, ...], count: float, nbytes: float, st: Strategy,
                       hw: Hardware) -> float:
    """Alpha-beta time of `count` instances of `kind` over `axes` moving `nbytes` in all (hierarchical
    ring, see module doc): linear in both, count * alpha + nbytes * beta."""
    alpha, beta = _alpha_beta(kind, axes, st, hw)
    return count * alpha + nbytes * beta


_LINKS: dict = {}  # (mesh, dcn, id(hw)) -> (hw, {(kind, axes): (alpha, beta)}): meshes repeat in a search


def _links(st: Strategy, hw: Hardware) -> dict:
    """The (alpha, beta) memo of one mesh on one hardware, keyed by (kind, axes)."""
    key = (st.mesh, st.dcn, id(hw))
    hit = _LINKS.get(key)
    if hit is None or hit[0] is not hw:
        if len(_LINKS) > 4096:
            _LINKS.clear()
        hit = _LINKS[key] = (hw, {})
    return hit[1]


def _alpha_beta(kind: str, axes: tuple[str, ...], st: Strategy, hw: Hardware,
                links: dict | None = None) -> tuple[float, float]:
    """Seconds per instance (latency) and per byte of a collective over `axes` of this mesh
    (memoised in `links`, `_links(st, hw)` unless given)."""
    links = _links(st, hw) if links is None else links
    hit = links.get((kind, axes))
    if hit is not None:
        return hit
    k, m = _span(axes, st.mesh, st.dcn, hw.devices_per_node)
    bw_in, bw_out = hw.intra_bw * hw.link_efficiency, hw.inter_bw * hw.link_efficiency
    bw_in *= hw.torus_axes(k, slice_chips(st, hw))
    if kind == PERMUTE:
        cross = m > 1
        alpha, beta = (hw.alpha_inter if cross else hw.alpha_intra), 1.0 / (bw_out if cross else bw_in)
    else:
        f = 2.0 if kind == AR else 1.0
        alpha = f * _latency(kind, m, hw.ring_steps(k, slice_chips(st, hw)), hw)
        beta = f * ((k - 1) / k / bw_in + (m - 1) / m / k / bw_out)
    links[(kind, axes)] = (alpha, beta)
    return alpha, beta


def _latency(kind: str, m: int, steps_in: int, hw: Hardware) -> float:
    """Seconds of latency of one collective (one pass for an all-reduce) over k devices per node on m nodes,
    `steps_in` ring steps inside a node (Hardware.ring_steps: k - 1 through a switch). NCCL's tuning model
    (src/graph/tuning.cc, the latencies of ncclTopoTuneModel), the algorithms it runs on large messages:
      all-gather, reduce-scatter  a ring through all k*m ranks: m(k - 1) steps inside nodes and m - 1
                                  across them (NCCL runs these as rings only: no tree);
      all-reduce                  a tree across nodes (Sanders et al. 2009's double binary tree):
                                  k - 1 steps inside a node and log2(m) across, per pass.
    A TPU slice's torus runs its rings per dimension (`steps_in`), the slices in parallel, and the ring over
    DCN after them: steps_in + (m - 1) for the first two. All-to-alls, as the all-reduce's tree."""
    if kind in (AG, RS) and m > 1:
        inside = steps_in if hw.torus_dims else m * steps_in
        return inside * hw.alpha_intra + (m - 1) * hw.alpha_inter
    return steps_in * hw.alpha_intra + math.ceil(math.log2(m)) * hw.alpha_inter


def comm_seconds(predicted: tuple[tuple, ...], st: Strategy, hw: Hardware, imbalance: float = 1.0) -> dict[str, float]:
    """Collective time per class: tensor, context (context parallelism's exchanges over `context` alone: its
    rings, gathers and scatters; an all-reduce there is a gradient sum, data), pipeline, expert (the
    all-to-alls over `expert`, bytes x `imbalance`), data (everything else over data-like axes).
    `predicted`: (kind, axes, phase, count, bytes) tuples from comm.predicted."""
    out = {"tensor": 0.0, "context": 0.0, "pipeline": 0.0, "expert": 0.0, "data": 0.0}
    links = _links(st, hw)
    for kind, axes, _phase, count, nbytes in predicted:
        cls = ("tensor" if "tensor" in axes else "context" if axes == ("context",) and kind != AR
               else "pipeline" if "pipeline" in axes else "expert" if kind == A2A and axes == ("expert",) else "data")
        alpha, beta = _alpha_beta(kind, axes, st, hw, links)
        out[cls] += count * alpha + nbytes * beta * (imbalance if cls == "expert" else 1.0)
    return out


def compute_seconds(matmul_flops: float, hbm_bytes: float, hw: Hardware, fp8_flops: float = 0.0,
                    core_flops: float = 0.0, core_efficiency: float = 0.0) -> float:
    """Roofline sum: matmuls at the calibrated efficiency, elementwise work at HBM bandwidth; `fp8_flops`
    of the matmuls (float8 linears) at the device's float8 peak (Hardware.matmul_peak), and `core_flops`
    (attention cores) at `core_efficiency` of the bf16 peak where the attention kernel has its own
    (Hardware.flash2_efficiency), else as the other matmuls."""
    eff = hw.matmul_efficiency
    fp8 = fp8_flops / (hw.matmul_peak("float8") * eff) if fp8_flops else 0.0
    cores = core_flops / (hw.peak_flops * core_efficiency) if core_efficiency else 0.0
    rest = matmul_flops - fp8_flops - (core_flops if core_efficiency else 0.0)
    return rest / (hw.peak_flops * eff) + fp8 + cores + hbm_bytes / hw.hbm_bw


class GemmRun(NamedTuple):
    """How a step's projection GEMMs run on a device (`gemm_excess`): M = `tokens` per micro-batch (the gathered
    sequence under sequence parallelism), K or N split over `tensor`, the routed experts' grouped GEMM over
    E / `expert` weights with `rows` copies per token, at `rate` FLOP/s (the calibrated matmul rate) and
    `hbm_bw` bytes/s, `operand_bytes` and `output_bytes` per element."""
    tokens: float
    tensor: int
    expert: int
    rows: float
    rate: float
    hbm_bw: float
    operand_bytes: float
    output_bytes: float


def gemm_excess(shapes: tuple[tuple[str, int, int, str, int], ...], run: GemmRun) -> tuple[tuple[str, float], ...]:
    """(block kind, seconds) that one pass of each projection GEMM takes beyond its FLOPs at `run.rate`, where
    it is bound by HBM instead: the roofline (Williams et al. 2009; the scaling book, "All about rooflines").
    A GEMM of an M x K input and a K x N weight does 2MKN FLOPs and moves MK + KN operand and MN output
    elements, so one whose smaller dimension falls below about rate / hbm_bw FLOPs per byte (a short
    micro-batch, a narrow per-device slice under wide tensor parallelism, an expert that receives few tokens)
    waits on memory. `shapes`: flops.projection_shapes. The input and weight gradients move as many elements
    and do as many FLOPs as the forward, so a pass of each costs the same. Compute-bound GEMMs are left out;
    tile and wave quantisation (NVIDIA, "Matrix Multiplication Background") are not modelled."""
    out = []
    for kind, k, n, split, experts in shapes:
        k, n = (k, n / run.tensor) if split == "n" else (k / run.tensor, n) if split == "k" else (k, n)
        m_rows, weights = (run.tokens * run.rows, experts / run.expert * k * n) if experts else (run.tokens, k * n)
        excess = ((run.operand_bytes * (m_rows * k + weights) + run.output_bytes * m_rows * n) / run.hbm_bw
                  - 2.0 * m_rows * k * n / run.rate)
        if excess > 0.0:
            out.append((kind, excess))
    return tuple(out)


def decomposed_hideable(tensor_s: float, linear_s: float, ops: tuple[tuple[int, float], ...], rerun: bool) -> float:
    """Seconds of the tensor collectives that collective matmuls can hide, when each collective hides under
    its own GEMM only (Wang et al. 2023, sec. 3: the ring of an all-gather runs beside the partial matmuls of
    the GEMM that consumes it, a reduce-scatter's beside the GEMM that produces it; PyTorch's async TP fuses
    exactly these all_gather+matmul and matmul+reduce_scatter pairs). `ops`: the model's projection GEMMs
    (flops.projection_ops), one collective of equal bytes beside each, so each instance carries
    tensor_s / (their count). A collective runs once per forward pass (twice under a full rerun) and once in
    the backward pass, beside the input-gradient GEMM of its op's size, not the weight-gradient one: of the
    op's GEMM seconds (`linear_s` split by FLOPs) the passes with a collective hold (2 + rerun) / (3 + rerun).
    A small GEMM under wide TP (a narrow QKV, an output projection over few heads) hides less than its
    collective takes; the large MLP GEMMs cannot lend it their spare time."""
    count = sum(n for n, _ in ops)
    flops = sum(n * g for n, g in ops)
    if not count or not flops:
        return linear_s
    one = tensor_s / count
    beside = linear_s * (3.0 if rerun else 2.0) / (4.0 if rerun else 3.0) / flops
    return sum(n * min(one, beside * g) for n, g in ops)


class Busy(NamedTuple):
    """What a device computes in one step, in seconds: `compute` (matmuls, HBM-bound work, GEMM waits; without
    the bubble), of which `attention_core` is attention-score work (what context exchanges hide under), the
    pipeline's idle fraction `bubble`, the most tensor-collective seconds the projection GEMMs can hide
    (`linear`, decomposed_hideable; None: the compute) and remat offload's exposed host copies (`host`)."""
    compute: float
    attention_core: float = 0.0
    bubble: float = 0.0
    linear: float | None = None
    host: float = 0.0


class Hiding(NamedTuple):
    """The share of each class of collective a stack issues beside independent compute (jaxpar/cost/software.py
    tp_overlap, pp_overlap, ep_overlap, dp_overlap; jaxpar's program's: jaxpar/cost/overlap.py), and the share
    of the attention core context exchanges hide under (`context`: cp_hide, 1/context where only the diagonal
    block's kernel covers them)."""
    tensor: float = 0.0
    pipeline: float = 0.0
    data: float = 0.0
    expert: float = 0.0
    context: float = 1.0


def step_time(busy: Busy, comm: dict[str, float], hiding: Hiding, optimizer_params: float, hw: Hardware) -> StepTime:
    """Combine the terms (module docstring). Context exchanges hide under the attention core (Liu et al. 2023),
    `hiding.context` of it; then each class's `hiding` share hides under compute, tensor first, then pipeline,
    expert and data, never more in all than the compute there is (data-parallel reductions under the backward
    pass and the distributed optimizer's gathers under the next forward: together, under the whole step): a
    second of compute hides one second of collectives, which share the device's links and its collective
    engine (NCCL's channels, the TPU's DMA queues). A tensor collective decomposed into the GEMM that consumes
    or produces it hides under that GEMM and nothing else (Wang et al. 2023; Transformer Engine's
    userbuffers, PyTorch's async TP): at most `busy.linear`. `optimizer_params`: elements AdamW updates."""
    hidden_cp = min(comm["context"], busy.attention_core * hiding.context)
    free = busy.compute - hidden_cp   # one compute hides each collective second once: the links are shared too
    hidden_tp = min(hiding.tensor * comm["tensor"], free if busy.linear is None else min(busy.linear, free))
    free -= hidden_tp
    hidden_pp = min(hiding.pipeline * comm["pipeline"], free)
    free -= hidden_pp
    expert = comm.get("expert", 0.0)
    hidden_ep = min(hiding.expert * expert, free)
    free -= hidden_ep
    data = comm["data"]
    hidden_dp = min(hiding.data * data, free)
    bubble = busy.bubble
    return StepTime(compute=busy.compute, bubble=busy.compute * bubble / (1.0 - bubble) if bubble else 0.0,
                    tensor=comm["tensor"] - hidden_tp, context=comm["context"] - hidden_cp,
                    pipeline=comm["pipeline"] - hidden_pp, expert=expert - hidden_ep, data=data - hidden_dp,
                    optimizer=optimizer_params * ADAMW_BYTES_PER_PARAM / hw.hbm_bw, data_total=data, host=busy.host)
