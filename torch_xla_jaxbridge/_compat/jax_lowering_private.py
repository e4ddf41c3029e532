"""JAX's lowering rules and primitives (`jax._src.interpreters.mlir`, `jax.extend`,
`jax.interpreters`), one function each: where the package lowers an operation its own way.

As in `jax_private`: each says why the package needs it and the public alternative where one
exists; `test/test_compat.py` checks each directly.
"""
from __future__ import annotations

from typing import Any, Callable

from torch_xla_jaxbridge._compat.jax_private import _jax


def wrap_with_sharding_op(ctx: Any, value: Any, aval: Any, op_sharding: Any) -> Any:
  """Lowering helper: an HLO `Sharding` custom call on `value` (GSPMD form under
  `gspmd_partitioner()`). Used by `jb.spmd`'s constraint primitive; `jax.lax.with_sharding_
  constraint` would need a JAX mesh over JAX's devices, which torch_xla owns.

  Example:
    >>> callable(wrap_with_sharding_op)
    True
  """
  from jax._src.interpreters import mlir

  return mlir.wrap_with_sharding_op(ctx, value, aval, op_sharding)


def op_sharding() -> Any:
  """A new, empty `xla_client.OpSharding` (the proto JAX lowers shardings from).

  Example:
    >>> op_sharding().tile_assignment_dimensions
    []
  """
  _jax()
  from jax._src.lib import xla_client

  return xla_client.OpSharding()


def wrap_cpu_lowering(primitive: Any, wrapper: Callable) -> None:
  """Replaces `primitive`'s CPU lowering rule by `wrapper(original_rule)`, the rule called as
  `rule(ctx, *operands, **params)`; `mlir.lower_fun` builds a rule from a JAX function. The
  project's own rules need it where XLA:CPU wants another form of the same operation
  (`_core.cpu_convolutions`). Breaks if JAX renames its lowering table: `test_compat` checks.
  Public alternative: `jax.extend`'s `mlir.register_lowering`, which cannot read the rule it
  replaces.

  Example:
    >>> jax = _jax()
    >>> from jax._src.lax import lax
    >>> wrap_cpu_lowering(lax.neg_p, lambda rule: rule)
  """
  _jax()
  from jax._src.interpreters import mlir

  table = mlir._platform_specific_lowerings["cpu"]
  original = table.get(primitive) or mlir._lowerings[primitive]
  table[primitive] = mlir.LoweringRuleEntry(wrapper(original.rule), original.inline)


def lower_fun(fn: Callable) -> Callable:
  """A lowering rule that lowers the JAX function `fn(*operands)` (one result) in place of the
  primitive. Public alternative: none (`jax.extend.mlir` has no `lower_fun`).

  Example:
    >>> callable(lower_fun(lambda x: x))
    True
  """
  _jax()
  from jax._src.interpreters import mlir

  return mlir.lower_fun(fn, multiple_results=False)


def conv_general_dilated_primitive() -> Any:
  """The primitive `jax.lax.conv_general_dilated` binds; its params are the call's keywords, with
  `dimension_numbers` a `ConvDimensionNumbers` of (lhs_spec, rhs_spec, out_spec).

  Example:
    >>> conv_general_dilated_primitive().name
    'conv_general_dilated'
  """
  _jax()
  from jax._src.lax import convolution

  return convolution.conv_general_dilated_p


def generic_lowering_rule(primitive: Any) -> Callable | None:
  """`primitive`'s lowering rule for any platform (the one a platform without its own uses), or
  None where it has none. Breaks if JAX renames its lowering table: `test_compat` checks.
  Public alternative: none (`mlir.register_lowering` writes the table but cannot read it).

  Example:
    >>> from jax._src.lax import linalg
    >>> callable(generic_lowering_rule(linalg.cholesky_p))
    True
  """
  _jax()
  from jax._src.interpreters import mlir

  entry = mlir._lowerings.get(primitive)
  return entry.rule if entry is not None else None


def linalg_primitives(*names: str) -> list:
  """The primitives of `jax.lax.linalg` named `names` (e.g. "cholesky" for `cholesky_p`).
  Public alternative: none (`jax.lax.linalg` exports the functions, not the primitives).

  Example:
    >>> [p.name for p in linalg_primitives("cholesky", "lu")]
    ['cholesky', 'lu']
  """
  _jax()
  from jax._src.lax import linalg

  return [getattr(linalg, f"{name}_p") for name in names]


def jaxlib_custom_call_targets() -> frozenset:
  """The custom call targets jaxlib registers with JAX's own XLA runtime (LAPACK, cuSOLVER,
  cuSPARSE, ... and the Python callbacks): programs that call them run only there. Breaks if
  jaxlib moves its `registrations()`; `test_compat` checks LAPACK's Cholesky is among them.

  Example:
    >>> "lapack_spotrf_ffi" in jaxlib_custom_call_targets()
    True
  """
  _jax()
  import importlib

  names: set[str] = set()
  for module in ("lapack", "cpu_sparse", "gpu_linalg", "gpu_prng", "gpu_solver", "gpu_sparse"):
    try:
      registrations = importlib.import_module(f"jaxlib.{module}").registrations()
    except (ImportError, AttributeError):  # a plugin this jaxlib build does not have
      continue
    names.update(entry[0] for entries in registrations.values() for entry in entries)
  for kind in ("python", "ffi_python", "ffi_partitioned_python"):
    names.update(f"xla_{kind}_{platform}_callback" for platform in ("cpu", "gpu"))
  names.add("xla_buffer_python_gpu_callback")
  return frozenset(names)


def identity_primitive(name: str, lower: Callable, batched_params: Callable) -> Any:
  """A JAX primitive that is the identity on values and linear (its transpose binds it on the
  cotangent with the same params), lowered by `lower(ctx, x, **params)` (a list of one value),
  vmapped with `batched_params(dim, **params)` (the params for an operand with a batch dimension
  at `dim`). For a constraint that only annotates a value (`_integrations.spmd`). Public
  alternative: the same, from `jax.extend.core` and `jax.interpreters` (ad, batching, mlir),
  which JAX changes between versions: `test_compat` checks.

  Example:
    >>> jax = _jax()
    >>> noted = identity_primitive("noted", lambda ctx, x, **p: [x], lambda dim, **p: p)
    >>> jax.grad(lambda x: noted.bind(x * 2.0) * 3.0)(1.0)
    Array(6., dtype=float32, weak_type=True)
  """
  _jax()
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching, mlir

  primitive = Primitive(name)
  primitive.def_impl(lambda x, **params: x)
  primitive.def_abstract_eval(lambda x, **params: x)
  ad.deflinear2(primitive, lambda ct, x, **params: [primitive.bind(ct, **params)])

  def batched(args, dims, **params):
    (x,), (dim,) = args, dims
    if dim is batching.not_mapped:
      return primitive.bind(x, **params), dim
    return primitive.bind(x, **batched_params(dim, **params)), dim

  batching.primitive_batchers[primitive] = batched
  mlir.register_lowering(primitive, lower)
  return primitive


def kept_inputs(lowered: Any) -> tuple[int, ...]:
  """The positions of the inputs a program lowered by `jax.jit(..., keep_unused=False)` reads
  (its parameters, in order). Public alternative: none (`Lowered.args_info` lists every input).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> aval = jax.ShapeDtypeStruct((2,), jnp.float32)
    >>> kept_inputs(jax.jit(lambda a, b, c: a + c).trace(aval, aval, aval).lower())
    (0, 2)
  """
  return tuple(sorted(lowered._lowering.compile_args["kept_var_idx"]))
