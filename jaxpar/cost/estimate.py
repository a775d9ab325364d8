"""`estimate`: the whole analytic model for one (model, strategy, hardware, batch, seq).

Pure function; every number it returns comes from flops.py, memory.py, comm.py and time.py, whose
docstrings state each formula and its source. `Estimate.to_json()` is the docs/design.md `estimate`
contract (collectives, flops_per_step, step_time_s, mfu, tokens_per_s, memory, fits) plus extras.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxpar.cost import band, comm, energy, flops, memory, overlap, params, program_flops, program_memory, shape, time
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.cost.software import JAXPAR, Software, check_platform, program_kernel, program_traits
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

# The share of HBM `jaxpar plan` and `jaxpar estimate` keep free for what the model does not count: the
# runtime's own buffers (XLA's scratch and collective buffers, NCCL's channels, the CUDA context, allocator
# fragmentation). PyTorch and JAX users budget 5-10% of device memory for these; 8% is the default of
# --hbm-headroom.
HBM_HEADROOM = 0.08


class Estimate(NamedTuple):
    model: str
    strategy: str
    hardware: str
    software: str
    devices: int
    global_batch: int
    seq: int
    mesh: tuple[tuple[str, int], ...]
    predicted: tuple[tuple, ...]        # (kind, axes, phase, count, bytes): see `collectives`
    flops: flops.StepFlops
    time: time.StepTime
    memory: memory.Memory
    hbm_bytes: float
    peak_flops: float
    busy: tuple[float, float, float] = (0.0, 0.0, 0.0)  # seconds of matmuls, HBM-bound work, collectives
    power: tuple[float, float] = (0.0, 0.0)             # the profile's (tdp_w, idle_w)
    headroom: float = 0.0                               # share of HBM kept free before a plan "fits"
    family: str = ""                                    # the hardware's calibration family (jaxpar/cost/band.py)
    causal: bool = False                                # the kernels compute only the causal triangle
    host_memory: float = 0.0                            # the profile's host DRAM per device (0: unknown)
    regime: str = ""                                    # the layout's error regime (jaxpar/cost/band.py)

    @property
    def energy(self) -> energy.Energy | None:
        """Energy per step and per token (jaxpar/cost/energy.py); None without a power model."""
        return energy.step_energy(self.step_time_s, *self.busy, self.devices, self.global_batch * self.seq,
                                  *self.power)

    @property
    def collectives(self) -> list[comm.Collective]:
        """The predicted collectives as the HLO tally's records (built on demand: planners skip it)."""
        return comm.to_records(self.predicted, dict(self.mesh))

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq / self.time.total

    @property
    def mfu(self) -> float:
        """Model FLOPs / (step time * devices * peak) (Chowdhery et al. 2022, appendix B)."""
        return self.flops.model / (self.time.total * self.devices * self.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs (recompute included) / (step time * devices * peak)."""
        return self.flops.hardware / (self.time.total * self.devices * self.peak_flops)

    @property
    def usable_bytes(self) -> float:
        """The memory per device a step may use: HBM less the `headroom` share (HBM_HEADROOM)."""
        return (1.0 - self.headroom) * self.hbm_bytes

    @property
    def usable_host_bytes(self) -> float:
        """The host memory per device remat offload may use: the same share as `usable_bytes` (0: unstated)."""
        return (1.0 - self.headroom) * self.host_memory

    @property
    def host_fits(self) -> bool:
        """Remat offload's bytes within `usable_host_bytes` (unbounded where the profile does not state it)."""
        return not self.host_memory or self.memory.host <= self.usable_host_bytes

    @property
    def fits(self) -> bool:
        """The one fit rule of `plan` and `estimate`: memory per device within the usable HBM, and what remat
        offload keeps in host memory within the usable share of the device's host memory."""
        return self.memory.total <= self.usable_bytes and self.host_fits

    @property
    def dominant(self) -> str:
        terms = self.time.terms()
        return max(terms, key=terms.__getitem__)

    def to_json(self) -> dict:
        mem, colls = self.memory, self.collectives
        return {
            "model": self.model, "strategy": self.strategy, "hardware": self.hardware, "software": self.software,
            "mesh": dict(self.mesh), "devices": self.devices, "global_batch": self.global_batch, "seq": self.seq,
            "collectives": [{"kind": c.kind, "axes": list(c.axes), "count": c.count, "bytes": c.bytes,
                             "wire_bytes": round(c.wire_bytes), "phase": c.phase} for c in colls],
            "totals": {"count": sum(c.count for c in colls), "bytes": sum(c.bytes for c in colls),
                       "wire_bytes": round(sum(c.wire_bytes for c in colls))},
            "flops_per_step": self.flops.model, "hardware_flops_per_step": self.flops.hardware,
            "flops_by_block": {name: mm for name, mm, _ in self.flops.by_block},
            "step_time_s": self.step_time_s, "mfu": self.mfu, "hfu": self.hfu, "tokens_per_s": self.tokens_per_s,
            "memory": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                       "activations": mem.activations, "total": mem.total, "host": mem.host},
            "fits": self.fits, "hbm_bytes": self.hbm_bytes, "hbm_headroom": self.headroom,
            "host_memory": self.host_memory, "host_fits": self.host_fits,
            "time_breakdown_s": self.time.terms(), "dominant": self.dominant,
            "energy": dataclasses.asdict(self.energy) if self.energy else None,
            "band": band.regime_band(self.regime).to_json(),
        }


# ---- the stages, each over the step's records -------------------------------------------------------

class Step(NamedTuple):
    """One training step's question as the stages read it: the model, the layout, the hardware, the stack
    (its traits under this layout and hardware: software.program_traits), the batch and sequence, how the
    step is cut up on a device (`shape`), and the most loaded expert's tokens over the mean (`imbalance`)."""
    model: ModelConfig
    strategy: Strategy
    hardware: Hardware
    software: Software
    global_batch: int
    seq: int
    shape: shape.StepShape
    imbalance: float = 1.0

    @property
    def devices(self) -> int:
        return self.strategy.num_devices


def question(model: ModelConfig, strategy: Strategy, hardware: Hardware | str, global_batch: int, seq: int,
             software: Software = JAXPAR, imbalance: float = 1.0) -> Step:
    """The step to estimate, its shape on a device (shape.step_shape), refused in one line where the model or
    the layout is one the cost model does not count. Divisibility is jaxpar.core.validate.check's."""
    check_modelled(model)
    check_modelled_layout(model, strategy)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    check_platform(software, hw)
    if strategy.num_devices < 1:
        raise ConfigError(f"mesh {strategy.name}: resolve the -1 axis (Strategy.resolved) before estimating")
    return Step(model, strategy, hw, program_traits(software, strategy, hw.platform), global_batch, seq,
                shape.step_shape(model, strategy, global_batch, seq), imbalance)


class Work(NamedTuple):
    """What a device computes in the step: the step's FLOPs (`flops`, all devices), the policy whose
    recompute the layers run (`remat`), expert rows per token (`rows`), the share of the head it runs
    (`head`), and per device on the critical path: matmul FLOPs (`matmul`), the attention cores' model
    FLOPs (`core`) and with their reruns (`cores`), the matmul FLOPs run in float8 (`low`) and the HBM
    bytes of bandwidth-bound work (`hbm`)."""
    flops: flops.StepFlops
    remat: str
    rows: float
    head: float
    matmul: float
    core: float
    cores: float
    low: float
    hbm: float


def work(step: Step) -> Work:
    """The FLOPs stage: the textbook's (flops.py) under the stack's kernels, for jaxpar's program with what its
    pipelines recompute and where they run the head (program_flops.py); on the critical path the layers split
    over the devices, the head as its share says, the routed experts the most loaded device's (`imbalance` x
    the mean; static buffers do not vary). A ring or a fused kernel recomputes QK^T backward."""
    m, st, sh, sw, n = step.model, step.strategy, step.shape, step.software, step.devices
    own, context = sw.jaxpar_program, st.sizes["context"]
    ring = st.options.attention == "ring" and context > 1
    rows = flops.expert_rows(m, step.seq, context, sw.moe_padded)
    remat = program_flops.recompute_policy(st, sh) if own else st.options.remat
    kernels = flops.Kernels(causal=sw.causal, rerun_qk=ring or sw.fused_attention, rerun_outputs=sw.rerun_outputs,
                            rows=rows if m.moe_layers else None, every_other_mm=sw.sac_every_other_mm)
    fl = flops.step_flops(m, remat, step.global_batch, step.seq, kernels)
    head = shape.head_share(sh, sw.pp_head_spread)
    if own:
        fl = program_flops.chunk_recompute(fl, m, st, sh, step.global_batch, step.seq, kernels)
        fl = program_flops.pipeline_padding(fl, m, sh, remat, step.global_batch, step.seq, kernels)
        head = program_flops.head_share(st, sh, head)
    experts = 0.0 if sw.moe_padded else fl_experts(fl) * (step.imbalance - 1.0)
    matmul = (fl.layers + fl.recompute + fl.padding + experts) / n + fl.head * head / n
    matmul += replicated_over_tensor(step, remat)
    hbm = elementwise_hbm_bytes(step, rows, head / sh.stages)
    hbm += float8_cast_bytes(m, st, sh, remat, rows if m.moe_layers else 0.0)
    core = (flops.attention_core_flops(m, step.global_batch, step.seq, sw.causal).matmul
            * (m.attention_layers + m.moe_layers) * flops.TRAIN_FACTOR / n)
    cores = core / flops.TRAIN_FACTOR * flops.core_passes(remat, kernels.rerun_qk, sw.rerun_outputs)
    scaled = program_fp8_share(fl) if own else 1.0
    return Work(fl, remat, rows, head, matmul, core, cores, fp8_share(st, matmul, cores, fl.head * head / n, scaled),
                hbm)


def replicated_over_tensor(step: Step, remat: str) -> float:
    """Matmul FLOPs per device beyond an even split: what every tensor rank computes whole
    (flops.tensor_replicated_flops: latent attention's down-projections, W_eh), (t - 1) / t of it, forward
    and backward (and a full recompute's rerun, counted on all of it: the MTP modules are not recomputed)."""
    t = step.strategy.sizes["tensor"]
    passes = flops.TRAIN_FACTOR + (1.0 if flops.unit_policy(remat) == "full" else 0.0)
    return flops.tensor_replicated_flops(step.model, step.global_batch * step.seq) * passes * (t - 1) / step.devices


def step_memory(step: Step) -> memory.Memory:
    """The memory stage: the textbook's accounting under the stack's traits (memory.py), or what jaxpar's
    program keeps and XLA's buffers hold (program_memory.py) under the attention kernel it runs there."""
    m, st, hw = step.model, step.strategy, step.hardware
    if step.software.jaxpar_program:
        return program_memory.memory(m, st, step.global_batch, step.seq, program_kernel(st, hw.platform), hw.platform)
    return memory.memory(m, st, step.global_batch, step.seq, memory.Traits.of(step.software))


def step_time(step: Step, w: Work, predicted: tuple[tuple, ...], mem: memory.Memory) -> tuple[time.StepTime, tuple]:
    """The time stage (time.py): roofline compute (matmuls at the calibrated rate, float8 linears at the float8
    peak, a FlashAttention-2 core at its own; HBM-bound work; GEMMs below the ridge), alpha-beta collectives,
    the stack's overlap, the bubble, the optimizer. Also (matmul, HBM-bound, collective) seconds for energy."""
    st, sw, hw, sh = step.strategy, step.software, step.hardware, step.shape
    core_eff = hw.flash2_efficiency if sw.attention_kernel == "flash2" else 0.0
    waits = gemm_waits(step, w)
    compute = time.compute_seconds(w.matmul, w.hbm, hw, w.low, w.cores, core_eff) + waits
    matmul_s = time.compute_seconds(w.matmul, 0.0, hw, w.low, w.cores, core_eff) + waits
    skew = 1.0 if sw.moe_padded else step.imbalance
    comm_s = time.comm_seconds(predicted, st, hw, skew)
    linear_s = matmul_s - time.compute_seconds(w.cores, 0.0, hw, 0.0, w.cores, core_eff)
    busy = time.Busy(compute=compute, attention_core=time.compute_seconds(w.core, 0.0, hw, 0.0, w.core, core_eff),
                     bubble=sh.bubble, host=time.host_seconds(mem.host, compute, hw),
                     linear=time.decomposed_hideable(comm_s["tensor"], linear_s, flops.projection_ops(step.model),
                                                     flops.unit_policy(w.remat) == "full"))
    tensor, pipeline, data = overlap.fractions(sw, st, predicted, hw, skew)
    hiding = time.Hiding(tensor=tensor, pipeline=pipeline, data=data, expert=sw.ep_overlap,
                         context=1.0 / st.sizes["context"] if sw.cp_hide == "diagonal" else 1.0)
    t = time.step_time(busy, comm_s, hiding, optimizer_params(step), hw)
    return t, (matmul_s, w.hbm / hw.hbm_bw, sum(comm_s.values()))


def optimizer_params(step: Step) -> float:
    """Elements of one optimizer moment a device updates (memory.local_params, sharded as the stack's state)."""
    other = not step.software.jaxpar_program
    sw = step.software
    return memory.local_params(step.model, step.strategy, "optimizer", sw.state_over_context and other,
                               sw.fsdp_over_context and other, sw.pp_end_stages and other)


def estimate(model: ModelConfig, strategy: Strategy, hardware: Hardware | str, global_batch: int, seq: int,
             software: Software = JAXPAR, imbalance: float = 1.0, headroom: float = 0.0) -> Estimate:
    """Predict one training step of `software` (jaxpar by default; a stack's preset for its published runs), in
    the order the scaling book reads a step: its shape, its FLOPs, its collectives (comm.py: the textbook's,
    then what jaxpar's program, the compiler and the stack make of them), its memory and the time all of it
    takes on the hardware. `imbalance` (MoE, >= 1): the most loaded expert's tokens over the mean (routed
    dispatch: the experts' compute and the all-to-all bytes on the critical path). `headroom`: the share of
    HBM kept free before the step `fits` (the commands and the planner: HBM_HEADROOM)."""
    step = question(model, strategy, hardware, global_batch, seq, software, imbalance)    # shape
    w = work(step)                                                                       # FLOPs
    predicted = comm.predicted(step.model, step.strategy, step.shape, step.software)      # collectives
    mem = step_memory(step)                                                              # memory
    t, busy = step_time(step, w, predicted, mem)                                         # time
    hw = step.hardware
    return Estimate(model=model.name, strategy=strategy.name, hardware=hw.name, software=step.software.name,
                    devices=step.devices, global_batch=global_batch, seq=seq, mesh=strategy.mesh, predicted=predicted,
                    flops=w.flops, time=t, memory=mem, hbm_bytes=hw.hbm_bytes, peak_flops=hw.peak_flops, busy=busy,
                    power=(hw.tdp_w, hw.idle_w), headroom=headroom, family=hw.family, causal=step.software.causal,
                    host_memory=hw.host_memory, regime=band.regime(step.software.name, hw.family, strategy.options.dtype,
                                                                   strategy.sizes, bool(model.moe_layers)))


# ---- the terms the stages read ------------------------------------------------------------------------

def elementwise_hbm_bytes(step: Step, rows: float = 0.0, head_share: float = 1.0) -> float:
    """HBM bytes of bandwidth-bound work per device per step (useful work; the bubble is added later):
    passes x (3 x produced + recomputed) bytes per token per layer (forward 1x, backward 2x; `passes`: the
    profile's elementwise_passes), plus the float32 logits (3 x passes x T x V/t x 4 bytes x `head_share`,
    the share of the local batch whose head this device runs). MoE layers: `rows` expert rows per token
    (flops.expert_rows). A fused attention kernel keeps no scores in HBM."""
    m, st, sh, sw = step.model, step.strategy, step.shape, step.software
    o, t = st.options, st.sizes["tensor"]
    act, sp = memory.ACTIVATION_BYTES[o.dtype], o.sequence_parallel
    total = 0.0
    keys = memory.keys_per_query(st, step.seq, sw.fused_attention)
    attn = memory.attention_inventory(m, keys, sw.dropout)
    na, nm, ne = params.block_counts(m)
    moe = memory.moe_inventory(m, keys, rows, sw.dropout) if ne else ()
    for layers, inv in ((na, attn), (nm, memory.mamba_inventory(m)), (ne, moe)):
        if layers:
            produced = memory.inventory_bytes(inv, act, t, sp, "none")
            redo = memory.recomputed_bytes(inv, act, t, sp, o.remat)
            total += layers / sh.stages * (3.0 * produced + redo)
    logits = 3.0 * m.vocab / t * memory.LOGIT_BYTES * head_share
    return step.hardware.elementwise_passes * sh.b_loc * sh.s_loc * (total + logits)


FLOAT8_CAST_BYTES = 4  # per element: read in bf16 (2), written in float8 row- and column-major (1 + 1)


def float8_operands(m: ModelConfig, t: int, rows: float) -> tuple[float, float]:
    """(inputs, outputs): elements per token, over the layer stack, of the float8 linears' operands on one
    tensor rank: each distinct input a layer's linears read (the normed stream once for Q, K and V, once
    for the MLP's gate and up) and each output whose gradient the backward pass reads. The routed
    experts' count `rows` copies per token; the router stays in higher precision."""
    d, hd, f, fe = m.d_model, m.head_dim, m.mlp_dim / t, m.moe_mlp_dim / t
    q, kv = m.heads * hd / t, m.kv_heads * hd / t
    mlp_out = (2 if m.mlp_type == "swiglu" else 1)
    attention_in, attention_out = d + q, q + 2 * kv + d
    ssm = m.ssm_heads * m.ssm_head_dim / t if m.mamba_layers else 0.0
    shared = m.shared_experts * fe
    blocks = {"A": (attention_in + d + f, attention_out + mlp_out * f + d),
              "M": (d + ssm, 2 * ssm + (2 * m.ngroups * m.d_state + m.ssm_heads) / t + d),
              "E": (attention_in + rows * (d + fe) + (d + shared if shared else 0.0),
                    attention_out + rows * (2 * fe + d) + (2 * shared + d if shared else 0.0))}
    return (sum(n * sum(blocks[b][0] for b in unit) for unit, n in m.runs),
            sum(n * sum(blocks[b][1] for b in unit) for unit, n in m.runs))


def float8_cast_bytes(m: ModelConfig, st: Strategy, sh: shape.StepShape, remat: str, rows: float) -> float:
    """HBM bytes per device per step of casting the float8 linears' operands (dtype float8; else 0): each
    input once per forward pass the layer runs (twice under full recompute), each output gradient once,
    FLOAT8_CAST_BYTES per element. Source: torchao's float8 roofline (torchao/testing/float8/
    roofline_utils.py, `get_tensor_memory_traffic_ovhd_s`, tensorwise scaling: the cast reads bf16 and
    writes float8 twice, row- and column-major, the amax read fused into the producer under
    torch.compile), the same bytes as Transformer Engine's cast-transpose (its amax from the history
    of delayed scaling). The weights' casts, once per step on a shard, are left out."""
    if st.options.dtype != "float8":
        return 0.0
    inputs, outputs = float8_operands(m, st.sizes["tensor"], rows)
    forwards = 2.0 if flops.unit_policy(remat) == "full" else 1.0
    return FLOAT8_CAST_BYTES * sh.b_loc * sh.s_loc / sh.stages * (forwards * inputs + outputs)


@params.per_model   # once per model, not per candidate
def check_modelled(model: ModelConfig) -> None:
    """The analytic model counts attention, Mamba-2 and MoE blocks (every block models/ builds); kept
    as the one place a future block that it does not count is refused."""
    unknown = set(model.layer_kinds) - set("AME")
    if unknown:
        raise ConfigError(f"model {model.name}: the cost model does not model blocks {sorted(unknown)} "
                          f"(pattern={model.pattern!r})")


def check_modelled_layout(model: ModelConfig, strategy: Strategy) -> None:
    """Layouts a run takes that the training cost model does not count yet, refused rather than
    mispriced: tensor > kv_heads, where K/V heads are replicated across tensor ranks (jaxpar.core.sharding.
    model_layout): their weights, FLOPs and gradient reductions (dK and dV summed over the ranks that
    share a head, then gathered) differ from the sharded case the model counts. Inference costs it
    (jaxpar/cost/inference.py)."""
    t = strategy.sizes["tensor"]
    if model.has_attention and t > model.kv_heads:
        raise ConfigError(f"tensor={t} > kv_heads={model.kv_heads}: K/V heads replicated across tensor ranks train, "
                          "but the training cost model does not count the replication yet; estimate "
                          f"tensor <= {model.kv_heads}")


def fl_experts(fl: flops.StepFlops) -> float:
    """The routed experts' model FLOPs of a step (flops.StepFlops.by_block)."""
    return sum(mm for name, mm, _ in fl.by_block if name == "moe experts")


def fp8_share(st: Strategy, matmul: float, core: float, head: float, scaled: float = 1.0) -> float:
    """The matmul FLOPs per device a float8 step runs in float8: the linear layers', not the attention
    cores' (`core`: forward, backward and recomputed; QK^T and PV stay bf16 in Transformer Engine's and torchao's float8 recipes) nor the head's
    (torchtitan and Megatron keep the output projection in bf16); of those, the share `scaled` (every linear
    in other stacks: 1; jaxpar's program: `program_fp8_share`). 0 unless dtype=float8."""
    return max(0.0, matmul - core - head) * scaled if st.options.dtype == "float8" else 0.0


PROGRAM_FP8 = ("attention qkvo", "mlp", "moe experts", "moe shared experts")   # jaxpar/ops/fp8.py's GEMMs


def program_fp8_share(fl: flops.StepFlops) -> float:
    """The share of the linear layers' model FLOPs jaxpar's float8 step scales (PROGRAM_FP8: attention, MLP
    and expert projections; the router, Mamba-2's projections and the MTP modules' blocks stay bfloat16)."""
    linear = {name: mm for name, mm, _ in fl.by_block if name not in ("attention scores", "embedding+head")}
    total = sum(linear.values())
    return sum(linear.get(name, 0.0) for name in PROGRAM_FP8) / total if total else 0.0


GEMM_OPERAND_BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}   # a projection GEMM's operands (float8's outputs: bf16)


def gemm_waits(step: Step, w: Work) -> float:
    """Seconds per device the step's projection GEMMs wait on HBM beyond their FLOPs (time.gemm_excess, per
    pass) in the strategy's dtype (float8 linears read 1-byte operands at the float8 peak), in every pass they
    run: forward, the two gradients and a full rerun, for each layer execution of their block kind."""
    st, sh, hw = step.strategy, step.shape, step.hardware
    dtype, sizes = st.options.dtype, st.sizes
    operand = GEMM_OPERAND_BYTES[dtype]
    run = time.GemmRun(sh.mb * sh.s_loc, sizes["tensor"], sizes["expert"], w.rows,
                       hw.matmul_peak(dtype) * hw.matmul_efficiency, hw.hbm_bw, operand, 2 if dtype == "float8" else operand)
    waits = per_pass_waits(step.model, run)
    if not waits:
        return 0.0
    executions = {"attention": sh.exec_attention + sh.exec_moe, "mlp": sh.exec_attention, "experts": sh.exec_moe,
                  "mamba": sh.exec_mamba}
    passes = flops.TRAIN_FACTOR + (1.0 if flops.unit_policy(w.remat) == "full" else 0.0)
    return passes * sum(executions[kind] * seconds for kind, seconds in waits)


@params.per_model  # a planner's candidates share their per-device GEMM shapes
def per_pass_waits(m: ModelConfig, run: time.GemmRun) -> tuple[tuple[str, float], ...]:
    """time.gemm_excess of `m`'s projection GEMMs (flops.projection_shapes)."""
    return time.gemm_excess(flops.projection_shapes(m), run)
