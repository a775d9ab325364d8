"""Tests for jaxpar.hlo: hand-written HLO for each syntax, and real compiled HLO end to end.

Every expected number is worked out by hand from the shapes in the test, in the comment beside it.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxpar import hlo

# A 4 x 2 mesh: device id = 2 * data + tensor.
#   tensor ->  0 1
#   data   |   2 3
#          v   4 5
#              6 7
AXES = ("data", "tensor")
IDS = np.arange(8).reshape(4, 2)


def module(*body: str, computations: str = "") -> str:
    """An HLO module whose ENTRY holds the given instruction lines."""
    lines = "\n".join(f"  {line}" for line in body)
    return (
        "HloModule test, num_partitions=8\n\n"
        "%add (x: f32[], y: f32[]) -> f32[] {\n"
        "  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n"
        "  ROOT %sum = f32[] add(%x, %y)\n}\n\n"
        f"{computations}\n"
        "ENTRY %main (p: f32[8]) -> f32[8] {\n"
        "  %p = f32[8]{0} parameter(0)\n"
        f"{lines}\n"
        "}\n"
    )


def all_reduce(groups: str, shape: str = "f32[8]{0}", name: str = "ar", op_name: str = "jit(f)/psum") -> str:
    return (
        f"%{name} = {shape} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        f'use_global_device_ids=true, to_apply=%add, metadata={{op_name="{op_name}"}}'
    )


def only(result) -> hlo.Collective:
    assert len(result) == 1, result
    return result[0]


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
    assert only(hlo.tally(module(all_reduce(groups)), AXES, IDS)).axes == axes


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
    assert only(hlo.tally(module(all_reduce(groups)), AXES, IDS)).axes == axes


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
    assert only(hlo.tally(module(all_reduce(groups)), AXES, IDS)).axes == axes


def test_trivial_groups_are_dropped():
    text = module(all_reduce("{{0},{1},{2},{3},{4},{5},{6},{7}}"), all_reduce("[8,1]<=[8]", name="ar2"))
    assert list(hlo.tally(text, AXES, IDS)) == []


def test_size_one_axes_never_appear():
    ids = np.arange(8).reshape(1, 4, 1, 2)
    text = module(all_reduce("{{0,1},{2,3},{4,5},{6,7}}"))
    result = hlo.tally(text, ("data", "fsdp", "pipeline", "tensor"), ids)
    assert only(result).axes == ("tensor",)


def test_groups_matching_no_axes_are_labelled_not_dropped():
    result = hlo.tally(module(all_reduce("{{0,3},{1,2},{4,7},{5,6}}")), AXES, IDS)
    assert only(result).axes == ("?",)
    assert only(result).count == 1
    assert any("match no mesh axes" in w for w in result.warnings)


def test_device_ids_map_hlo_ids_to_positions():
    # The same groups {0,1},{2,3},... read on a mesh whose positions hold ids in column order.
    ids = np.arange(8).reshape(2, 4).T  # [[0,4],[1,5],[2,6],[3,7]]: 0 and 1 now differ along data
    assert only(hlo.tally(module(all_reduce("[4,2]<=[8]")), AXES, ids)).axes == ("data:(2)2",)


def test_unknown_device_id_raises():
    with pytest.raises(ValueError, match="not in the mesh"):
        hlo.tally(module(all_reduce("{{0,9}}")), AXES, IDS)


# ---------------------------------------------------------------------------------------------
# Sizes, wire bytes, async pairs, tuples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, nbytes",
    [
        ("f32[4,8]{1,0}", 4 * 8 * 4),
        ("bf16[3,5]{1,0}", 3 * 5 * 2),
        ("f16[6]{0}", 6 * 2),
        ("f64[]", 8),
        ("s32[2,3]{1,0}", 2 * 3 * 4),
        ("u32[10]{0}", 10 * 4),
        ("s8[2,2]{1,0}", 4),
        ("pred[7]{0}", 7),
        ("f8e4m3fn[16]{0}", 16),
        ("s4[3]{0}", 2),  # 12 bits round up to 2 bytes
        ("f32[<=8]{0}", 8 * 4),  # dynamic dim: its bound
        ("f32[4,8]{1,0:T(8,128)}", 4 * 8 * 4),  # tiled layout ignored
    ],
)
def test_dtype_aware_sizes(shape, nbytes):
    collective = only(hlo.tally(module(all_reduce("{{0,1},{2,3},{4,5},{6,7}}", shape)), AXES, IDS))
    assert collective.bytes == nbytes
    assert collective.wire_bytes == pytest.approx(2 * (2 - 1) / 2 * nbytes)  # AR over 2 devices


def test_tuple_collective_sums_its_elements():
    shape = "(f32[4]{0}, bf16[8]{0}, f32[2,2]{1,0}, s32[1]{0}, f32[], /*index=5*/f32[3]{0})"
    collective = only(hlo.tally(module(all_reduce("[4,2]<=[8]", shape)), AXES, IDS))
    assert collective.count == 1
    assert collective.bytes == 16 + 16 + 16 + 4 + 4 + 12


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
    by_kind = {c.kind: c for c in hlo.tally(text, AXES, IDS)}
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


def test_async_pairs_count_once_sized_from_start():
    async_wrapped = (
        "%wrapped (a: f32[16]) -> f32[16] {\n"
        "  %a = f32[16]{0} parameter(0)\n"
        "  ROOT %inner = f32[16]{0} all-to-all(%a), channel_id=9, replica_groups=[4,2]<=[8], dimensions={0}\n"
        "}\n"
    )
    text = module(
        # native all-reduce-start: its shape is the result, f32[16] = 64 bytes
        "%ars = f32[16]{0} all-reduce-start(%p), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add",
        "%ard = f32[16]{0} all-reduce-done(%ars)",
        # all-gather-start: (operand f32[2,8], result f32[8,8]) -> gathered 8*8*4 = 256 bytes
        "%ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p), channel_id=2, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true",
        "%agd = f32[8,8]{1,0} all-gather-done(%ags)",
        # collective-permute-start: (operand, result, u32[], u32[]) -> 8*4 = 32 bytes
        "%cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, "
        "source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}",
        "%cpd = f32[8]{0} collective-permute-done(%cps)",
        # async sugar: ((operand f32[16]), result f32[4]) over data (n=4) -> 4 * 4*4 = 64 bytes
        "%rss = ((f32[16]{0}), f32[4]{0}) reduce-scatter-start(%p), channel_id=4, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add",
        "%rsu = ((f32[16]{0}), f32[4]{0}) reduce-scatter-update(%rss)",
        "%rsd = f32[4]{0} reduce-scatter-done(%rsu)",
        # async-start wrapping an all-to-all: f32[16] = 64 bytes, counted once although
        # async-done also names the computation
        "%a2as = ((f32[16]{0}), f32[16]{0}, s32[]) async-start(%p), calls=%wrapped",
        "%a2ad = f32[16]{0} async-done(%a2as), calls=%wrapped",
        computations=async_wrapped,
    )
    result = {c.kind: c for c in hlo.tally(text, AXES, IDS)}
    assert {kind: (c.count, c.bytes, c.axes) for kind, c in result.items()} == {
        "all-reduce": (1, 64, ("tensor",)),
        "all-gather": (1, 256, ("data",)),
        "collective-permute": (1, 32, ("tensor",)),
        "reduce-scatter": (1, 64, ("data",)),
        "all-to-all": (1, 64, ("tensor",)),
    }


def test_combined_async_all_gather_sums_results():
    text = module(
        # ((operands), (results)): results 2 x f32[8] = 64 bytes
        "%ags = ((f32[2]{0}, f32[2]{0}), (f32[8]{0}, f32[8]{0})) all-gather-start(%p, %p), channel_id=1, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}",
        "%agd = (f32[8]{0}, f32[8]{0}) all-gather-done(%ags)",
    )
    assert only(hlo.tally(text, AXES, IDS)).bytes == 64


def test_permute_axes():
    def permute(pairs):
        return module(f"%cp = f32[8]{{0}} collective-permute(%p), channel_id=1, source_target_pairs={pairs}")

    assert only(hlo.tally(permute("{{0,3},{3,0},{1,2},{2,1}}"), AXES, IDS)).axes == ("data", "tensor")
    assert list(hlo.tally(permute("{{0,0},{1,1}}"), AXES, IDS)) == []  # nothing moves


def test_identical_collectives_merge_and_totals():
    text = module(
        all_reduce("[4,2]<=[8]", "f32[4]{0}"), all_reduce("{{0,1},{2,3},{4,5},{6,7}}", "f32[2]{0}", "ar2")
    )
    collective = only(hlo.tally(text, AXES, IDS))
    assert (collective.count, collective.bytes) == (2, 16 + 8)
    assert hlo.totals([collective, collective]) == {"count": 4, "bytes": 48, "wire_bytes": 48.0}


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
    ops = hlo.collective_ops(text, AXES, IDS)
    assert [(o.name, o.kind, o.axes, o.group_size, o.times, o.bytes, o.scalar_bytes, o.phase) for o in ops] == [
        ("ar", "all-reduce", ("tensor",), 2, 1, 24, 8, "optimizer"),
        ("ar2", "all-reduce", ("tensor",), 2, 1, 8, 0, "forward"),
        ("rs", "reduce-scatter", ("data",), 4, 1, 32, 0, "other"),
    ]
    assert ops[2].wire_bytes == 24.0
    assert sorted((c.kind, c.count, c.bytes) for c in hlo.tally(text, AXES, IDS)) == [
        ("all-reduce", 1, 8), ("all-reduce", 1, 24), ("reduce-scatter", 1, 32)]


def test_untallied_communication_is_reported():
    result = hlo.tally(module("%s = (f32[8]{0}, u32[], token[]) send(%p, %t), channel_id=1"), AXES, IDS)
    assert list(result) == [] and result.warnings == ["send %s is not tallied"]


# ---------------------------------------------------------------------------------------------
# Loops and the call graph
# ---------------------------------------------------------------------------------------------


def trip(n: int) -> str:
    return f'backend_config={{"known_trip_count":{{"n":"{n}"}}}}'


LOOPS = """
%inner_cond (ic: (s32[], f32[8])) -> pred[] {
  %ic = (s32[], f32[8]{0}) parameter(0)
  %c_ar = f32[1]{0} all-reduce(%ic), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %lt = pred[] constant(true)
}

%inner_body (ib: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ib = (s32[], f32[8]{0}) parameter(0)
  %in_ar = f32[4,8]{1,0} all-reduce(%ib), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%ib)
}

%outer_cond (oc: (s32[], f32[8])) -> pred[] {
  %oc = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt2 = pred[] constant(true)
}

%outer_body (ob: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ob = (s32[], f32[8]{0}) parameter(0)
  %out_ag = f32[8]{0} all-gather(%ob), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  ROOT %w_in = (s32[], f32[8]{0}) while(%ob), condition=%inner_cond, body=%inner_body, INNER_TRIP
}
"""


def test_nested_while_trip_counts_multiply():
    text = module(
        f"ROOT %w = (s32[], f32[8]{{0}}) while(%p), condition=%outer_cond, body=%outer_body, {trip(4)}",
        computations=LOOPS.replace("INNER_TRIP", trip(5)),
    )
    result = {(c.kind, c.axes): (c.count, c.bytes) for c in hlo.tally(text, AXES, IDS)}
    assert result == {
        ("all-gather", ("data",)): (4, 4 * 32),  # outer body, 4 runs: f32[8] = 32 bytes
        ("all-reduce", ("tensor",)): (20, 20 * 128),  # inner body, 4 * 5 runs: f32[4,8] = 128 bytes
        ("all-reduce", ("data",)): (24, 24 * 4),  # inner condition, 4 * (5 + 1) runs: f32[1] = 4 bytes
    }


def test_while_without_trip_count_counts_once_and_warns():
    text = module(
        f"ROOT %w = (s32[], f32[8]{{0}}) while(%p), condition=%outer_cond, body=%outer_body, {trip(3)}",
        computations=LOOPS.replace(", INNER_TRIP", ""),
    )
    result = hlo.tally(text, AXES, IDS)
    counts = {(c.kind, c.axes): c.count for c in result}
    assert counts[("all-reduce", ("tensor",))] == 3  # 3 outer trips x 1
    assert any("%w_in has no known_trip_count" in w for w in result.warnings)


def test_computation_called_from_several_places():
    shared = """
%shared (s: f32[8]) -> f32[8] {
  %s = f32[8]{0} parameter(0)
  ROOT %s_ar = f32[8]{0} all-reduce(%s), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
}

%fused (f: f32[8]) -> f32[8] {
  %f = f32[8]{0} parameter(0)
  ROOT %f_call = f32[8]{0} call(%f), to_apply=%shared
}

%body (b: f32[8]) -> f32[8] {
  %b = f32[8]{0} parameter(0)
  ROOT %b_call = f32[8]{0} call(%b), to_apply=%shared
}

%cond (c: f32[8]) -> pred[] {
  %c = f32[8]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}
"""
    text = module(
        "%c1 = f32[8]{0} call(%p), to_apply=%shared",
        "%c2 = f32[8]{0} fusion(%p), kind=kCustom, calls=%fused",
        f"%w = f32[8]{{0}} while(%p), condition=%cond, body=%body, {trip(6)}",
        "%k = s32[] constant(0)",
        "ROOT %br = f32[8]{0} conditional(%k, %p, %p), branch_computations={%shared, %body}",
        computations=shared,
    )
    result = hlo.tally(text, AXES, IDS)
    # direct call 1 + via fusion 1 + while body 6 + branch 0 (%shared) 1 + branch 1 (%body) 1 = 10
    assert only(result).count == 10
    assert only(result).bytes == 10 * 32
    assert any("conditional %br" in w for w in result.warnings)


def test_unreachable_computations_are_ignored():
    dead = f"%dead (d: f32[8]) -> f32[8] {{\n  %d = f32[8]{{0}} parameter(0)\n  ROOT {all_reduce('{}')}\n}}\n"
    assert list(hlo.tally(module(computations=dead), AXES, IDS)) == []


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
    assert only(hlo.tally(module(line), AXES, IDS)).phase == phase


def test_optimizer_scope_is_configurable():
    text = module(all_reduce("[4,2]<=[8]", op_name="jit(step)/adam_update/mul"))
    assert only(hlo.tally(text, AXES, IDS)).phase == "forward"
    assert only(hlo.tally(text, AXES, IDS, optimizer_scope="adam_update")).phase == "optimizer"


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
    collective = only(hlo.tally_compiled(compiled, mesh))
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
    result = {c.kind: c for c in hlo.tally_compiled(compiled, mesh)}
    assert {kind: (c.axes, c.count, c.bytes, c.phase) for kind, c in result.items()} == {
        "all-reduce": (("tensor",), 1, 512, "forward"),
        "all-gather": (("data",), 1, 1024, "forward"),
        "reduce-scatter": (("data", "fsdp"), 1, 512, "forward"),
        "collective-permute": (("fsdp",), 1, 512, "forward"),
        "all-to-all": (("tensor",), 1, 512, "forward"),
    }
    assert hlo.totals(result.values())["wire_bytes"] == pytest.approx(
        512 * 2 * 1 / 2 + 1024 * 1 / 2 + 512 * 3 / 4 + 512 + 512 * 1 / 2
    )

    # Second parse path: scan the text line by line, no call graph, f32 result shapes only.
    simple: dict[str, list[int]] = {}
    for shape, kind in re.findall(r"= (\(.*?\)|\S+) ([a-z\-]+?)(?:-start)?\(", compiled.as_text()):
        if kind in hlo.KINDS:
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
        with jax.named_scope(hlo.OPTIMIZER_SCOPE):
            return w - 0.1 * jax.lax.psum(g, "fsdp")

    compiled = compile_shard_map(step, mesh, jnp.ones((8, 16)), in_specs=P("data"), out_specs=P("data"))
    found = {(c.kind, c.axes, c.phase, c.bytes) for c in hlo.tally_compiled(compiled, mesh)}
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
    assert only(hlo.tally_compiled(compiled, mesh)).axes == ("b",)
