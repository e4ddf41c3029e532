"""`scan_layers`: a stack of identical layers run as one `jax.lax.scan` in one bridged call.

The layers' parameters and buffers are stacked along a new leading axis; the one-layer torch code
is converted once and becomes the scan body, so trace and compile time do not grow with depth.
"""
import contextlib
import functools
import weakref

import torch

from torch_xla_jaxbridge import autograd, convert, errors, remat as remat_policies, runtime, spmd

# The scan's bridged function, shared by layer stacks of one structure, and kept as long as the
# program runs (a stack whose structure has no key is tied to its first layer instead).
_BY_STRUCTURE = {}
_BY_LAYER = weakref.WeakKeyDictionary()


def scan_layers(layers, input_data, *, remat=None, shared_args=(), shared_kwargs=None):
  """Runs `layers` in sequence on `input_data` as one scanned, bridged computation.

  Same first two arguments as `torch_xla.experimental.scan_layers.scan_layers`. Layer `i` is
  called as `layer(carry, *shared_args, **shared_kwargs)` and must return a value of the same
  structure as `carry` (a tensor, or a tuple such as `(hidden, aux)`). Gradients reach each
  layer's own parameters. Randomness differs per layer and per call.

  Args:
    layers: structurally identical modules (same classes, parameter shapes, plain attributes).
    input_data: the first layer's carry input.
    remat: policy for the scan body (see docs/remat.md); None keeps what `jax.vjp` keeps.
    shared_args, shared_kwargs: extra inputs given unchanged to every layer (positions, masks).

  Returns:
    The last layer's output (`input_data` itself when `layers` is empty).

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> layers = [torch.nn.Linear(8, 8).to("xla") for _ in range(4)]
    >>> out = jb.scan_layers(layers, torch.randn(2, 8, device="xla"))
  """
  layers = list(layers)
  if not layers:
    return input_data
  stack = _LayerStack.of(layers)
  params, buffers, training = stack.state()
  return stack.bridged(remat)(len(layers), params, buffers, training, input_data,
                              tuple(shared_args), shared_kwargs or {})


class _LayerStack:
  """The layers of a `scan_layers` call, checked and walked once: later calls with the same layer
  objects read their current tensors through cached walks (the structure check and module walks
  were two thirds of a 32-layer call's host time). Tensor shapes are compared on every call;
  plain attributes are read when the stack is first seen.

  Example:
    >>> stack = _LayerStack.of([torch.nn.Linear(2, 2) for _ in range(3)])
    >>> params, buffers, training = stack.state()
    >>> params["weight"].shape
    torch.Size([3, 2, 2])
  """

  _by_first = weakref.WeakKeyDictionary()  # first layer -> {layer ids: _LayerStack}

  @classmethod
  def of(cls, layers):
    stacks = cls._by_first.setdefault(layers[0], {})
    ids = tuple(map(id, layers))
    stack = stacks.get(ids)
    if stack is None or any(ref() is not layer for ref, layer in zip(stack.refs, layers)):
      stack = stacks[ids] = cls(layers)
    return stack

  def __init__(self, layers):
    _check_identical(layers)
    self.refs = [weakref.ref(l) for l in layers]
    self.walks = [autograd._StateWalk(l) for l in layers]
    template = layers[0]
    self.template = weakref.ref(template)
    self.structure = autograd.structure_key(template)

  def state(self):
    """`(params, buffers, training)`: each parameter and buffer stacked over layers, in the graph
    (gradients reach each layer's own tensors through the stack's backward), and the first
    layer's modes."""
    states = [walk.state() for walk in self.walks]
    reference = _shapes(states[0])
    if any(_shapes(s) != reference for s in states[1:]):
      _check_identical([ref() for ref in self.refs])  # raises, naming what differs
    params = {n: _stack([s[0][n] for s in states]) for n in states[0][0]}
    buffers = {n: torch.stack([s[1][n] for s in states]) for n in states[0][1]}
    return params, buffers, states[0][2]

  def bridged(self, remat):
    """The scan's bridged function, shared by stacks of one structure and remat policy."""
    template = self.template()
    table, key = (_BY_STRUCTURE, (self.structure, remat)) if self.structure is not None else (
        _BY_LAYER.setdefault(template, {}), remat)
    bridged = table.get(key)
    if bridged is None:
      bridged = table[key] = autograd.Bridged(
          functools.partial(_scan, template, remat_policies.policy_for(remat)),
          name=f"scan_{type(template).__name__}")
    return bridged


def _shapes(state):
  params, buffers, _ = state
  return [(t.shape, t.dtype) for t in (*params.values(), *buffers.values())]


def _check_identical(layers):
  first = layers[0]
  reference = _describe(first)
  for i, layer in enumerate(layers[1:], start=1):
    if type(layer) is not type(first):
      raise errors.BadArgumentError(
          f"scan_layers: layers[{i}] is a {type(layer).__name__}, layers[0] a "
          f"{type(first).__name__}; every layer must have the same structure.")
    described = _describe(layer)
    for name in list(reference) + [k for k in described if k not in reference]:
      if reference.get(name) != described.get(name):
        raise errors.BadArgumentError(
            f"scan_layers: layers[{i}] {name!r} is {described.get(name, 'missing')}, but in "
            f"layers[0] it is {reference.get(name, 'missing')}; every layer must have the same "
            f"parameters, buffers and plain attributes.")


def _describe(layer):
  described = {}
  for kind, items in (("parameter", layer.named_parameters()), ("buffer", layer.named_buffers())):
    for name, t in items:
      described[name] = f"{kind} {tuple(t.shape)} {t.dtype}"
  for name, sub in layer.named_modules():
    described[f"{name or '<layer>'} class"] = type(sub).__name__
    for attr, value in vars(sub).items():
      if not attr.startswith("_") and isinstance(value, (int, float, bool, str)):
        described[f"{name}.{attr}" if name else attr] = repr(value)
  return described


def _stack(tensors):
  """`torch.stack`; under SPMD each layer's gradient comes back sharded as its parameter (the
  stack's own backward leaves that to propagation, which can replicate it)."""
  shardings = spmd.shardings_of(tensors)
  if shardings is None:
    return torch.stack(tensors)
  return _ShardedStack.apply(shardings, *tensors)


class _ShardedStack(torch.autograd.Function):

  @staticmethod
  def forward(ctx, shardings, *tensors):
    ctx.shardings = shardings
    return torch.stack(tensors)

  @staticmethod
  def backward(ctx, grad):
    grads = [g.clone() for g in grad.unbind(0)]  # annotate copies, not views of the stack
    spmd.shard_like(grads, ctx.shardings)
    return (None, *grads)


def _scan(template, policy, count, params, buffers, training, carry, shared_args, shared_kwargs):
  """The bridged torch function: runs under torchax, with stacked torchax tensors."""
  jax = runtime.jax_module()
  env = convert.environment()
  unwrap, wrap = convert.to_jax, convert.to_torchax

  def run_layer(carry, layer_params, layer_buffers, key):
    buffers_in = wrap(layer_buffers)
    with env.override_property(prng=key) if key is not None else contextlib.nullcontext():
      before = env.param.prng
      out = autograd._module_forward(template, wrap(layer_params), buffers_in, training,
                                     (wrap(carry),) + tuple(shared_args), shared_kwargs)
      drew.append(env.param.prng is not before)
    changed = [n for n, b in buffers_in.items() if b._elem is not layer_buffers[n]]
    if changed:
      raise errors.MutationError(
          f"scan_layers: the layers update buffers {changed} in place (e.g. BatchNorm running "
          f"statistics), which a scan cannot write back yet. Bridge each layer with "
          f"jb.BridgeModule instead, or put the layer in eval mode.")
    out = unwrap(out)
    if jax.tree.structure(out) != jax.tree.structure(carry):
      raise errors.BadArgumentError(
          f"scan_layers: a layer returned {jax.tree.structure(out)} for a carry of structure "
          f"{jax.tree.structure(carry)}; each layer must return what it takes (e.g. (hidden, "
          f"aux) for (hidden, aux)).")
    return out

  # per-layer keys only for layers that draw random numbers: splitting keys costs compile time
  drew = []
  first_layer = jax.tree.map(lambda a: a[0], (unwrap(params), unwrap(buffers)))
  jax.eval_shape(lambda c, p, b: run_layer(c, p, b, jax.random.key(0)), unwrap(carry),
                 *first_layer)
  keys = jax.random.split(env.get_and_rotate_prng_key(), count) if drew[0] else None

  def body(carry, xs):
    layer_params, layer_buffers, key = xs
    return run_layer(carry, layer_params, layer_buffers, key), None

  if policy is not None:
    body = jax.checkpoint(body, policy=policy)
  final, _ = jax.lax.scan(body, unwrap(carry), (unwrap(params), unwrap(buffers), keys),
                          length=count)
  return wrap(final)
