"""Inference: one prefill or one decode step, its roofline, memory, collectives and latency.

Prefill runs a batch of prompts through the model and fills the cache: compute-bound like training's
forward. Decode runs one token per sequence against the cache: every step streams the weights and the whole
KV cache from HBM for a few FLOPs per byte, so it is bandwidth-bound until the batch is large (scaling book,
"All about Transformer inference"). Per device, for `batch` sequences, prompts of `prompt` tokens and
`generate` new tokens (a cache of prompt + generate - 1 slots, as jaxpar.serving.generate sizes it):
matmul FLOPs (2 x active matmul parameters per token, attention over the keys, the head on the last
position), HBM bytes (weights, the KV cache read or written, Mamba-2 states), time max(matmul, HBM) +
collectives (a roofline per step; the tensor-parallel sums, a context-parallel prefill's exchanges, the
expert all-to-alls), memory (weights, cache, activations) and the critical batch at which decode turns
compute-bound. A routed MoE kernel reads the experts T tokens touch, E x (1 - (1 - k/E)^T) (the occupancy
expectation, Feller vol. 1 ch. II). docs/serving.md ("The serving model") has each term at length.
"""
from __future__ import annotations

import dataclasses

from jaxpar.collectives import A2A, AG, AR, PERMUTE, human_bytes
from jaxpar.cost import comm as cost_comm
from jaxpar.cost import comm_expert, compiler_comm, flops, params, program_pipeline, sites
from jaxpar.cost.comm_context import Exchange, context_parallel
from jaxpar.cost.compiler import COMPILERS, Compiler, activation_bytes, lower
from jaxpar.cost.hardware import Hardware, load_hardware
from jaxpar.cost.memory import ACTIVATION_BYTES
from jaxpar.cost.shape import step_shape
from jaxpar.cost.software import JAXPAR, Software, check_platform
from jaxpar.cost.time import comm_seconds
from jaxpar.core.strategy import Strategy
from jaxpar.models.config import ModelConfig

PHASES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class InferenceEstimate:
    model: str
    strategy: str
    hardware: str
    phase: str
    batch: int
    prompt: int
    generate: int
    devices: int
    matmul_flops: float          # per device per step
    hbm_bytes: float             # per device per step
    matmul_s: float
    memory_s: float
    comm_s: float
    weights_bytes: float         # per device
    cache_bytes: float           # per device: KV cache + Mamba-2 states
    activation_bytes: float      # per device
    hbm_capacity: float
    predicted: tuple[tuple, ...]  # (kind, axes, phase, count, bytes), as cost/comm.py's
    critical_batch: float | None  # decode: the batch where the step turns compute-bound (None: never)
    mesh_sizes: tuple = ()        # the strategy's ((axis, size), ...), for the records' wire bytes
    routed_weights_bytes: float | None = None  # MoE: the weights a routed kernel reads per step (docstring)
    experts_touched: float | None = None       # MoE: expected distinct experts per layer per expert group
    cache_per_token: str = ""                  # what one token's cache holds per device, in words

    @property
    def step_s(self) -> float:
        return max(self.matmul_s, self.memory_s) + self.comm_s

    @property
    def bound(self) -> str:
        """The step's largest term: matmuls, HBM traffic or the collectives (added after the larger of
        the two, `step_s`)."""
        terms = {"compute": self.matmul_s, "memory bandwidth": self.memory_s, "collective": self.comm_s}
        return max(terms, key=terms.get)

    @property
    def tokens_per_s(self) -> float:
        """Prefill: prompt tokens per second; decode: new tokens per second (one per sequence per step)."""
        return self.batch * (self.prompt if self.phase == "prefill" else 1) / self.step_s

    @property
    def memory_total(self) -> float:
        return self.weights_bytes + self.cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.hbm_capacity

    @property
    def collectives(self):
        return cost_comm.to_records(self.predicted, dict(self.mesh_sizes))

    def to_json(self) -> dict:
        return {"model": self.model, "strategy": self.strategy, "hardware": self.hardware, "phase": self.phase,
                "batch": self.batch, "prompt": self.prompt, "generate": self.generate, "devices": self.devices,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "bound": self.bound,
                "matmul_s": self.matmul_s, "memory_s": self.memory_s, "comm_s": self.comm_s,
                "matmul_flops": self.matmul_flops, "hbm_bytes": self.hbm_bytes,
                "cache_per_token": self.cache_per_token,
                "memory": {"weights": self.weights_bytes, "cache": self.cache_bytes,
                           "activations": self.activation_bytes, "total": self.memory_total},
                "fits": self.fits, "critical_batch": self.critical_batch,
                "moe": None if self.experts_touched is None else {
                    "experts_touched": self.experts_touched, "routed_weights_bytes": self.routed_weights_bytes},
                "collectives": [{"kind": c.kind, "axes": list(c.axes), "count": c.count, "bytes": c.bytes}
                                for c in self.collectives]}


def kv_heads_per_device(m: ModelConfig, tensor: int) -> float:
    """K/V heads one device caches: kv_heads / tensor, or 1 (a replicated head) when tensor > kv_heads."""
    return m.kv_heads / tensor if tensor <= m.kv_heads else 1.0


def cached_per_token(m: ModelConfig, tensor: int) -> float:
    """Values one device caches per token and attention layer: K and V of its kv_heads_per_device, or latent
    attention's latent and RoPE key (kv_lora_rank + qk_rope_head_dim), which every head reads, so every
    tensor rank holds them whole (DeepSeek-V2 table 1: (d_c + d_h^R) l elements per token)."""
    if m.mla:
        return m.kv_lora_rank + m.qk_rope_head_dim
    return 2 * kv_heads_per_device(m, tensor) * m.head_dim


def describe_cache(m: ModelConfig, st: Strategy) -> str:
    """One token's attention cache on a device, in bytes over every attention layer and what it is."""
    if not m.has_attention:
        return ""
    layers, t = m.attention_layers + m.moe_layers, st.sizes["tensor"]
    per_token = layers * cached_per_token(m, t) * ACTIVATION_BYTES[st.options.dtype]
    what = (f"latent {m.kv_lora_rank} + RoPE key {m.qk_rope_head_dim}" if m.mla
            else f"K and V of {kv_heads_per_device(m, t):g} heads x {m.head_dim}")
    return f"{per_token:,.0f} B per token ({what} per layer, {layers} layers)"


def cache_bytes(m: ModelConfig, st: Strategy, batch: int, slots: int) -> float:
    """KV cache + Mamba-2 decode state per device (models/decode.py's cache_layout, sharded by the rules)."""
    sz, act = st.sizes, ACTIVATION_BYTES[st.options.dtype]
    b = batch / (sz["data"] * sz["fsdp"] * sz["expert"])
    t = sz["tensor"]
    kv = (m.attention_layers + m.moe_layers) * b * slots * cached_per_token(m, t) * act
    _, _, heads = params.mamba_dims(m) if m.mamba_layers else (0, 0, 0)
    conv = (m.d_conv - 1) * (m.d_inner + 2 * m.ngroups * m.d_state) / t * act
    ssm = heads / t * m.ssm_head_dim * m.d_state * 4
    states = m.mamba_layers * b * (conv + ssm) if m.mamba_layers else 0.0
    return kv + states + (b * slots * 4 if m.has_attention else 0.0)  # + the slots' int32 positions


def expected_experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens route to, each picking `top_k` of `experts` uniformly
    without replacement (module docstring)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def expert_params(m: ModelConfig) -> int:
    """Routed experts' parameters over every MoE layer (models/moe.py's w_gate, w_up, w_down)."""
    return m.moe_layers * m.experts * 3 * m.d_model * m.moe_mlp_dim


def attention_matmul(m: ModelConfig, tokens: float, batch: float, q_len: int, keys: int) -> float:
    """One attention layer's forward matmul FLOPs: the projections, then each of the batch x q_len queries
    against `keys` keys. A latent attention decode step (q_len 1: jaxpar/ops/latent_attention.py
    absorbed_read) folds W_k_b into the query and W_v_b into the output: per token the same
    2 h kv_lora_rank (qk_nope + v_head_dim) as the up-projections of the training forward, then per cached
    key the scores over the latent and the RoPE key (2 h (c + r)) and the weighted latent (2 h c), instead
    of every head's K/V rebuilt from each cached latent."""
    projections = flops.attention_projection_flops(m, tokens).matmul
    if m.mla and q_len == 1:
        return projections + 2.0 * batch * keys * m.heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    return projections + 2.0 * batch * q_len * keys * m.heads * (m.head_dim + m.v_dim)


def _forward_matmul(m: ModelConfig, tokens: float, batch: float, q_len: int, keys: int) -> float:
    """Matmul FLOPs of one forward over `tokens` = batch x q_len tokens attending over `keys` each."""
    attn = attention_matmul(m, tokens, batch, q_len, keys)
    total = m.attention_layers * (attn + flops.mlp_flops(m, tokens).matmul)
    if m.moe_layers:
        moe = (attn + flops.router_flops(m, tokens).matmul + flops.expert_flops(m, tokens).matmul
               + flops.shared_expert_flops(m, tokens).matmul)
        total += m.moe_layers * moe
    if m.mamba_layers:
        d_in_proj, _, _ = params.mamba_dims(m)
        proj = 2.0 * tokens * (m.d_model * d_in_proj + m.d_inner * m.d_model)
        scan = flops.ssd_flops(m, batch, q_len).matmul if q_len > 1 else 4.0 * tokens * m.d_inner * m.d_state
        total += m.mamba_layers * (proj + scan)
    return total + 2.0 * batch * m.d_model * m.vocab  # the head, on the last position of each sequence


def _context_prefill(m: ModelConfig, st: Strategy, batch: float, prompt: int, act: int) -> list[tuple]:
    """A prefill split over `context` (models/decode.py): attention's K/V exchange and Mamba-2's halos
    and states are training's forward ones (cost/comm_context.py context_parallel, on this prompt's shape);
    then each attention layer's K and V are all-gathered over context into the cache (it is
    replicated over context: a decode step reads it whole), and the last token's hidden state [b, d]
    is sliced out of the context-sharded stream: XLA's partitioner moves it to the first context
    shard (a permute) unless that shard holds it, as under zigzag, and sums it over context.
    Checked against the compiled prefill at context 2 (tests/test_inference_layouts.py). Not modelled:
    at context > 2 XLA:CPU leaves the key positions' ring permutes inside the layer loop ((c-1) x
    layers small int32 permutes instead of c-1), and a Mamba-2 layer's cache fill (its conv window's
    last columns and its final SSM state, taken off the shard that holds them: a permute and an
    all-reduce per layer)."""
    sz = st.sizes
    sh = step_shape(m, st, batch, prompt)
    ops = context_parallel(m, st, sh, act)
    if sh.stages > 1:   # the positions as training's pipelines move them
        ops = program_pipeline.context_parallel(ops, m, st, sh, act, Exchange())
    ops = [op for op in ops if op[5] == "forward"]
    e = m.attention_layers + m.moe_layers
    if e:
        if m.mla:   # the cache's latent and RoPE key, all slots
            cached = [sh.mb * prompt * m.kv_lora_rank * act, sh.mb * prompt * m.qk_rope_head_dim * act]
        else:       # K and V, all slots
            cached = [sh.mb * prompt * m.kv_heads * m.head_dim / min(sz["tensor"], m.kv_heads) * act] * 2
        ops += sites.issue(AG, ("context",), e, cached, "forward")
    row = sh.mb * m.d_model * act
    if st.options.cp_layout != "zigzag":  # the last token sits on the last shard
        ops += sites.issue(PERMUTE, ("context",), 1, [row], "forward")
    return ops + sites.issue(AR, ("context",), 1, [row], "forward")


def _collectives(m: ModelConfig, st: Strategy, batch: float, q_len: int, cc: Compiler,
                 moe_padded: bool = True) -> tuple[tuple, ...]:
    """Per device per step, merged by (kind, axes, phase) as cost/comm.py's `predicted`
    (`moe_padded`: MoE dispatch into static buffers, Software.moe_padded)."""
    t = st.sizes["tensor"]
    act = activation_bytes(cc, ACTIVATION_BYTES[st.options.dtype])
    b = batch / (st.sizes["data"] * st.sizes["fsdp"] * st.sizes["expert"])
    x = b * q_len / st.sizes["context"] * m.d_model * act   # a context-parallel prefill splits the tokens
    ax = ("tensor",)
    ops = []
    if t > 1:
        ops += sites.issue(AR, ax, 1, [x], "forward")                                   # embedding (vocab-parallel)
        ops += sites.issue(AR, ax, 2 * (m.attention_layers + m.moe_layers) + m.mamba_layers, [x], "forward")
        ops += sites.issue(AG, ax, 2, [b * 4 * t], "forward")                           # argmax: (value, id) per rank
    c = st.sizes["context"]
    if c > 1:  # a context-parallel prefill (a decode step never splits its one token)
        ops += _context_prefill(m, st, batch, q_len, act)
    if m.moe_layers and st.sizes["expert"] > 1:
        # the copies to the experts' owners and back, as in training's forward (cost/comm_expert.py
        # expert_parallel), a group being one sequence's q_len tokens
        n, form = st.sizes["expert"], compiler_comm.dispatch_form(st, cc, moe_padded)
        buf = comm_expert.dispatch_bytes(m, b, q_len, 1, n, act, form)
        ops += sites.issue(A2A, ("expert",), 2 * m.moe_layers, [buf], "forward")
        if form != "padded":
            ops += sites.issue(AG, ("expert",), m.moe_layers, [comm_expert.counts_bytes(m, n)], "forward")
    return cost_comm.merge(lower(cc, ops, st))


def weight_bytes(software: Software, st: Strategy) -> int:
    """Bytes per parameter a generation step reads: jaxpar's generate converts the weights to the serving
    dtype once (jaxpar/serving/generate.py), so its strategy's dtype decides; other stacks their preset's."""
    return ACTIVATION_BYTES[st.options.dtype] if software.jaxpar_program else software.serve_weight_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """A serving step's question: the `phase` (prefill | decode), `batch` sequences, prompts of `prompt`
    tokens and `generate` new tokens each."""
    phase: str
    batch: int
    prompt: int
    generate: int


def inference_estimate(m: ModelConfig, st: Strategy, hardware: Hardware | str, request: Request,
                       software: Software = JAXPAR, compiler: Compiler | str = "gpu") -> InferenceEstimate:
    """One prefill or decode step (module docstring). `strategy` resolved; jaxpar.core.validate.check_generate
    states what generation supports."""
    phase, batch, prompt, generate = request.phase, request.batch, request.prompt, request.generate
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    check_platform(software, hw)
    cc = COMPILERS[compiler] if isinstance(compiler, str) else compiler
    sz, n = st.sizes, st.num_devices
    slots = prompt + generate - 1
    q_len, keys = (prompt, prompt) if phase == "prefill" else (1, slots)
    dp = sz["data"] * sz["fsdp"] * sz["expert"]
    tp, ep = sz["tensor"], sz["expert"]
    cp = sz["context"] if phase == "prefill" else 1  # a decode step repeats on every context rank
    matmul = _forward_matmul(m, batch * q_len, batch, q_len, keys) / (dp * tp * cp)
    experts, per_param = expert_params(m), weight_bytes(software, st)
    shared = (params.total_params(m) - experts) / tp * per_param  # data axes hold a full copy
    weights = shared + experts / (tp * ep) * per_param
    touched = routed = None
    if m.moe_layers:
        touched = expected_experts_touched(m.experts, m.top_k, batch / (sz["data"] * sz["fsdp"]) * q_len)
        routed = shared + experts / m.experts * touched / (tp * ep) * per_param
    cache = cache_bytes(m, st, batch, slots)
    act = ACTIVATION_BYTES[st.options.dtype]
    acts = batch / dp * q_len / cp * (m.d_model * 4 + m.mlp_dim / tp * 2) * act + batch / dp * m.vocab / tp * 4
    hbm = weights + cache + acts  # decode reads the cache; prefill writes it (same bytes)
    matmul_s = matmul / (hw.peak_flops * hw.matmul_efficiency)
    memory_s = hbm / hw.hbm_bw
    predicted = _collectives(m, st, batch, q_len, cc, software.moe_padded)
    comm = sum(comm_seconds(predicted, st, hw).values())
    critical = None
    if phase == "decode":
        per_seq_s = (matmul / (batch / dp)) / (hw.peak_flops * hw.matmul_efficiency)  # FLOP time per sequence
        per_seq_bytes = (cache + acts) / (batch / dp) / hw.hbm_bw
        if per_seq_s > per_seq_bytes:
            critical = (weights / hw.hbm_bw) / (per_seq_s - per_seq_bytes) * dp
    return InferenceEstimate(model=m.name, strategy=st.name, hardware=hw.name, phase=phase, batch=batch,
                             prompt=prompt, generate=generate, devices=n, matmul_flops=matmul, hbm_bytes=hbm,
                             matmul_s=matmul_s, memory_s=memory_s, comm_s=comm, weights_bytes=weights,
                             cache_bytes=cache, activation_bytes=acts, hbm_capacity=hw.hbm_bytes,
                             predicted=predicted, critical_batch=critical, mesh_sizes=st.mesh,
                             routed_weights_bytes=routed, experts_touched=touched,
                             cache_per_token=describe_cache(m, st))


def format_inference(e: InferenceEstimate) -> str:
    unit = "prompt tokens/s" if e.phase == "prefill" else "new tokens/s"
    lines = [f"{e.model} {e.phase} on {e.devices} x {e.hardware} [{e.strategy}], batch {e.batch}, prompt {e.prompt}, "
             f"{e.generate} new tokens",
             f"  step {e.step_s * 1e3:.2f} ms   {e.tokens_per_s:,.0f} {unit}   {e.bound}-bound",
             f"  matmul {e.matmul_s * 1e3:.3f} ms ({e.matmul_flops:.3e} FLOPs/device)   HBM {e.memory_s * 1e3:.3f} ms "
             f"({human_bytes(e.hbm_bytes)}/device)   collectives {e.comm_s * 1e3:.3f} ms"]
    if e.phase == "decode":
        lines.append("  critical batch (decode turns compute-bound): "
                     + (f"{e.critical_batch:,.0f} sequences" if e.critical_batch else "never (the KV cache grows with it)"))
    if e.experts_touched is not None:
        lines.append(f"  MoE: {e.experts_touched:.2f} distinct experts touched per layer per step (uniform routing); "
                     f"a routed kernel would read {human_bytes(e.routed_weights_bytes)} of weights per device "
                     f"(jaxpar's batched experts read {human_bytes(e.weights_bytes)})")
    if e.cache_per_token:
        lines.append(f"  cache: {e.cache_per_token}")
    lines += [f"  memory per device: weights {human_bytes(e.weights_bytes)}, cache {human_bytes(e.cache_bytes)}, "
              f"activations {human_bytes(e.activation_bytes)}: {human_bytes(e.memory_total)} "
              f"({'fits' if e.fits else 'does NOT fit'} in {human_bytes(e.hbm_capacity)})"]
    for c in e.collectives:
        lines.append(f"  {c.kind:<15} {','.join(c.axes):<8} {c.count:>5} x {human_bytes(c.bytes / c.count)}")
    return "\n".join(lines)
