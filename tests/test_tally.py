"""Tests for jaxpar.analysis.tally: hand-written HLO for each replica-group syntax, kind, merge rule and
phase, and real compiled HLO end to end. The HLO helpers are tests/test_hlo_text.py's.

Every expected number is worked out by hand from the shapes in the test, in the comment beside it.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxpar.analysis.tally import collective_ops, tally, tally_compiled
from jaxpar.collectives import KINDS, OPTIMIZER_SCOPE, totals
from tests.test_hlo_text import AXES, IDS, all_reduce, module, only


# ---------------------------------------------------------------------------------------------
# Replica-group syntaxes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", ("tensor",)),
        ("{{0,2,4,6},{1,3,5,7}}", ("data",)),
        ("{{6,4,2,0},{7,5,3,1}}", ("data",)),  # order within and across groups is irrelevant
        ("{{0,1,2,3,4,5,6,7}}", ("data", "tensor")),
        ("{}", ("data", "tensor")),  # all devices
        ("{{0,2},{1,3},{4,6},{5,7}}", ("data:(2)2",)),  # minor half of data
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data:(1)2",)),  # major half of data
    ],
)
def test_explicit_groups(groups, axes):
    assert only(tally(module(all_reduce(groups)), AXES, IDS)).axes == axes


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("[4,2]<=[8]", ("tensor",)),  # {0,1},{2,3},...
        ("[2,4]<=[4,2]T(1,0)", ("data",)),  # iota(4,2) transposed: {0,2,4,6},{1,3,5,7}
        ("[1,8]<=[8]", ("data", "tensor")),
        # {0,1,4,5},{2,3,6,7}: data coordinates {0,2} and {1,3}, the major half of data
        ("[2,4]<=[2,2,2]T(1,0,2)", ("data:(1)2", "tensor")),
    ],
)
def test_iota_groups(groups, axes):
    assert only(tally(module(all_reduce(groups)), AXES, IDS)).axes == axes


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("mesh['data'=4,'tensor'=2] {'data'}", ("data",)),
        ("mesh['data'=4,'tensor'=2] {'data','tensor'}", ("data", "tensor")),
        ("mesh[data=4,tensor=2] {tensor}", ("tensor",)),  # unquoted names
        # The HLO mesh need not be ours: one axis of 8 whose minor 2 are our tensor axis.
        ("mesh['axis_0'=8] {'axis_0':(4)2}", ("tensor",)),
        # axis_0:(2)2 has stride 8/(2*2) = 2: {0,2},{1,3},{4,6},{5,7} = the minor half of data.
        ("mesh['axis_0'=8] {'axis_0':(2)2}", ("data:(2)2",)),
        ("mesh['x'=8] {'x':(2)4}", ("data:(2)2", "tensor")),  # {0,1,2,3},{4,5,6,7}
        # Non-iota device order: ids [[0,2,4,6],[1,3,5,7]]; varying b gives {0,2,4,6},{1,3,5,7}.
        ("mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'b'}", ("data",)),
        ("mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'b'}", ("data",)),
    ],
)
def test_mesh_axes_groups(groups, axes):
    assert only(tally(module(all_reduce(groups)), AXES, IDS)).axes == axes


def test_trivial_groups_are_dropped():
    text = module(all_reduce("{{0},{1},{2},{3},{4},{5},{6},{7}}"), all_reduce("[8,1]<=[8]", name="ar2"))
    assert list(tally(text, AXES, IDS)) == []


def test_size_one_axes_never_appear():
    ids = np.arange(8).reshape(1, 4, 1, 2)
    text = module(all_reduce("{{0,1},{2,3},{4,5},{6,7}}"))
    result = tally(text, ("data", "fsdp", "pipeline", "tensor"), ids)
    assert only(result).axes == ("tensor",)


def test_groups_matching_no_axes_are_labelled_not_dropped():
    result = tally(module(all_reduce("{{0,3},{1,2},{4,7},{5,6}}")), AXES, IDS)
    assert only(result).axes == ("?",)
    assert only(result).count == 1
    assert any("match no mesh axes" in w for w in result.warnings)


def test_device_ids_map_hlo_ids_to_positions():
    # The same groups {0,1},{2,3},... read on a mesh whose positions hold ids in column order.
    ids = np.arange(8).reshape(2, 4).T  # [[0,4],[1,5],[2,6],[3,7]]: 0 and 1 now differ along data
    assert only(tally(module(all_reduce("[4,2]<=[8]")), AXES, ids)).axes == ("data:(2)2",)


def test_unknown_device_id_raises():
    with pytest.raises(ValueError, match="not in the mesh"):
        tally(module(all_reduce("{{0,9}}")), AXES, IDS)


# ---------------------------------------------------------------------------------------------
# Kinds, wire bytes, merging, per-op records
# ---------------------------------------------------------------------------------------------


def test_each_kind_sizes_and_wire_bytes():
    text = module(
        # all-gather over data (n=4): result f32[8,4] = 128 bytes gathered
        "%ag = f32[8,4]{1,0} all-gather(%p), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), "
        "dimensions={0}, use_global_device_ids=true",
        # reduce-scatter over data (n=4): result f32[2,4] = 32 bytes, pre-scatter 4 x 32 = 128
        "%rs = f32[2,4]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), "
        "dimensions={0}, to_apply=%add",
        # all-to-all over all 8: a tuple of 8 x f32[2] = 64 bytes
        "%a2a = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}, f32[2]{0}, "
        "f32[2]{0}) all-to-all(%p, %p, %p, %p, %p, %p, %p, %p), channel_id=4, "
        "replica_groups={{0,1,2,3,4,5,6,7}}",
        # collective-permute: f32[8] = 32 bytes, shifting along data
        "%cp = f32[8]{0} collective-permute(%p), channel_id=5, source_target_pairs={{0,2},{2,4},{4,6},{6,0}}",
        # all-reduce over tensor (n=2): f32[16] = 64 bytes
        all_reduce("[4,2]<=[8]", "f32[16]{0}"),
    )
    by_kind = {c.kind: c for c in tally(text, AXES, IDS)}
    assert (by_kind["all-gather"].axes, by_kind["all-gather"].bytes) == (("data",), 128)
    assert by_kind["all-gather"].wire_bytes == pytest.approx(3 / 4 * 128)
    assert (by_kind["reduce-scatter"].axes, by_kind["reduce-scatter"].bytes) == (("data",), 128)
    assert by_kind["reduce-scatter"].wire_bytes == pytest.approx(3 / 4 * 128)
    assert (by_kind["all-to-all"].axes, by_kind["all-to-all"].bytes) == (("data", "tensor"), 64)
    assert by_kind["all-to-all"].wire_bytes == pytest.approx(7 / 8 * 64)
    assert (by_kind["collective-permute"].axes, by_kind["collective-permute"].bytes) == (("data",), 32)
    assert by_kind["collective-permute"].wire_bytes == 32
    assert (by_kind["all-reduce"].axes, by_kind["all-reduce"].bytes) == (("tensor",), 64)
    assert by_kind["all-reduce"].wire_bytes == pytest.approx(2 * 1 / 2 * 64)


def test_permute_axes():
    def permute(pairs):
        return module(f"%cp = f32[8]{{0}} collective-permute(%p), channel_id=1, source_target_pairs={pairs}")

    assert only(tally(permute("{{0,3},{3,0},{1,2},{2,1}}"), AXES, IDS)).axes == ("data", "tensor")
    assert list(tally(permute("{{0,0},{1,1}}"), AXES, IDS)) == []  # nothing moves


def test_identical_collectives_merge_and_totals():
    text = module(
        all_reduce("[4,2]<=[8]", "f32[4]{0}"), all_reduce("{{0,1},{2,3},{4,5},{6,7}}", "f32[2]{0}", "ar2")
    )
    collective = only(tally(text, AXES, IDS))
    assert (collective.count, collective.bytes) == (2, 16 + 8)
    assert totals([collective, collective]) == {"count": 4, "bytes": 48, "wire_bytes": 48.0}


def test_collective_ops_are_the_tally_per_instruction():
    """One record per instruction that moves data (the one-device group is left out), with its
    executions, buffer bytes, the bytes of its rank-0 parts and phase; `tally` is their sum."""
    text = module(
        all_reduce("[4,2]<=[8]", "(f32[4]{0}, f32[], f32[])", op_name="jit(f)/optimizer/psum"),
        all_reduce("{{0,1},{2,3},{4,5},{6,7}}", "f32[2]{0}", "ar2"),
        all_reduce("{{0},{1},{2},{3},{4},{5},{6},{7}}", "f32[2]{0}", "solo"),
        "%rs = f32[2]{0} reduce-scatter(%p), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), "
        "dimensions={0}, to_apply=%add",
    )
    ops = collective_ops(text, AXES, IDS)
    assert [(o.name, o.kind, o.axes, o.group_size, o.times, o.bytes, o.scalar_bytes, o.phase) for o in ops] == [
        ("ar", "all-reduce", ("tensor",), 2, 1, 24, 8, "optimizer"),
        ("ar2", "all-reduce", ("tensor",), 2, 1, 8, 0, "forward"),
        ("rs", "reduce-scatter", ("data",), 4, 1, 32, 0, "other"),
    ]
    assert ops[2].wire_bytes == 24.0
    assert sorted((c.kind, c.count, c.bytes) for c in tally(text, AXES, IDS)) == [
        ("all-reduce", 1, 8), ("all-reduce", 1, 24), ("reduce-scatter", 1, 32)]


def test_untallied_communication_is_reported():
    result = tally(module("%s = (f32[8]{0}, u32[], token[]) send(%p, %t), channel_id=1"), AXES, IDS)
    assert list(result) == [] and result.warnings == ["send %s is not tallied"]


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op_name, phase",
    [
        ("jit(step)/jvp(model)/dot_general", "forward"),
        ("jit(step)/shard_map/psum", "forward"),
        ("w", "forward"),  # parameter gathered by the partitioner
        ("jit(step)/transpose(jvp(model))/dot_general", "backward"),
        ("jit(step)/optimizer/sub", "optimizer"),
        ("jit(step)/shard_map/optimizer/psum_invariant", "optimizer"),
        ("jit(optimizer_step)/jvp(model)/psum", "forward"),  # whole word only
        (None, "other"),
    ],
)
def test_phase_rules(op_name, phase):
    line = all_reduce("[4,2]<=[8]", op_name=op_name or "")
    if op_name is None:
        line = line.split(", metadata=")[0]
    assert only(tally(module(line), AXES, IDS)).phase == phase


def test_optimizer_scope_is_configurable():
    text = module(all_reduce("[4,2]<=[8]", op_name="jit(step)/adam_update/mul"))
    assert only(tally(text, AXES, IDS)).phase == "forward"
    assert only(tally(text, AXES, IDS, optimizer_scope="adam_update")).phase == "optimizer"


# ---------------------------------------------------------------------------------------------
# Real compiled HLO
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def compile_shard_map(body, mesh, *args, in_specs=P(), out_specs=P()):
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(f).lower(*args).compile()


def test_psum_in_scan_end_to_end(mesh):
    def body(x):
        def step(carry, _):
            return carry + jax.lax.psum(carry, "fsdp"), None

        return jax.lax.scan(step, x, None, length=3)[0]

    compiled = compile_shard_map(body, mesh, jnp.ones((4, 8), jnp.float32))
    collective = only(tally_compiled(compiled, mesh))
    buffer = 4 * 8 * 4  # f32[4,8]
    assert (collective.kind, collective.axes, collective.phase) == ("all-reduce", ("fsdp",), "forward")
    assert (collective.count, collective.bytes) == (3, 3 * buffer)
    assert collective.wire_bytes == pytest.approx(3 * 2 * (2 - 1) / 2 * buffer)


def test_every_kind_end_to_end_and_second_parse(mesh):
    """Five collectives of known size; checked by hand and against a plain regex count."""

    def body(x):  # x: f32[8,16] on every device
        a = jax.lax.psum(x, "tensor")  # 8*16*4 = 512 bytes
        b = jax.lax.all_gather(x, "data", tiled=True)  # gathered f32[16,16] = 1024
        c = jax.lax.psum_scatter(x, ("data", "fsdp"), scatter_dimension=0, tiled=True)  # pre-scatter 512
        d = jax.lax.ppermute(x, "fsdp", [(0, 1), (1, 0)])  # 512
        e = jax.lax.all_to_all(x, "tensor", 0, 0, tiled=True)  # 512
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()

    compiled = compile_shard_map(body, mesh, jnp.ones((8, 16), jnp.float32))
    result = {c.kind: c for c in tally_compiled(compiled, mesh)}
    assert {kind: (c.axes, c.count, c.bytes, c.phase) for kind, c in result.items()} == {
        "all-reduce": (("tensor",), 1, 512, "forward"),
        "all-gather": (("data",), 1, 1024, "forward"),
        "reduce-scatter": (("data", "fsdp"), 1, 512, "forward"),
        "collective-permute": (("fsdp",), 1, 512, "forward"),
        "all-to-all": (("tensor",), 1, 512, "forward"),
    }
    assert totals(result.values())["wire_bytes"] == pytest.approx(
        512 * 2 * 1 / 2 + 1024 * 1 / 2 + 512 * 3 / 4 + 512 + 512 * 1 / 2
    )

    # Second parse path: scan the text line by line, no call graph, f32 result shapes only.
    simple: dict[str, list[int]] = {}
    for shape, kind in re.findall(r"= (\(.*?\)|\S+) ([a-z\-]+?)(?:-start)?\(", compiled.as_text()):
        if kind in KINDS:
            arrays = re.findall(r"f32\[([\d,]*)\]", shape)
            elements = sum(math.prod(int(d) for d in dims.split(",") if d) for dims in arrays)
            simple.setdefault(kind, []).append(4 * elements)
    group_size = {"reduce-scatter": 4}  # data x fsdp: the tally reports the pre-scatter buffer
    for kind, c in result.items():
        assert len(simple[kind]) == c.count
        assert sum(simple[kind]) * group_size.get(kind, 1) == c.bytes
    assert simple.keys() == result.keys()


def test_phases_end_to_end(mesh):
    def step(w):  # w: this device's f32[4,16] slice of an f32[8,16] over data
        def loss(w):
            return jnp.sum(jax.lax.all_gather(w, "data", tiled=True) ** 2)

        g = jax.grad(loss)(w)
        with jax.named_scope(OPTIMIZER_SCOPE):
            return w - 0.1 * jax.lax.psum(g, "fsdp")

    compiled = compile_shard_map(step, mesh, jnp.ones((8, 16)), in_specs=P("data"), out_specs=P("data"))
    found = {(c.kind, c.axes, c.phase, c.bytes) for c in tally_compiled(compiled, mesh)}
    assert found == {
        ("all-gather", ("data",), "forward", 8 * 16 * 4),  # gathered f32[8,16]
        ("reduce-scatter", ("data",), "backward", 8 * 16 * 4),  # its transpose: scatter of f32[8,16]
        ("all-reduce", ("fsdp",), "optimizer", 4 * 16 * 4),  # the gradient slice f32[4,16]
    }


def test_permuted_device_order_end_to_end():
    """HLO ids are mesh positions, not Device.id: a shuffled device order changes nothing."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    devices = np.array(jax.devices())[[3, 1, 0, 2, 7, 5, 4, 6]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    compiled = compile_shard_map(lambda x: jax.lax.ppermute(x, "b", ring), mesh, jnp.ones((4,)))
    assert only(tally_compiled(compiled, mesh)).axes == ("b",)
