"""Scaled float8 matmuls: each operand quantized with its scales, accumulated in float32.

A linear layer runs three GEMMs: the forward y = x W, the input gradient dx = dy W^T and the weight
gradient dW = x^T dy. A recipe scales each GEMM's operands in blocks along its contraction, with
scale = amax(block) / max(format) of this step (current scaling) and q = x / scale cast to float8:
  tensorwise  one scale per tensor; e4m3 forward, e5m2 gradients (Transformer Engine's
              Float8CurrentScaling in Format.HYBRID; torchao's default Float8LinearConfig).
  rowwise     one scale per row along each GEMM's contraction (a token's, an output channel's, ...),
              rounded up to a power of two; e4m3 throughout (torchao's "rowwise" recipe).
  blockwise   DeepSeek-V3 (arXiv 2412.19437) section 3.3: 1x128 tiles of activations and gradients
              along the contraction, 128x1 tiles (128 tokens of a sequence) for the weight gradient's
              operands, 128x128 blocks of weights serving W and W^T; e4m3 throughout.
A dimension that is not a multiple of 128 ends in a partial block, as DeepSeek-V3's reference
(`per_block_cast_to_fp8`) zero-pads it: a dimension under 128 (the tiny test models) is one block.
The product is of the dequantized operands in float32: the pattern XLA:GPU rewrites into cuBLASLt FP8
GEMMs for per-tensor scales; XLA:CPU computes it in float32 (correct, not fast). The recipes' table and
sources, and what each layout reduces: docs/fp8.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxpar.core.sharding import current_layout
from jaxpar.xla_workarounds import float8_gather_layout, float8_gathered

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILE = 128        # DeepSeek-V3's tile and block edge
EPS = 1e-12       # the smallest amax a scale is formed from (torchao's float8 EPS): an all-zero block


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A scaling recipe: its name, the float8 format of the gradients, power-of-two scales."""
    name: str
    grad_format: type = E4M3
    pow2: bool = False


RECIPES = {"tensorwise": Recipe("tensorwise", E5M2), "rowwise": Recipe("rowwise", E4M3, pow2=True),
           "blockwise": Recipe("blockwise", E4M3)}


def block_sizes(recipe: Recipe, kinds: str, contraction: str, weight: bool) -> tuple:
    """One block size per axis (None: the whole axis) of a GEMM operand whose axes are `kinds`: b (a
    token axis before the last), t (the last token axis: a sequence), k (the forward's contraction),
    n (the outputs). `contraction` is this GEMM's contracted kind (k, n, or t for the weight gradient)."""
    def size(kind: str):
        if recipe.name == "tensorwise":
            return None
        along = kind == contraction or (contraction == "t" and kind == "b")   # every token is contracted
        if recipe.name == "rowwise":
            return None if along else 1
        if weight:
            return TILE
        return TILE if kind == contraction else 1
    return tuple(size(k) for k in kinds)


def _grid(shape: tuple, blocks: tuple) -> tuple[tuple, tuple]:
    sizes = tuple(d if b is None else min(b, d) for d, b in zip(shape, blocks))
    return sizes, tuple(-(-d // b) for d, b in zip(shape, sizes))


def _tiled(x: jax.Array, sizes: tuple, counts: tuple) -> jax.Array:
    """x zero-padded to whole blocks and reshaped [n0, b0, n1, b1, ...]."""
    pad = [(0, n * b - d) for d, b, n in zip(x.shape, sizes, counts)]
    if any(p for _, p in pad):
        x = jnp.pad(x, pad)
    return x.reshape(tuple(v for pair in zip(counts, sizes) for v in pair))


def _untiled(t: jax.Array, shape: tuple) -> jax.Array:
    padded = tuple(t.shape[2 * i] * t.shape[2 * i + 1] for i in range(len(shape)))
    x = t.reshape(padded)
    return x[tuple(slice(0, d) for d in shape)] if padded != tuple(shape) else x


def _pow2_above(scale: jax.Array) -> jax.Array:
    """The least power of two >= scale (exact: from the float's exponent, no logarithm)."""
    mantissa, exponent = jnp.frexp(scale)
    return jnp.ldexp(jnp.ones_like(scale), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def quantize(x: jax.Array, fmt, blocks: tuple, pow2: bool = False, across: tuple[str, ...] = ()
             ) -> tuple[jax.Array, jax.Array]:
    """(q, scale): x / scale in `fmt`, saturated at its largest finite value, with one float32 scale per
    block (scale [n0, n1, ...]): amax(block) times the float32 1 / max(fmt) (XLA rewrites a division by a
    constant so; written out, a reference reproduces it bit for bit), an all-zero block's from EPS.
    `across`: mesh axes (inside shard_map) whose shards hold the rest of each block: amax is their pmax."""
    sizes, counts = _grid(x.shape, blocks)
    t = _tiled(x.astype(jnp.float32), sizes, counts)
    inner = tuple(range(1, t.ndim, 2))
    top = float(jnp.finfo(fmt).max)
    amax = jnp.max(jnp.abs(t), axis=inner, keepdims=True)
    amax = jax.lax.pmax(amax, across) if across else amax
    scale = jnp.maximum(amax, EPS) * jnp.float32(1.0 / top)
    scale = _pow2_above(scale) if pow2 else scale
    q = jnp.clip(t / scale, -top, top).astype(fmt)
    return _untiled(q, x.shape), jnp.squeeze(scale, inner)


def dequantize(q: jax.Array, scale: jax.Array, blocks: tuple) -> jax.Array:
    """q times its block's scale, in float32."""
    sizes, counts = _grid(q.shape, blocks)
    t = _tiled(q.astype(jnp.float32), sizes, counts)
    return _untiled(t * jnp.expand_dims(scale, tuple(range(1, t.ndim, 2))), q.shape)


def fake_quantized(x: jax.Array, fmt, blocks: tuple, pow2: bool = False, across: tuple[str, ...] = ()) -> jax.Array:
    """dequantize(quantize(x)): x as the GEMM sees it, in float32."""
    return dequantize(*quantize(x, fmt, blocks, pow2, across), blocks)


def _operand(x: jax.Array, recipe: Recipe, kinds: str, contraction: str, fmt) -> jax.Array:
    return fake_quantized(x, fmt, block_sizes(recipe, kinds, contraction, weight=False), recipe.pow2)


@dataclasses.dataclass(frozen=True)
class Layouts:
    """Where a scaled GEMM gathers its operands, each resolved while the forward pass is traced (None: where
    the partitioner puts it). `weight`: the layout a weight stored as `shape` is gathered to in float8,
    quantized on its shards (`--fp8-gather`, torchtitan's float8 all-gather; xla_workarounds.float8_gathered).
    `gradient`: the layout the output's gradient is gathered to before it is quantized (a row-parallel output
    under sequence parallelism arrives split over the sequence: gathered once in the compute dtype for both
    backward GEMMs, as without float8, not once per quantization). `input_quantized`: x arrives as the
    tensorwise quantization of the input (`gathered_input`), which the forward and the weight gradient
    read as it is (one scale per tensor: the same for both)."""
    weight: NamedSharding | None = None
    shape: tuple[int, ...] = ()
    gradient: NamedSharding | None = None
    input_quantized: bool = False   # x arrives quantized (tensorwise, `gathered_input`): read as it is


def _weight(w: jax.Array, recipe: Recipe, contraction: str, layouts: Layouts) -> jax.Array:
    """w [K, N] as the GEMM contracting `contraction` reads it: quantized in the recipe's weight blocks and
    dequantized, gathered in between where `layouts.weight` says, so that the gather moves float8."""
    blocks = block_sizes(recipe, "kn", contraction, weight=True)
    q, scale = quantize(w, E4M3, blocks, recipe.pow2)
    if layouts.weight is not None:
        q = float8_gathered(q.reshape(layouts.shape), layouts.weight).reshape(w.shape)
    return dequantize(q, scale, blocks)


def _tokens(x: jax.Array) -> str:
    return "b" * (x.ndim - 2) + "t"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scaled(recipe: Recipe, layouts: Layouts, x: jax.Array, w: jax.Array) -> jax.Array:
    xq = x if layouts.input_quantized else _operand(x, recipe, _tokens(x) + "k", "k", E4M3)
    return jnp.einsum("...k,kn->...n", xq, _weight(w, recipe, "k", layouts),
                      preferred_element_type=jnp.float32).astype(w.dtype)


def scaled_dot(recipe: Recipe, x: jax.Array, w: jax.Array, layouts: Layouts = Layouts()) -> jax.Array:
    """x [..., K] . w [K, N] -> [..., N] in w's dtype (the compute dtype: x may arrive quantized, in float32),
    each GEMM of the layer scaled by `recipe`; w and the output's gradient gathered as `layouts` says."""
    return _scaled(recipe, layouts, x, w)


def _forward(recipe: Recipe, layouts: Layouts, x: jax.Array, w: jax.Array):
    return _scaled(recipe, layouts, x, w), (x, w)


def _backward(recipe: Recipe, layouts: Layouts, saved, dy: jax.Array):
    """dx = dy W^T contracted over n, dW = x^T dy over the tokens, each operand scaled for its GEMM."""
    x, w = saved
    tokens, g = _tokens(x), recipe.grad_format
    if layouts.gradient is not None:
        dy = jax.lax.with_sharding_constraint(dy, layouts.gradient)
    dx = jnp.einsum("...n,kn->...k", _operand(dy, recipe, tokens + "n", "n", g), _weight(w, recipe, "n", layouts),
                    preferred_element_type=jnp.float32)
    xt = x if layouts.input_quantized else _operand(x, recipe, tokens + "k", "t", E4M3)
    dw = jnp.einsum("...k,...n->kn", xt, _operand(dy, recipe, tokens + "n", "t", g), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_scaled.defvjp(_forward, _backward)


def project(x: jax.Array, w: jax.Array, recipe: Recipe, names: tuple | None = None,
            out_names: tuple | None = None, input_quantized: bool = False) -> jax.Array:
    """x [b, s, *k] . w [*k, *out] -> [b, s, *out] (x's trailing dims with w's leading ones) as one scaled
    GEMM: the contracted dims merged into K, the output dims into N; w gathered in float8 where its logical
    `names` are given, the output's gradient gathered to the activation names `out_names`, x read as it is
    where it arrives quantized (`Layouts`)."""
    k = x.ndim - 2
    shape_k, shape_out = w.shape[:k], w.shape[k:]
    layout = current_layout()
    layouts = Layouts(None if names is None else float8_gather_layout(names), w.shape,
                      None if out_names is None or layout is None else layout.activation(*out_names),
                      input_quantized)
    y = scaled_dot(recipe, x.reshape(x.shape[:2] + (-1,)), w.reshape(math.prod(shape_k), -1), layouts)
    return y.reshape(x.shape[:2] + shape_out)


def gathered_input(x: jax.Array, names: tuple[str | None, ...], stored: tuple[str | None, ...]) -> jax.Array:
    """x [b, s, K], the column-parallel projections' input in the layout of the activation names `stored`
    (the residual stream's: its sequence split over `tensor` by sequence parallelism), quantized tensorwise
    on its shards (the amax all-reduced), all-gathered as float8 to the layout of `names` and dequantized to
    float32: the quantized input each tensorwise GEMM reading x computes (`--fp8-sp-gather`; Transformer
    Engine's float8 all-gather of a sequence-parallel input). Backward: the summed input gradient, in x's
    dtype, back to `stored` (the gather's transpose: a reduce-scatter). One device: the quantization alone."""
    layout = current_layout()
    layouts = None if layout is None else (layout.activation(*names), layout.activation(*stored))
    return _gathered_input(layouts, x.dtype, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gathered_input(layouts, dtype, x: jax.Array) -> jax.Array:
    blocks = (None,) * x.ndim
    q, scale = quantize(x, E4M3, blocks)
    return dequantize(q if layouts is None else float8_gathered(q, layouts[0]), scale, blocks)


def _gathered_input_backward(layouts, dtype, _, g: jax.Array):
    g = g.astype(dtype)
    return (g if layouts is None else jax.lax.with_sharding_constraint(g, layouts[1]),)


_gathered_input.defvjp(lambda layouts, dtype, x: (_gathered_input(layouts, dtype, x), None), _gathered_input_backward)


# ---- routed experts ------------------------------------------------------------------------------------
# A token's copies reach its experts in an order and on shards that depend on the layout, so every scale of
# an expert GEMM is a row's own or a weight's: activations and gradients per row along its width (1x128
# tiles under blockwise; a whole row under tensorwise and rowwise, where a tensor-wide amax would have to
# gather every shard's rows), weights per expert (tensorwise), per expert and output column (rowwise) or in
# 128x128 blocks (blockwise), quantized before dispatch as global arrays. The weight gradient reads the
# forward's row-scaled operands and the input gradient the forward's weights (straight through).

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight(recipe_blocks, x):
    recipe, blocks = recipe_blocks
    return fake_quantized(x, E4M3, blocks, recipe.pow2).astype(x.dtype)


_straight.defvjp(lambda rb, x: (_straight(rb, x), None), lambda rb, _, g: (g,))


def expert_weights(w: jax.Array, recipe: Recipe | None) -> jax.Array:
    """w [E, K, N] as the experts' GEMMs read it (the section above); unchanged with no recipe."""
    if recipe is None:
        return w
    return _straight((recipe, (1,) + block_sizes(recipe, "kn", "k", weight=True)), w)


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """How an expert kernel scales its activations and gradients by row (the section above): `recipe`
    (None: no scaling) and the mesh axes its hidden width is split over inside shard_map (`width_axes`)."""
    recipe: Recipe | None = None
    width_axes: tuple[str, ...] = ()

    def _blocks(self, x: jax.Array, hidden: bool) -> tuple[tuple, tuple[str, ...]]:
        across = self.width_axes if hidden else ()
        tile = TILE if self.recipe.name == "blockwise" and not (across and x.shape[-1] % TILE) else None
        return (1,) * (x.ndim - 1) + (tile,), across if tile is None else ()

    def inputs(self, x: jax.Array, hidden: bool = False) -> jax.Array:
        """x's rows as a GEMM reads them; `hidden`: rows of the expert width (split over width_axes)."""
        return x if self.recipe is None else _rows(self, hidden, x)

    def gradient(self, y: jax.Array, hidden: bool = False) -> jax.Array:
        """y unchanged; the gradient reaching it quantized by row in the recipe's gradient format."""
        return y if self.recipe is None else _row_gradient(self, hidden, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rows(scaling: ExpertRows, hidden: bool, x: jax.Array) -> jax.Array:
    blocks, across = scaling._blocks(x, hidden)
    return fake_quantized(x, E4M3, blocks, scaling.recipe.pow2, across).astype(x.dtype)


_rows.defvjp(lambda sc, hidden, x: (_rows(sc, hidden, x), None), lambda sc, hidden, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _row_gradient(scaling: ExpertRows, hidden: bool, y: jax.Array) -> jax.Array:
    return y


def _row_gradient_backward(scaling: ExpertRows, hidden: bool, _, g: jax.Array):
    blocks, across = scaling._blocks(g, hidden)
    return (fake_quantized(g, scaling.recipe.grad_format, blocks, scaling.recipe.pow2, across).astype(g.dtype),)


_row_gradient.defvjp(lambda sc, hidden, y: (y, None), _row_gradient_backward)
