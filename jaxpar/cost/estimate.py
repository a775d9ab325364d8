"""`estimate`: the whole analytic model for one (model, strategy, hardware, batch, seq).

Pure function; every number it returns comes from flops.py, memory.py, comm.py and time.py, whose
docstrings state each formula and its source. `Estimate.to_json()` is the docs/design.md `estimate`
contract (collectives, flops_per_step, step_time_s, mfu, tokens_per_s, memory, fits) plus extras.
"""
from __future__ import annotations

import dataclasses

from jaxpar.cost import comm, energy, flops, memory, overlap, params, program_flops, program_memory, shape, time
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.cost.software import JAXPAR, Software, program_kernel, program_traits
from jaxpar.errors import ConfigError
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

# The share of HBM `jaxpar plan` and `jaxpar estimate` keep free for what the model does not count: the
# runtime's own buffers (XLA's scratch and collective buffers, NCCL's channels, the CUDA context, allocator
# fragmentation). PyTorch and JAX users budget 5-10% of device memory for these; 8% is the default of
# --hbm-headroom.
HBM_HEADROOM = 0.08


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
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
    causal: bool = False                                # model FLOPs count the causal triangle of the scores
    host_memory: float = 0.0                            # the profile's host DRAM per device (0: unknown)

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
        }


def elementwise_hbm_bytes(m: ModelConfig, st: Strategy, sh: shape.StepShape, seq: int, passes: float,
                          dropout: bool, rows: float = 0.0, fused: bool = False, head_share: float = 1.0) -> float:
    """HBM bytes of bandwidth-bound work per device per step (useful work; the bubble is added later):
    passes * (3 * produced + recomputed) bytes per token per layer (forward 1x, backward 2x), plus the
    float32 logits (3 * passes * T*V/t*4 bytes x `head_share`, the share of the local batch whose head
    this device runs: 1, or ceil(M/S)/M where the pipeline spreads the head over its stages). MoE layers:
    `rows` expert rows per token (flops.expert_rows). `fused`: a fused attention kernel (no scores in HBM)."""
    o, t = st.options, st.sizes["tensor"]
    act, sp = memory.DTYPE_BYTES[o.dtype], o.sequence_parallel
    tokens = sh.b_loc * sh.s_loc
    total = 0.0
    keys = memory.keys_per_query(st, seq, fused)
    attn = memory.attention_inventory(m, keys, dropout)
    na, nm, ne = params.block_counts(m)
    moe = memory.moe_inventory(m, keys, rows, dropout) if ne else ()
    for layers, inv in ((na, attn), (nm, memory.mamba_inventory(m)), (ne, moe)):
        if layers:
            produced = memory.inventory_bytes(inv, act, t, sp, "none")
            redo = memory.recomputed_bytes(inv, act, t, sp, o.remat)
            total += layers / sh.stages * (3.0 * produced + redo)
    logits = 3.0 * m.vocab / t * memory.LOGIT_BYTES * head_share
    return passes * tokens * (total + logits)


FLOAT8_CAST_BYTES = 4  # per element: read in bf16 (2), written in float8 row- and column-major (1 + 1)


def float8_operands(m: ModelConfig, t: int, rows: float) -> tuple[float, float]:
    """(inputs, outputs): elements per token, per pattern unit, of the float8 linears' operands on one
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
    return (sum(blocks[b][0] for b in m.pattern), sum(blocks[b][1] for b in m.pattern))


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
    return FLOAT8_CAST_BYTES * sh.b_loc * sh.s_loc * m.units / sh.stages * (forwards * inputs + outputs)


def check_modelled(model: ModelConfig) -> None:
    """The analytic model counts attention, Mamba-2 and MoE blocks (every block models/ builds); kept
    as the one place a future block that it does not count is refused."""
    unknown = set(model.pattern) - set("AME")
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


def fp8_share(st: Strategy, matmul: float, core: float, head: float) -> float:
    """The matmul FLOPs per device a float8 step runs in float8: every linear layer's, not the attention
    cores' (`core`: forward, backward and recomputed; QK^T and PV stay bf16 in Transformer Engine's and torchao's float8 recipes) nor the head's
    (torchtitan and Megatron keep the output projection in bf16). 0 unless dtype=float8."""
    return max(0.0, matmul - core - head) if st.options.dtype == "float8" else 0.0


ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float8": 1}   # a projection GEMM's operands per dtype (float8's outputs: bf16)


def gemm_waits(m: ModelConfig, st: Strategy, sh: shape.StepShape, remat: str, rows: float, hw: Hardware) -> float:
    """Seconds per device the step's projection GEMMs wait on HBM beyond their FLOPs (time.gemm_excess, per
    pass) in the strategy's dtype (float8 linears read 1-byte operands at the float8 peak), in every pass
    they run: forward, the two gradients and a full rerun, for each layer execution of their block kind."""
    dtype, sizes = st.options.dtype, st.sizes
    operand = ELEMENT_BYTES[dtype]
    waits = per_pass_waits(m, sh.mb * sh.s_loc, sizes["tensor"], sizes["expert"], rows,
                           hw.matmul_peak(dtype) * hw.matmul_efficiency, hw.hbm_bw, operand,
                           2 if dtype == "float8" else operand)
    if not waits:
        return 0.0
    executions = {"attention": sh.exec_attention + sh.exec_moe, "mlp": sh.exec_attention, "experts": sh.exec_moe,
                  "mamba": sh.exec_mamba}
    passes = flops.TRAIN_FACTOR + (1.0 if flops.unit_policy(remat) == "full" else 0.0)
    return passes * sum(executions[kind] * seconds for kind, seconds in waits)


@params.per_model  # a planner's candidates share their per-device GEMM shapes
def per_pass_waits(m: ModelConfig, tokens: float, tensor: int, expert: int, rows: float, rate: float, hbm_bw: float,
                   operand: int, output: int) -> tuple[tuple[str, float], ...]:
    """time.gemm_excess of `m`'s projection GEMMs (flops.projection_shapes)."""
    return time.gemm_excess(flops.projection_shapes(m), tokens, tensor, expert, rows, rate, hbm_bw, operand, output)


def estimate(model: ModelConfig, strategy: Strategy, hardware: Hardware | str, global_batch: int, seq: int,
             software: Software = JAXPAR, imbalance: float = 1.0, headroom: float = 0.0) -> Estimate:
    """Predict one training step of `software` (jaxpar by default; MEGATRON for the published runs).
    Top-down: the step's shape; its FLOPs (the textbook's under the software's traits, then, for jaxpar's
    own program, program_flops.py's adjustments); its collectives (comm.py: what the compiled program
    issues); its memory (the textbook's, memory.py, or jaxpar's program's, program_memory.py); and the
    time they take on the hardware (time.py). Divisibility is not checked here (jaxpar.core.validate.check
    does it once). `imbalance` (MoE, >= 1): the most loaded expert's tokens over the mean; under routed
    dispatch (Megatron) it scales the experts' compute and the all-to-all bytes on the critical path;
    jaxpar's static buffers cost the same whatever the routing (their overflow is dropped in capacity mode).
    `headroom`: the share of HBM kept free for the runtime before the step `fits` (the commands and the
    planner pass HBM_HEADROOM; 0 compares with the whole HBM, as the studies in experiments/ do)."""
    check_modelled(model)
    check_modelled_layout(model, strategy)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    software = program_traits(software, strategy, hw.platform)
    st, m, own = strategy, model, software.jaxpar_program
    dropout, causal = software.dropout, software.causal
    n = st.num_devices
    if n < 1:
        raise ConfigError(f"mesh {st.name}: resolve the -1 axis (Strategy.resolved) before estimating")
    sh = shape.step_shape(m, st, global_batch, seq)

    # FLOPs: ring attention and a fused kernel both recompute QK^T in the backward pass (flops.recompute_flops)
    ring = st.options.attention == "ring" and st.sizes["context"] > 1
    rows = flops.expert_rows(m, seq, st.sizes["context"], software.moe_padded)
    remat = program_flops.recompute_policy(st, sh) if own else st.options.remat
    fl = flops.step_flops(m, remat, global_batch, seq, causal, ring or software.fused_attention,
                          software.rerun_outputs, rows if m.moe_layers else None, software.sac_every_other_mm)
    head = shape.head_share(sh, software.pp_head_spread)
    if own:
        fl = program_flops.chunk_recompute(fl, m, st, sh, global_batch, seq, causal, software.rerun_outputs)
        head = program_flops.head_share(st, sh, head)
    # critical path per device: layers split over all devices, the head as `head` says, routed experts
    # the most loaded device's (`imbalance` x the mean; static buffers do not vary)
    experts = 0.0 if software.moe_padded else fl_experts(fl) * (imbalance - 1.0)
    matmul = (fl.layers + fl.recompute + fl.padding + experts) / n + fl.head * head / n
    hbm = elementwise_hbm_bytes(m, st, sh, seq, hw.elementwise_passes, dropout, rows, software.fused_attention,
                                head / sh.stages)
    hbm += float8_cast_bytes(m, st, sh, remat, rows if m.moe_layers else 0.0)
    core = (flops.attention_core_flops(m, global_batch, seq, causal).matmul * (m.attention_layers + m.moe_layers)
            * flops.TRAIN_FACTOR / n)

    colls = comm.predicted(m, st, sh, software)
    mem = (program_memory.memory(m, st, global_batch, seq, program_kernel(st, hw.platform), hw.platform) if own
           else memory.memory(m, st, global_batch, seq, dropout, software.pp_1f1b, software.fused_attention,
                              memory.Traits(software.fused_mlp, software.autodiff_remat, software.sac_every_other_mm,
                                            software.loss_logit_bytes, software.pp_fsdp_gathered,
                                            software.pp_end_stages),
                              (software.weight_bytes, software.optimizer_bytes, software.state_over_context,
                               software.fsdp_over_context), software.param_gather_bytes))

    # time: roofline compute, alpha-beta collectives, the software's overlap, the bubble, the optimizer
    cores = core / flops.TRAIN_FACTOR * flops.core_passes(remat, ring or software.fused_attention, software.rerun_outputs)
    low = fp8_share(st, matmul, cores, fl.head * head / n)
    core_eff = hw.flash2_efficiency if software.attention_kernel == "flash2" else 0.0
    waits = gemm_waits(m, st, sh, remat, rows, hw)
    compute = time.compute_seconds(matmul, hbm, hw, low, cores, core_eff) + waits
    matmul_s, hbm_s = time.compute_seconds(matmul, 0.0, hw, low, cores, core_eff) + waits, hbm / hw.hbm_bw
    skew = 1.0 if software.moe_padded else imbalance
    comm_s = time.comm_seconds(colls, st, hw, skew)
    linear_s = matmul_s - time.compute_seconds(cores, 0.0, hw, 0.0, cores, core_eff)
    hideable = time.decomposed_hideable(comm_s["tensor"], linear_s, flops.projection_ops(m),
                                        flops.unit_policy(remat) == "full")
    t = time.step_time(compute, time.compute_seconds(core, 0.0, hw, 0.0, core, core_eff), sh.bubble, comm_s,
                       memory.local_params(m, st, "optimizer", software.state_over_context and not own,
                                          software.fsdp_over_context and not own, software.pp_end_stages and not own),
                       hw, overlap.fractions(software, st, colls, hw, skew),
                       1.0 / st.sizes["context"] if software.cp_hide == "diagonal" else 1.0, software.ep_overlap,
                       hideable, time.host_seconds(mem.host, compute, hw))
    return Estimate(model=m.name, strategy=st.name, hardware=hw.name, software=software.name, devices=n, global_batch=global_batch,
                    seq=seq, mesh=st.mesh, predicted=colls, flops=fl, time=t, memory=mem,
                    hbm_bytes=hw.hbm_bytes, peak_flops=hw.peak_flops, busy=(matmul_s, hbm_s, sum(comm_s.values())),
                    power=(hw.tdp_w, hw.idle_w), headroom=headroom, family=hw.family, causal=causal,
                    host_memory=hw.host_memory)
