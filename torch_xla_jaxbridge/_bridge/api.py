"""`bridge`, `assume_pure`: a torch function as a bridged call that falls back where it must."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._bridge import auto, fallback as fallbacks, rollback
from torch_xla_jaxbridge._bridge import remat as remat_policies
from torch_xla_jaxbridge._bridge.bridging import Bridged


class Fallback:
  """A bridged function's way out: the call as plain LazyTensor code, with the modules the
  function reads (closure, globals, `self`) bridged one by one while it runs."""

  def __init__(self, bridged: Bridged, enabled: bool) -> None:
    self.bridged, self.enabled = bridged, enabled
    self.outcome = fallbacks.Outcome(bridged.name, "function", lambda: bridged.traces)

  def call(self, bridged_call: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    """`bridged_call()`, the bridged call on `args`, `kwargs`; where it cannot be bridged (or
    fell back for good before), `run`."""
    outcome = self.outcome
    if not outcome.fell_back:
      ran, outputs = rollback.attempt(bridged_call,
                                      lambda: rollback.region_of(self.bridged.fn, args, kwargs),
                                      lambda e: outcome.fall_back(e, self.enabled))
      if ran:
        outcome.bridged_again()
        return outputs
    with outcome.plain_run():
      return self.run(args, kwargs)

  def run(self, args: tuple, kwargs: dict) -> Any:
    settings = auto.Settings(self.bridged.name, None, self.enabled)
    with auto.captured_bridged(self.bridged.fn, settings):
      return self.bridged.fn(*args, **kwargs)


def described(value: object) -> str:
  """`value` as an error message names it: its type, and its shape or (short) value.

  Example:
    >>> described(3), described(torch.zeros(2, 3))
    ('an int (3)', 'a Tensor of shape (2, 3)')
  """
  kind = type(value).__name__
  article = "an" if kind[:1].lower() in "aeiou" else "a"
  if isinstance(value, torch.Tensor):
    return f"{article} {kind} of shape {tuple(value.shape)}"
  shown = repr(value)
  return f"{article} {kind} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def check_function(fn: object, where: str, takes: str) -> None:
  """Raises `BadArgumentError` where `fn` is not callable, when the call that takes it is made
  (not at its first use): `where` is the entry point, `takes` what it takes, with an example.

  Example:
    >>> check_function(abs, "bridge", "a function")  # fine
    >>> check_function(3, "bridge", "a function")
    Traceback (most recent call last):
    ...
    torch_xla_jaxbridge.errors.BadArgumentError: bridge: its first argument is an int (3), not a function; it takes a function
  """
  if not callable(fn):
    raise errors.BadArgumentError(
        f"{where}: its first argument is {described(fn)}, not a function; it takes {takes}")


def with_fallback(bridged: Bridged, enabled: bool) -> Bridged:
  """`bridged`, falling back to plain LazyTensor code where it cannot be bridged (`enabled`), or
  raising the error there.

  Example:
    >>> with_fallback(Bridged(abs), True).fallback.outcome.status
    'bridged'
  """
  bridged.fallback = Fallback(bridged, enabled)
  return bridged


_BRIDGE_TAKES = (
    "the torch function to bridge: `@jb.bridge` above its `def`, or `jb.bridge(fn)`, with options "
    "as keywords (`@jb.bridge(remat='full')`, `jb.bridge(fn, remat='full')`; for a module, "
    "`jb.BridgeModule(module)`).")


def bridge(fn: Callable | None = None, *, remat: remat_policies.RematArg = None,
           name: str | None = None, fallback: bool = True) -> Callable:
  """Decorator: the torch function is traced once per signature and runs as one graph node.

  The function is converted to JAX by torchax. Each call adds the forward half of `jax.vjp` to
  the LazyTensor graph through `call_jax`; torch's backward adds the backward half. Only tensors
  that require grad get gradients. Randomness (dropout, `torch.rand*`) is fresh on every call
  and reproducible under `torch_xla.manual_seed`. In-place updates of arguments are written back.

  Args:
    fn: a torch function of tensors (and static values) returning tensors.
    remat: what the backward keeps: None (what `jax.vjp` keeps), a preset name
      (`jb.remat.presets()`), a `jb.Remat`, or a `jax.checkpoint_policies` policy. See
      docs/remat.md.
    name: IR node name prefix; defaults to the function's name.
    fallback: when the code cannot be bridged (data-dependent Python control flow, an op with no
      lowering, ...), run it as plain LazyTensor code with the modules it reads bridged one by
      one, say so once (`jb.errors.FallbackWarning`) and list it in `jb.bridge_report()`;
      False raises the error instead. See docs/bridge.md.

  Returns:
    The bridged function, with the same call signature.

  Example:
    >>> import torch, torch_xla, torch_xla_jaxbridge as jb
    >>> @jb.bridge
    ... def mlp(x, w1, w2):
    ...   return torch.relu(x @ w1) @ w2
    >>> x = torch.randn(4, 8, device="xla")
    >>> w1 = torch.randn(8, 16, device="xla", requires_grad=True)
    >>> w2 = torch.randn(16, 2, device="xla", requires_grad=True)
    >>> mlp(x, w1, w2).sum().backward()
  """
  if fn is None:
    return functools.partial(bridge, remat=remat, name=name, fallback=fallback)
  check_function(fn, "bridge", _BRIDGE_TAKES)
  return with_fallback(Bridged(fn, remat=remat, name=name), fallback)


def assume_pure(fn: Callable, *, add_rng_seed_argument: bool = False, use_cache: bool = True,
                remat: remat_policies.RematArg = None, fallback: bool = True) -> Callable:
  """Upstream `torch_xla.experimental.assume_pure`'s call, built on `bridge`.

  Unlike upstream, randomness inside `fn` is fresh on every call already. With
  `add_rng_seed_argument=True` the returned function takes a keyword `rng_seed` (int or integer
  tensor) that fixes the randomness instead, as upstream's does. `use_cache` is upstream
  `assume_pure_torch`'s: True (the default here) traces `fn` once per signature (argument
  shapes, dtypes, static values; upstream's reuses one trace per function name whatever the
  shapes); False traces it again at every call, for a function whose result depends on Python
  state outside its arguments. `remat=` and `fallback=` are as for `bridge` (code that cannot be
  bridged runs as plain LazyTensor code, where upstream's raises).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> noisy = jb.assume_pure(lambda a: a + torch.randn_like(a), add_rng_seed_argument=True)
    >>> out = noisy(torch.zeros(3, device="xla"), rng_seed=0)
    >>> traces = []
    >>> every_call = jb.assume_pure(lambda a: traces.append(1) or a * 2, use_cache=False)
    >>> _ = [every_call(torch.ones(2, device="xla")) for _ in range(3)]
    >>> len(traces)
    3
  """
  check_function(fn, "assume_pure", "the torch function to run as one pure call: "
                 "`jb.assume_pure(fn)` (for a module, `jb.PureModule(module)`).")
  if not use_cache:
    @functools.wraps(fn)
    def traced_every_call(*args: Any, **kwargs: Any) -> Any:
      return assume_pure(fn, add_rng_seed_argument=add_rng_seed_argument, remat=remat,
                         fallback=fallback)(*args, **kwargs)
    return traced_every_call
  bridged = with_fallback(Bridged(fn, remat=remat), fallback)
  bridged.seeded = add_rng_seed_argument
  return bridged
