"""Hardware profiles: what one accelerator and its links can do, plus the calibration constants.

A profile is a TOML file in `jaxpar/cost/hardware/` (or any path). Datasheet numbers come from the
`[hardware]` table of jaxpar/cost/published/hardware.toml (vendor datasheets as summarised in the
JAX scaling book, "How to Scale Your Model"). The `[calibration]` table holds the few constants that
turn peak numbers into achieved ones; they are fitted once per device type, never per run:

    matmul_efficiency   achieved / peak FLOP/s for the model's matmuls (the MXU/tensor-core part)
    link_efficiency     achieved / nominal bandwidth of a collective (NCCL "bus bandwidth" fraction)
    elementwise_passes  HBM passes per produced activation byte in one forward pass (norms, softmax,
                        activations, dropout, residual adds are bandwidth-bound, not FLOP-bound)
    flash2_efficiency   achieved / peak of FlashAttention-2 (Dao 2023), the attention kernel of stacks
                        that call it (Software.attention_kernel): an Ampere kernel, 50-73% of the A100's
                        peak (Dao 2023), 35% of the H100's (Shah et al. 2024, FlashAttention-3's abstract);
                        not fitted
What communication hides under compute depends on the software's schedule, not the device: it is
stated per software (jaxpar/cost/software.py: tp_overlap, dp_overlap, pp_overlap).

Link model (scaling book, GPU and TPU chapters): an axis whose devices all sit in one node (GPU
NVLink domain, TPU ICI slice) uses `intra_bw`; an axis spanning nodes also crosses `inter_bw`
(InfiniBand / DCN), per device. `alpha_*` is the latency of one ring step on each tier (GPU profiles:
NCCL's own tuning model, src/graph/tuning.cc hwLat, ring with the Simple protocol of large messages:
3.4 us over NVLink, 14 us over the network; jaxpar/cost/time.py counts the steps).
A TPU slice is a torus of `torus_dims` dimensions (v4, v5p: 3; v5e, v6e: 2): `intra_bw` is one
dimension's bidirectional ring, and a group that spans several dimensions gathers over each of them at
once, "increasing the available bandwidth by a factor of N_axes" (scaling book, "Sharded matrices":
AllGather over multiple axes; `torus_axes`).
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib

from jaxpar.errors import ConfigError
from jaxpar.core.inputs import did_you_mean, number, parse_toml, read_toml, table

PROFILE_DIR = pathlib.Path(__file__).resolve().parent / "hardware"


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float          # dense bf16 FLOP/s per device
    hbm_bytes: float           # device memory, bytes
    hbm_bw: float              # device memory bandwidth, bytes/s
    intra_bw: float            # per-device bandwidth inside a node / ICI slice, bytes/s one direction
    inter_bw: float            # per-device bandwidth across nodes (IB / DCN), bytes/s one direction
    devices_per_node: int      # size of the fast-link domain (GPU node, TPU slice)
    alpha_intra: float = 5e-6  # seconds per ring hop inside a node
    alpha_inter: float = 1e-5  # seconds per ring hop across nodes
    host_bw: float = 0.0       # per-device link to host memory, bytes/s one direction (remat offload); 0: unknown
    host_memory: float = 0.0   # host DRAM per device (the host's memory / its devices), bytes: bounds remat offload; 0: unknown
    matmul_efficiency: float = 0.6
    link_efficiency: float = 0.8
    elementwise_passes: float = 1.5
    calibrated: bool = False   # True only where the constants were fitted to published runs
    tdp_w: float = 0.0         # board power at full load, W ([power]; 0: no energy figures)
    idle_w: float = 0.0        # power of an idle device, W (jaxpar/cost/energy.py)
    notes: str = ""
    platform: str = "gpu"      # gpu | tpu: which fused attention kernel jaxpar's program runs there (auto)
    fp8_flops: float = 0.0     # dense float8 FLOP/s per device; 0: the device has no float8 matmuls
    family: str = ""           # the calibration's hardware family (one constant set each); "": the name
    flash2_efficiency: float = 0.0  # achieved / peak of the FlashAttention-2 kernel here; 0: the matmul efficiency
    torus_dims: int = 0        # dimensions of a slice's ICI torus (TPU); 0: no torus (a GPU node's switch)

    def matmul_peak(self, dtype: str) -> float:
        """The peak FLOP/s of matmuls in `dtype` (dense bf16 for float32 and bfloat16 alike: the cost model
        prices mixed-precision steps, whose matmuls take 16-bit inputs)."""
        if dtype != "float8":
            return self.peak_flops
        if not self.fp8_flops:
            raise ConfigError(f"dtype=float8: hardware {self.name} states no float8 peak ([device] fp8_flops); "
                              "it has no float8 matmuls")
        return self.fp8_flops

    def torus_axes(self, members: int, slice_chips: int) -> int:
        """How many torus dimensions a group of `members` chips inside a slice of `slice_chips` spans: a
        slice of c chips on a d-dimensional torus is about c^(1/d) chips along each dimension, and a group
        fills dimensions one after another (1 without a torus, or for one member)."""
        if not self.torus_dims or members <= 1:
            return 1
        edge = self.torus_edge(slice_chips)
        spanned, reach = 1, edge
        while reach < members and spanned < self.torus_dims:
            spanned, reach = spanned + 1, reach * edge
        return spanned

    def torus_edge(self, slice_chips: int) -> int:
        """Chips along one dimension of a slice of `slice_chips` on the torus: about c^(1/d)."""
        return max(2, round(slice_chips ** (1.0 / self.torus_dims)))

    def ring_steps(self, members: int, slice_chips: int) -> int:
        """Latency steps of a ring collective over `members` devices of one node: members - 1 through a
        switch (NCCL's ring over NVLink); on a torus one ring per dimension the group spans, each of its
        chips along that dimension less one, run one after another ("an AllGather over two axes is two
        1-D AllGathers", scaling book, "Sharded matrices"; the group fills dimensions as `torus_axes`)."""
        spanned = self.torus_axes(members, slice_chips)
        if spanned <= 1:
            return max(0, members - 1)
        edge = self.torus_edge(slice_chips)
        full = edge ** (spanned - 1)
        return (spanned - 1) * (edge - 1) + max(1, -(-members // full)) - 1


PLATFORMS = ("gpu", "tpu")
_SECTIONS = {"device": ("platform", "peak_flops", "fp8_flops", "hbm_bytes", "hbm_bw"),
             "links": ("intra_bw", "inter_bw", "host_bw", "host_memory", "devices_per_node", "alpha_intra",
                       "alpha_inter", "torus_dims"),
             "calibration": ("matmul_efficiency", "link_efficiency", "elementwise_passes", "flash2_efficiency",
                             "calibrated"),
             "power": ("tdp_w", "idle_w")}
_TOP = ("name", "notes", "family")


def known_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def parse_hardware(text: str, where: str, default_name: str) -> Hardware:
    """Build a Hardware from TOML text with [device], [links] and [calibration] tables."""
    return hardware_from_table(parse_toml(text, f"hardware file {where}"), where, default_name)


def hardware_from_table(data: dict, where: str, default_name: str) -> Hardware:
    fields: dict = {"name": data.get("name", default_name), "notes": data.get("notes", "")}
    fields["family"] = data.get("family", fields["name"])
    for key in _TOP:
        if not isinstance(fields[key], str):
            raise ConfigError(f"{where}: {key} must be a string, got {fields[key]!r}")
    unknown = set(data) - set(_SECTIONS) - set(_TOP)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"expected {', '.join(_TOP)} and tables [{'], ['.join(_SECTIONS)}]")
    types = {f.name: f.type for f in dataclasses.fields(Hardware)}
    for section, keys in _SECTIONS.items():
        values = table(data, section, where)
        extra = set(values) - set(keys)
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(extra))} in [{section}]; "
                              f"known: {', '.join(keys)}")
        for key, value in values.items():
            if key == "platform":
                if value not in PLATFORMS:
                    raise ConfigError(f"{where}: [{section}] platform={value!r} must be one of {', '.join(PLATFORMS)}")
            elif types[key] == "bool":
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}: [{section}] {key}={value!r} must be true or false")
            else:
                number(value, f"[{section}] {key}", where, integer_only=types[key] == "int", lo=0)
        fields.update(values)
    missing = [f.name for f in dataclasses.fields(Hardware)
               if f.default is dataclasses.MISSING and f.name not in fields]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    hw = Hardware(**fields)
    for key in ("peak_flops", "hbm_bytes", "hbm_bw", "intra_bw", "inter_bw", "devices_per_node",
                "matmul_efficiency", "link_efficiency"):
        if not getattr(hw, key) > 0:
            raise ConfigError(f"{where}: {key} must be positive, got {getattr(hw, key)}")
    if hw.idle_w > hw.tdp_w:
        raise ConfigError(f"{where}: [power] idle_w={hw.idle_w} must not exceed tdp_w={hw.tdp_w}")
    return hw


@functools.lru_cache(maxsize=64)
def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (`a100-80gb`, `h100-sxm`, `tpu-v5p`, ...) or a TOML path. Cached: parse once."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = PROFILE_DIR / f"{name_or_path}.toml"
        if not path.exists():
            raise ConfigError(f"unknown hardware {name_or_path!r}{did_you_mean(name_or_path, known_profiles())}; "
                              f"known: {', '.join(known_profiles())} "
                              f"(or give a path to a TOML profile)")
    return hardware_from_table(read_toml(path, "hardware"), str(path), path.stem)
