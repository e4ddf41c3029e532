"""Remat policies driven by `checkpoint_name`, host offload, and the residual report.

A policy decides, for each value the forward computes, whether the backward keeps it (saved),
keeps it in host memory (offloaded) or computes it again (recomputed). Policies are JAX's
`jax.checkpoint_policies`; this module names them and builds them from tensor names.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import grad_reads, runtime, tracing

MINIMAL_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo")


def checkpoint_name(tensor: Any, name: str) -> Any:
  """Names `tensor` for remat policies; the identity outside bridged code.

  Inside bridged code it is JAX's `checkpoint_name`, so `Remat(save=(name,))` keeps the tensor for
  the backward and `Remat(offload=(name,))` keeps it in host memory. Eager and LazyTensor code
  gets the tensor back unchanged.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> q = jb.checkpoint_name(torch.ones(2) * 3, "query_proj")
    >>> q.tolist()
    [3.0, 3.0]
  """
  if not isinstance(name, str) or not name:
    raise errors.BadArgumentError(f"name: expected a non-empty string, got {name!r}.")
  if tracing.is_traced(tensor):
    runtime.jax_module()
    from jax.ad_checkpoint import checkpoint_name as jax_checkpoint_name

    return grad_reads.like(tracing.to_torchax(jax_checkpoint_name(tensor.jax(), name)), tensor)
  return tensor


@dataclasses.dataclass(frozen=True)
class Remat:
  """A remat configuration: names to save, names to offload to host, and a policy for the rest.

  Args:
    save: checkpoint names whose tensors the backward keeps in device memory.
    offload: checkpoint names whose tensors the backward keeps in host memory (`pinned_host`).
    policy: what happens to every other value: a preset name, a `jax.checkpoint_policies`
      policy, or None (recompute it).

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> jb.Remat(save=("query_proj",), offload=("mlpwo",), policy="dots_no_batch")
    Remat(save=('query_proj',), offload=('mlpwo',), policy='dots_no_batch')
  """
  save: tuple = ()
  offload: tuple = ()
  policy: str | Callable[..., Any] | None = None

  def __post_init__(self) -> None:
    for field in ("save", "offload"):
      value = getattr(self, field)
      names = (value,) if isinstance(value, str) else tuple(value)
      if not all(isinstance(n, str) and n for n in names):
        raise errors.BadArgumentError(f"Remat.{field}: expected checkpoint names (strings), "
                                      f"got {value!r}.")
      object.__setattr__(self, field, names)
    both = sorted(set(self.save) & set(self.offload))
    if both:
      raise errors.BadArgumentError(
          f"Remat: {both} are in both `save` and `offload`; a tensor is either kept on the "
          f"device (save) or in host memory (offload). Remove each from one of the two.")
    if self.policy is not None:
      policy_for(self.policy)  # validates


# What `remat=` accepts: None, a preset name, a `Remat`, or a `jax.checkpoint_policies` policy.
RematArg = str | Remat | Callable[..., Any] | None

# Ops XLA fuses into the ops that read them. In an unrolled program their results are recomputed
# inside the backward's fusions rather than stored; a scan body stores every value `jax.vjp` keeps,
# one buffer per layer, so its default policy recomputes these instead (`save_unfused`).
FUSED_PRIMITIVES = frozenset("""
    abs add and bitcast_convert_type broadcast_in_dim ceil clamp concatenate convert_element_type
    copy copy_p cos cosh div eq erf erf_inv exp exp2 expand_dims expm1 floor ge gt imag
    integer_pow iota is_finite le log log1p logistic lt max min mul name ne neg not or pad pow
    real reduce_precision rem reshape rev round rsqrt select_n sign sin sinh slice sqrt square
    squeeze stop_gradient sub tan tanh transpose xor""".split())


def save_unfused(prim: Any, *_: Any, **__: Any) -> bool:
  """The scan body's policy for `remat=None`: saves what is not elementwise or a layout change
  (matmuls, reductions, gathers ...), recomputes the rest, as XLA's fusion does in an unrolled
  program; no matmul runs twice.

  Example:
    >>> jax = runtime.jax_module()
    >>> save_unfused(jax.lax.dot_general_p), save_unfused(jax.lax.exp_p)
    (True, False)
  """
  return prim.name not in FUSED_PRIMITIVES


def from_partition_fn(partition_fn: Any, remat: RematArg, caller: str) -> RematArg:
  """The `remat=` value standing for upstream's `partition_fn=` (functorch partitioners): with
  `default_partition` the backward keeps every value `jax.vjp` keeps (nothing recomputed), with
  `min_cut_rematerialization_partition` it recomputes elementwise and layout ops
  (`save_unfused`, as min-cut recomputes the cheap ops); None leaves `remat` as it is.

  Example:
    >>> from functorch.compile import min_cut_rematerialization_partition
    >>> from_partition_fn(min_cut_rematerialization_partition, None, "scan") is save_unfused
    True
  """
  if partition_fn is None:
    return remat
  if remat is not None:
    raise errors.BadArgumentError(
        f"{caller}: partition_fn= and remat= both given; they choose the same thing (what the "
        f"backward recomputes). Give one of them.")
  module = getattr(partition_fn, "__module__", None) or ""
  name = getattr(partition_fn, "__name__", None)
  if module.startswith(("functorch", "torch._functorch")):
    if name == "default_partition":
      return runtime.jax_module().checkpoint_policies.everything_saveable
    if name == "min_cut_rematerialization_partition":
      return save_unfused
  raise errors.BadArgumentError(
      f"{caller}: partition_fn={partition_fn!r} is not one this package maps: it traces with JAX, "
      f"not AOTAutograd. Use functorch.compile's default_partition or "
      f"min_cut_rematerialization_partition, or choose a remat policy with remat= (a preset: "
      f"{', '.join(_PRESETS)}; a jb.Remat; a jax.checkpoint_policies policy).")


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named remat policy: `make()` builds the JAX policy (on first use); `offloads` says whether
  it moves tensors to host memory; `summary` is its line in the docs."""
  make: Callable[[], Callable]
  offloads: bool
  summary: str


_PRESETS: dict[str, Preset] = {}


def register_preset(name: str, make: Callable[[], Callable], summary: str, *,
                    offloads: bool = False) -> None:
  """Adds the preset `name`: `remat=name` then means the policy `make()` returns. The one place
  presets are listed: errors, docs checks and the recipe's config read `presets()`.

  Example:
    >>> register_preset("demo", lambda: None, "nothing")
    >>> "demo" in presets()
    True
    >>> del _PRESETS["demo"]  # the doctest's own cleanup
  """
  _PRESETS[name] = Preset(make, offloads, summary)
  policy_for.cache_clear()


def presets() -> dict[str, Preset]:
  """The remat presets by name, in registration order.

  Example:
    >>> list(presets())[:2]
    ['full', 'dots']
  """
  return dict(_PRESETS)


def _preset(name: str) -> Callable:
  found = _PRESETS.get(name)
  if found is None:
    raise errors.BadArgumentError(
        f"remat: unknown preset {name!r}; choose one of {', '.join(_PRESETS)}, a jb.Remat(...), "
        f"a jax.checkpoint_policies policy, or None.")
  return found.make()


def _names_policy(save: tuple[str, ...], offload: tuple[str, ...],
                  base: Callable | None) -> Callable:
  jax = runtime.jax_module()
  named = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=save, names_which_can_be_offloaded=offload,
      offload_src="device", offload_dst="pinned_host")
  if base is None:
    return named
  chosen = frozenset(save) | frozenset(offload)

  def policy(prim: Any, *args: Any, **params: Any) -> Any:
    if prim.name == "name" and params.get("name") in chosen:
      return named(prim, *args, **params)
    return base(prim, *args, **params)

  return policy


@functools.lru_cache(maxsize=None)
def policy_for(remat: RematArg) -> Callable | None:
  """The JAX checkpoint policy for a `remat=` value, or None for "keep what jax.vjp keeps".

  Accepts None, a preset name (`presets()`), a `Remat`, or a `jax.checkpoint_policies` policy.

  Example:
    >>> policy_for("full") is runtime.jax_module().checkpoint_policies.nothing_saveable
    True
  """
  if remat is None:
    return None
  if isinstance(remat, str):
    return _preset(remat)
  if isinstance(remat, Remat):
    base = policy_for(remat.policy) if remat.policy is not None else None
    if not remat.save and not remat.offload:
      return base or runtime.jax_module().checkpoint_policies.nothing_saveable
    return _names_policy(remat.save, remat.offload, base)
  if callable(remat):
    return remat
  raise errors.BadArgumentError(
      f"remat: expected None, one of {', '.join(_PRESETS)}, a jb.Remat(...) or a "
      f"jax.checkpoint_policies policy; got {remat!r}.")


def offloads(remat: RematArg) -> bool:
  """Whether a `remat=` value moves any tensor to host memory.

  Example:
    >>> offloads("minimal_offloaded"), offloads("minimal")
    (True, False)
  """
  if isinstance(remat, str) and remat in _PRESETS:
    return _PRESETS[remat].offloads
  return isinstance(remat, Remat) and (bool(remat.offload) or offloads(remat.policy))


@functools.cache
def warn_offload_dropped(platform: str) -> None:
  """Says once per platform that JAX drops host-offload annotations there."""
  warnings.warn(
      f"remat offload: JAX drops host-memory placement on '{platform}', so offloaded tensors "
      f"stay in device memory here. Offload takes effect on TPU and GPU; to check the "
      f"annotations on this machine, use jb.lower_bridged(..., platform='tpu').", stacklevel=3)


def _policies() -> Any:
  return runtime.jax_module().checkpoint_policies


register_preset("full", lambda: _policies().nothing_saveable,
                "saves nothing: every value is computed again in the backward")
register_preset("dots", lambda: _policies().checkpoint_dots,
                "saves the results of matmuls, recomputes the rest")
register_preset("dots_no_batch", lambda: _policies().dots_with_no_batch_dims_saveable,
                "saves matmul results without batch dimensions (the projections, not attention "
                "scores)")
register_preset("minimal", lambda: _names_policy(MINIMAL_NAMES, (), None),
                "saves the tensors named " + ", ".join(MINIMAL_NAMES))
register_preset("minimal_offloaded", lambda: _names_policy((), MINIMAL_NAMES, None),
                "as minimal, kept in host memory", offloads=True)
