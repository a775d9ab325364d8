"""Tests for jaxpar.analysis.hlo_text, the HLO reader: shape sizes (dtypes, tuples, async forms) and the
call graph (loop trip counts, shared computations, dead code), read through the tally that multiplies them.
Hand-written HLO; the helpers below (a module around some instructions, an all-reduce line, a 4 x 2
mesh) serve tests/test_tally.py too.

Every expected number is worked out by hand from the shapes in the test, in the comment beside it.
"""

import numpy as np
import pytest

from jaxpar.analysis.tally import tally
from jaxpar.collectives import Collective

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


def only(result) -> Collective:
    assert len(result) == 1, result
    return result[0]


# ---------------------------------------------------------------------------------------------
# Sizes: dtypes, tuples, async forms
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
    collective = only(tally(module(all_reduce("{{0,1},{2,3},{4,5},{6,7}}", shape)), AXES, IDS))
    assert collective.bytes == nbytes
    assert collective.wire_bytes == pytest.approx(2 * (2 - 1) / 2 * nbytes)  # AR over 2 devices


def test_tuple_collective_sums_its_elements():
    shape = "(f32[4]{0}, bf16[8]{0}, f32[2,2]{1,0}, s32[1]{0}, f32[], /*index=5*/f32[3]{0})"
    collective = only(tally(module(all_reduce("[4,2]<=[8]", shape)), AXES, IDS))
    assert collective.count == 1
    assert collective.bytes == 16 + 16 + 16 + 4 + 4 + 12


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
    result = {c.kind: c for c in tally(text, AXES, IDS)}
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
    assert only(tally(text, AXES, IDS)).bytes == 64



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
    result = {(c.kind, c.axes): (c.count, c.bytes) for c in tally(text, AXES, IDS)}
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
    result = tally(text, AXES, IDS)
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
    result = tally(text, AXES, IDS)
    # direct call 1 + via fusion 1 + while body 6 + branch 0 (%shared) 1 + branch 1 (%body) 1 = 10
    assert only(result).count == 10
    assert only(result).bytes == 10 * 32
    assert any("conditional %br" in w for w in result.warnings)


def test_unreachable_computations_are_ignored():
    dead = f"%dead (d: f32[8]) -> f32[8] {{\n  %d = f32[8]{{0}} parameter(0)\n  ROOT {all_reduce('{}')}\n}}\n"
    assert list(tally(module(computations=dead), AXES, IDS)) == []
