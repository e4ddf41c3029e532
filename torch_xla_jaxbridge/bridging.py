"""`bridge`, `BridgeModule`, `assume_pure`, `PureModule`: torch code traced once, backward by jax.vjp.

A bridged call flattens its arguments, splits the tensors into those that need gradients and the
rest, and adds one `call_jax` node: the forward half of `jax.vjp` of the torchax-converted
function, whose residuals stay in the graph as XLA tensors. When torch's backward reaches the
call, a second `call_jax` node applies the saved `vjp` function to the output cotangents.
"""
import contextlib
import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from torch_xla_jaxbridge import (_compat, call, captures, dtypes, errors, modules, plain, rng,
                                 runtime, spmd, stateful, tracing)
from torch_xla_jaxbridge import remat as remat_policies

DIFF, OTHER = "<diff tensor>", "<tensor>"  # markers of tensor leaves in a `Spec`
_DIFFERENTIATED = threading.local()  # .on: the function being traced is under jax.vjp / grad


class _Same(int):
  """Marks a tensor leaf that is the same tensor as the leaf at this earlier position."""
  __slots__ = ()
_ATOMS = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a trace learned about its outputs; travels as static data through `call_jax`."""
  out_tree: object
  float_mask: tuple
  mutated: tuple  # positions (among all argument leaves) updated in place
  packed: bool  # outputs in a structure only torch's pytrees know (stateful.pack_outputs)


@dataclasses.dataclass(frozen=True)
class Residuals:
  """How to rebuild the `vjp` function from the residual tensors it was flattened to: each
  residual is either a differentiable input, passed to the backward as it is (`sources[i]`
  indexes `inputs`), or a value the forward computed and returned (`sources[i]` is None)."""
  tree: object
  sources: tuple
  inputs: tuple  # positions, among the differentiable inputs, of those the backward reads
  dtypes: tuple  # of the computed residuals
  on_host: tuple  # offloaded computed residuals
  sequenced: bool = False  # a remat policy recomputes: only once the cotangents have arrived


class Spec:
  """The static part of a bridged call: argument structure, non-tensor values, which tensors
  need gradients. Equal specs (same structure, markers and static keys) share a trace.

  Example:
    >>> spec, diff, other = Spec.split(((torch.ones(2, requires_grad=True), 3), {}),
    ...                                lambda t: t.requires_grad, "f")
    >>> spec, len(diff), len(other)
    (<tensors needing grad: g>, 1, 0)
  """

  def __init__(self, treedef, leaves, keys, objects=""):
    self.treedef = treedef
    self.leaves = leaves  # DIFF / OTHER markers at tensor positions, static values elsewhere
    self.objects = objects  # the argument objects passed as their state, for re-trace reasons
    self.context = tracing.trace_keys()  # e.g. the autocast state at this call
    self.keyed = keys is not None  # False: an unhashable static, until `stateful.box` takes it
    self._key = (treedef, keys, self.context)

  @classmethod
  def split(cls, tree, needs_grad, caller):
    """`(spec, diff, other)` for a pytree of arguments: the tensors for which `needs_grad(t)`
    holds, the other tensors, and the spec that merges them back. A static leaf that cannot key
    the trace cache is an error naming it."""
    jax = runtime.jax_module()
    leaves, treedef = jax.tree.flatten(tree)
    markers, diff, other, first = [], [], [], {}
    for position, leaf in enumerate(leaves):
      if isinstance(leaf, torch.Tensor):
        if id(leaf) in first:  # the same tensor again: one input, so the trace sees one tensor
          markers.append(_Same(first[id(leaf)]))
          continue
        first[id(leaf)] = position
        needs = needs_grad(leaf)
        (diff if needs else other).append(leaf)
        markers.append(DIFF if needs else OTHER)
      else:
        markers.append(leaf)
    statics = [m for m in markers if m is not DIFF and m is not OTHER]
    objects = any(type(m) not in _ATOMS and stateful.may_hold_state(m) for m in statics)
    try:  # the common statics (flags, sizes, None) keyed by type and value without plain.key
      keys = tuple([(type(m), m) if type(m) in _ATOMS else plain.static_key(m) for m in statics])
    except plain.NotPlain:
      if not objects:  # an object may yet be passed as its state (`stateful.box`)
        call.static_keys(markers, tree, caller)  # raises, naming the leaf
      keys = None
    spec = cls(treedef, tuple(markers), keys)
    spec.has_objects = objects
    return spec, diff, other

  def __eq__(self, other):
    return isinstance(other, Spec) and self._key == other._key

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):  # read in re-trace reasons
    marks = "".join("g" if v is DIFF else "-" for v in self.leaves if v is DIFF or v is OTHER)
    return f"<tensors needing grad: {marks}{self.objects}>"

  def describe_change(self, old):  # a re-trace reason when only the context changed
    if isinstance(old, Spec) and old._key[:2] == self._key[:2]:
      return tracing.describe_key_change(old.context, self.context)
    return None

  def merge(self, diff, other):
    """The arguments' pytree with `diff` and `other` put back at their positions (a tensor that
    was passed twice at each of its places)."""
    diff, other = iter(diff), iter(other)
    full = []
    for v in self.leaves:
      full.append(next(diff) if v is DIFF else next(other) if v is OTHER else
                  full[v] if type(v) is _Same else v)
    return self.treedef.unflatten(full)


@functools.cache
def register_static_pytree():
  """Lets `Layout` and `Residuals` travel through `call_jax` as static output structure (once)."""
  jax = runtime.jax_module()
  for static in (Layout, Residuals):
    jax.tree_util.register_pytree_node(static, lambda x: ((), x), lambda aux, _: aux)


class Bridged:
  """A torch function traced once per signature through torchax; see `bridge`.

  Example:
    >>> double = Bridged(lambda x: x * 2)
    >>> double(torch.ones(2, device="xla")).cpu().tolist()
    [2.0, 2.0]
  """

  def __init__(self, fn, *, remat=None, name=None):
    self.policy = remat_policies.policy_for(remat)  # validates `remat`
    self.offloads = remat_policies.offloads(remat)
    self.fn = fn
    self.name = call.function_name(fn, name)
    self.seeded = False  # assume_pure(add_rng_seed_argument=True) passes its own seed
    self.draws_random = None  # unknown until traced; then whether any trace drew random numbers
    functools.update_wrapper(self, fn, updated=())

  def __call__(self, *args, **kwargs):
    register_static_pytree()
    if self.seeded and "rng_seed" not in kwargs:
      raise errors.MissingSeedError(
          f"{self.name}: made with add_rng_seed_argument=True, so it takes a keyword rng_seed= "
          f"(an int or an integer tensor); none was given.")
    seed = kwargs.pop("rng_seed") if self.seeded else None
    if _any_traced((args, kwargs)):  # called inside bridged code: run in the enclosing trace
      return self.inline(args, kwargs, seed)
    args = captures.with_captures(self.fn, self.name, args)  # closure/global/self tensors: inputs
    grad_on = torch.is_grad_enabled()
    needs_grad = lambda t: grad_on and t.requires_grad  # noqa: E731
    spec, diff, other = Spec.split((args, kwargs), needs_grad, self.name)
    boxed = ()
    if spec.has_objects:  # argument objects holding tensors: passed as their state
      (args, kwargs), boxed = stateful.box((args, kwargs))
      spec, diff, other = Spec.split((args, kwargs), needs_grad, self.name)
      if not spec.keyed:  # an unhashable object that holds no tensor: name it
        call.static_keys(spec.leaves, (args, kwargs), self.name)
    if boxed:
      spec.objects = "".join(f"; {stateful.summary(obj, snap)}" for obj, snap in boxed)
    device = _device(diff, other)
    floats, others, mutated, layout = self.keyed(
        lambda key: self._invoke(spec, key, diff, other), device, seed)
    _write_back(self.name, (args, kwargs), layout.mutated, mutated, diff)
    floats, others = iter(floats), iter(others)
    outputs = layout.out_tree.unflatten(
        [next(floats) if is_float else next(others) for is_float in layout.float_mask])
    if boxed:
      outputs, after = outputs
      stateful.write_back(boxed, after, device)
    return stateful.unpack_outputs(outputs, device) if layout.packed else outputs

  def keyed(self, invoke, device, seed=None):
    """`invoke(key_data)` with the random key this call needs. Code that never draws random
    numbers gets a constant key (drawing one costs host time, and a first call with a fresh key
    would make a first-step program that differs from the rest); when the trace `invoke` makes
    shows that it does draw, it is invoked again with a fresh key (`seed`: from that seed)."""
    fresh = seed is not None or bool(self.draws_random)
    result = invoke(rng.key_data(seed, device) if fresh else rng.constant_key_data(device))
    if not fresh and self.draws_random:  # this call traced code that does: a fresh key
      result = invoke(rng.key_data(None, device))
    return result

  def inline(self, args, kwargs, seed=None):
    """The torch function run directly in the enclosing trace (called inside bridged code), in
    `jax.checkpoint` with this function's remat policy when it has one; `seed` (rng_seed) fixes
    its randomness.

    Example:
      >>> inner = Bridged(lambda x: x * 2, remat="full")
      >>> Bridged(lambda x: inner(x) + 1)(torch.ones(2, device="xla")).cpu().tolist()
      [3.0, 3.0]
    """
    jax = runtime.jax_module()
    with_path, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    for path, leaf in with_path:
      if isinstance(leaf, torch.Tensor) and not tracing.is_traced(leaf):
        raise errors.CapturedTensorError(
            f"{self.name}: {call.path_name(path)} is a tensor on {leaf.device} from outside the "
            f"bridged code that calls {self.name} (shape {tuple(leaf.shape)}); inside bridged "
            f"code every tensor must come from its arguments. Pass it (or the modules holding it) "
            f"to the enclosing bridged function as an argument, or read it from a variable that "
            f"function closes over directly (a tensor or module, not in a list).")
    env = tracing.environment()
    key = None if seed is None else _key_from_seed(jax, seed)
    if self.policy is None:
      with env.override_property(prng=key) if key is not None else contextlib.nullcontext():
        return self.fn(*args, **kwargs)
    tensors, rebuild = tracing.traced_arrays((args, kwargs))
    outer_key = _compat.current_key(env)
    found = {}  # learnt while `run` is traced: which arguments changed, whether it drew

    def run(*arrays):
      (inner_args, inner_kwargs), wrapped = rebuild(arrays)
      start = key if key is not None else jax.random.fold_in(outer_key, 0x6a62)
      with env.override_property(prng=start):
        outputs = self.fn(*inner_args, **inner_kwargs)
        found["drew"] = _compat.current_key(env) is not start
      found["mutated"] = [i for i, (w, a) in enumerate(zip(wrapped, arrays)) if w.jax() is not a]
      return tracing.to_jax(outputs), [wrapped[i].jax() for i in found["mutated"]]

    checkpointed = jax.checkpoint(run, policy=self.policy)
    if getattr(_DIFFERENTIATED, "on", False):  # its backward: in a conditional, as a node's
      checkpointed = _sequenced(checkpointed)
    outputs, mutated = checkpointed(*[t.jax() for t in tensors])
    for i, value in zip(found["mutated"], tracing.to_torchax(mutated)):
      tensors[i].copy_(value)
    if found["drew"] and key is None:
      env.get_and_rotate_prng_key()  # later draws of the enclosing code differ from these
    return tracing.to_torchax(outputs)

  def _invoke(self, spec, key_data, diff, other):
    if diff:
      holder = []
      floats = _VjpFunction.apply(self, spec, key_data, holder, tuple(other), *diff)
      layout, others, mutated = holder[0]
      return floats, others, mutated, layout
    floats, others, mutated, layout = call.call_jax(
        self._plain_half, (spec, tuple(other), key_data), name=f"{self.name}_fwd")
    return floats, others, mutated, layout

  def run(self, spec, diff, other, key_data):
    """The traced torch function on arrays: `(floats, (others, mutated, layout))`, the output
    leaves split into floating-point ones (differentiable) and the rest."""
    jax = runtime.jax_module()
    args, kwargs = spec.merge(diff, other)
    fn = captures.calling(self.fn, args)  # captured tensors put back where `fn` reads them
    fn = stateful.packing(fn)  # outputs only torch's pytrees know (a Hugging Face ModelOutput)
    if stateful.has_snapshots((args, kwargs)):
      fn = stateful.functionalized(fn)
    outputs, mutated, drew_random = tracing.run_torch(fn, key_data, args, kwargs,
                                                      fn_name=self.name)
    self.draws_random = bool(self.draws_random) or drew_random
    out_leaves, out_tree = jax.tree.flatten(outputs)
    float_mask = tuple(bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)) for x in out_leaves)
    floats = [x for x, f in zip(out_leaves, float_mask) if f]
    others = [x for x, f in zip(out_leaves, float_mask) if not f]
    positions = tuple(sorted(mutated))
    layout = Layout(out_tree, float_mask, positions, stateful.has_packed(outputs))
    return floats, (others, [mutated[i] for i in positions], layout)

  def _plain_half(self, spec, other, key_data):
    floats, (others, mutated, layout) = self.run(spec, (), other, key_data)
    return floats, others, mutated, layout

  def forward_half(self, spec, diff, other, key_data):
    """The forward half of `jax.vjp` of `run`: outputs, and the residuals the backward needs."""
    jax = runtime.jax_module()
    run = lambda *d: self.run(spec, d, other, key_data)  # noqa: E731
    if self.policy is not None:
      run = jax.checkpoint(run, policy=self.policy)
    with differentiated():
      floats, vjp_fn, (others, mutated, layout) = jax.vjp(run, *diff, has_aux=True)
    residuals, tree = jax.tree.flatten(vjp_fn)
    # a residual that is one of the inputs (a weight kept for the input's gradient) is not
    # returned by the forward: that would add an output, and a copy, per parameter
    position = {id(x): i for i, x in enumerate(diff)}
    used = sorted({position[id(r)] for r in residuals if id(r) in position})
    index = {p: i for i, p in enumerate(used)}
    sources = tuple(index.get(position.get(id(r))) for r in residuals)
    computed = [r for r, source in zip(residuals, sources) if source is None]
    on_host = tuple(getattr(jax.typeof(r), "memory_space", None) == jax.memory.Space.Host
                    for r in computed)
    kept = Residuals(tree, sources, tuple(used), tuple(r.dtype for r in computed), on_host,
                     self.policy is not None)
    computed = [dtypes.torch_compatible(jax, r) for r in computed]
    return floats, others, mutated, (kept, computed), layout


def backward_half(saved, inputs, cotangents):
  """The backward half: gradients of the differentiable inputs, from the forward's residuals."""
  jax = runtime.jax_module()
  kept, computed = saved
  computed = [dtypes.restore(jax, r, d) for r, d in zip(computed, kept.dtypes)]
  # an offloaded residual arrives as it left the forward, in host memory; the vjp moves it back
  computed = iter([jax.device_put(r, jax.memory.Space.Host) if host else r
                   for r, host in zip(computed, kept.on_host)])
  residuals = [next(computed) if source is None else inputs[source] for source in kept.sources]
  vjp = lambda r, c: kept.tree.unflatten(r)(c)  # noqa: E731
  cotangents = list(cotangents)
  if kept.sequenced and any(c.size for c in cotangents):
    return _in_conditional(vjp, residuals, cotangents)
  return vjp(residuals, cotangents)


@contextlib.contextmanager
def differentiated():
  """While tracing in the block, bridged calls inside the traced code know that it is being
  differentiated: a remat policy's backward then goes in a conditional (`_sequenced`)."""
  before = getattr(_DIFFERENTIATED, "on", False)
  _DIFFERENTIATED.on = True
  try:
    yield
  finally:
    _DIFFERENTIATED.on = before


def _sequenced(fn):
  """`fn` (a `jax.checkpoint`ed function) whose backward runs in `_in_conditional`: inside one
  enclosing trace (a bridged call in bridged code, `jb.train_step`) XLA would otherwise merge the
  policy's recomputation with the forward, as it does across two nodes."""
  jax = runtime.jax_module()

  @jax.custom_vjp
  def call(*arrays):
    return fn(*arrays)

  def forward(*arrays):
    return jax.vjp(fn, *arrays)

  def backward(vjp, cotangent):
    leaves, tree = jax.tree.flatten(vjp)
    cts, ct_tree = jax.tree.flatten(cotangent)
    inexact = [i for i, c in enumerate(cts) if jax.numpy.issubdtype(c.dtype, jax.numpy.inexact)]

    def run(r, c):  # the float0 cotangents of integer outputs stay outside the conditional
      full = list(cts)
      for i, value in zip(inexact, c):
        full[i] = value
      return tree.unflatten(r)(ct_tree.unflatten(full))

    floats = [cts[i] for i in inexact]
    if not any(c.size for c in floats):
      return run(leaves, floats)
    return _in_conditional(run, leaves, floats)

  call.defvjp(forward, backward)
  return call


def _in_conditional(vjp, residuals, cotangents):
  """`vjp(residuals, cotangents)` inside a conditional XLA cannot fold. The step is one program: in
  line, XLA merges a remat policy's recomputation with the forward it repeats (or runs it early)
  and keeps its values, so the policy saved nothing; a conditional's branch is its own
  computation, run only once the cotangents exist, its values freed when it returns."""
  jax = runtime.jax_module()
  first = jax.numpy.real(next(c for c in cotangents if c.size).ravel()[0])
  always = ~((first < 0) & (first >= 0))  # true for every value, NaN included
  nothing = lambda r, c: jax.tree.map(jax.numpy.zeros_like, jax.eval_shape(vjp, r, c))  # noqa
  return jax.lax.cond(always, vjp, nothing, residuals, cotangents)


class _VjpFunction(torch.autograd.Function):

  @staticmethod
  def forward(ctx, bridged, spec, key_data, holder, other, *diff):
    if bridged.offloads and runtime.lowering_platform() == "cpu":
      remat_policies.warn_offload_dropped("cpu")
    floats, others, mutated, saved, layout = call.call_jax(
        bridged.forward_half, (spec, diff, other, key_data), name=f"{bridged.name}_fwd")
    ctx.saved = saved
    ctx.save_for_backward(*[diff[i] for i in saved[0].inputs])  # torch checks their versions
    ctx.name = bridged.name
    ctx.shardings = spmd.shardings_of(diff)
    holder.append((layout, others, mutated))
    return tuple(floats)

  @staticmethod
  def backward(ctx, *cotangents):
    try:
      grads = call.call_jax(backward_half, (ctx.saved, list(ctx.saved_tensors), cotangents),
                            name=f"{ctx.name}_bwd")
    except errors.JaxTracingError as e:
      if not _compat.is_while_loop_gradient_error(e):
        raise
      raise errors.ControlFlowError(
          f"{ctx.name}: a gradient was asked through torch.while_loop, whose trip count depends "
          f"on the data; JAX's while loop is forward-only. Use jb.fori_loop(lower, upper, body, "
          f"init) when the count is known, run the loop under torch.no_grad(), or detach its "
          f"inputs.") from e
    spmd.shard_like(grads, ctx.shardings)  # a gradient is sharded as its input, not left to chance
    return (None, None, None, None, None, *grads)


def _any_traced(tree):
  traced = tracing.torchax_tensor_type()  # None until the first trace imports torchax
  return traced is not None and any(
      isinstance(leaf, traced) for leaf in runtime.jax_module().tree.leaves(tree))


def _key_from_seed(jax, seed):
  """The key `rng.key_data(seed)` would give, for an int or a traced integer tensor."""
  if isinstance(seed, int):
    data = jax.numpy.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], jax.numpy.uint32)
  else:
    s = tracing.to_jax(seed).reshape(())
    high = s >> 32 if s.dtype.itemsize == 8 else s >> 31  # the sign's bits for a 32-bit seed
    data = jax.numpy.stack([high.astype(jax.numpy.uint32), s.astype(jax.numpy.uint32)])
  return jax.random.wrap_key_data(data)


def _device(diff, other):
  for tensor in diff + other:
    if tensor.is_xla:
      return tensor.device
  import torch_xla
  return torch_xla.device()


def _write_back(name, tree, positions, values, diff):
  """Applies the in-place updates the traced code made to its arguments, as eager torch would."""
  if not positions:
    return
  leaves = runtime.jax_module().tree.leaves(tree)
  diff_ids = {id(t) for t in diff}
  for pos, value in zip(positions, values):
    target = leaves[pos]
    if id(target) in diff_ids:
      raise errors.MutationError(
          f"{name}: an argument that requires grad (shape {tuple(target.shape)}) was modified in "
          f"place. Bridged code cannot write that back without losing its gradient: work on a "
          f"copy (`x = x.clone()`) or return the new value.")
    with torch.no_grad():
      target.copy_(value)


def bridge(fn: Optional[Callable] = None, *, remat: Any = None,
           name: Optional[str] = None) -> Callable:
  """Decorator: the torch function is traced once per signature and runs as one graph node.

  The function is converted to JAX by torchax. Each call adds the forward half of `jax.vjp` to
  the LazyTensor graph through `call_jax`; torch's backward adds the backward half. Only tensors
  that require grad get gradients. Randomness (dropout, `torch.rand*`) is fresh on every call
  and reproducible under `torch_xla.manual_seed`. In-place updates of arguments are written back.

  Args:
    fn: a torch function of tensors (and static values) returning tensors.
    remat: what the backward keeps: None (what `jax.vjp` keeps), a preset (`"full"`, `"dots"`,
      `"dots_no_batch"`, `"minimal"`, `"minimal_offloaded"`), a `jb.Remat`, or a
      `jax.checkpoint_policies` policy. See docs/remat.md.
    name: IR node name prefix; defaults to the function's name.

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
    return functools.partial(bridge, remat=remat, name=name)
  return Bridged(fn, remat=remat, name=name)


def assume_pure(fn: Callable, *, add_rng_seed_argument: bool = False,
                remat: Any = None) -> Callable:
  """Upstream `torch_xla.experimental.assume_pure`'s call, built on `bridge`.

  Unlike upstream, randomness inside `fn` is fresh on every call already. With
  `add_rng_seed_argument=True` the returned function takes a keyword `rng_seed` (int or integer
  tensor) that fixes the randomness instead, as upstream's does. `remat=` is as for `bridge`.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> noisy = jb.assume_pure(lambda a: a + torch.randn_like(a), add_rng_seed_argument=True)
    >>> out = noisy(torch.zeros(3, device="xla"), rng_seed=0)
  """
  bridged = Bridged(fn, remat=remat)
  bridged.seeded = add_rng_seed_argument
  return bridged


_SHARED = weakref.WeakValueDictionary()  # structure key -> Bridged, shared by identical layers


class BridgeModule(torch.nn.Module):
  """Wraps a module so its forward is bridged, while it stays the same module to its callers.

  Parameters, buffers and submodules are the wrapped module's own (the same dictionaries), so
  optimizers, `state_dict()` keys, `.to()`, tied weights and `train()`/`eval()` behave as on the
  wrapped module, and other attributes are read from it. Structurally identical modules (same
  classes, shapes and plain attributes, e.g. the layers of a decoder stack) share one trace.
  Non-tensor attributes are read when a signature is first traced.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> layer = jb.BridgeModule(torch.nn.Linear(8, 8).to("xla"))
    >>> layer(torch.randn(2, 8, device="xla")).sum().backward()
    >>> layer.weight.grad.shape
    torch.Size([8, 8])
  """

  def __init__(self, module: torch.nn.Module, *, remat: Any = None):
    super().__init__()
    if not isinstance(module, torch.nn.Module):
      raise errors.BadArgumentError(f"module: expected a torch.nn.Module, got {type(module)}.")
    object.__setattr__(self, "_wrapped", module)
    object.__setattr__(self, "_state", modules.StateWalk(module))
    self._parameters = module._parameters
    self._buffers = module._buffers
    self._non_persistent_buffers_set = module._non_persistent_buffers_set
    self._modules = module._modules
    self.training = module.training
    key = modules.structure_key(module)
    shared = _SHARED.get((key, remat)) if key is not None else None
    if shared is None:
      shared = Bridged(functools.partial(modules.module_forward, module), remat=remat,
                       name=type(module).__name__)
      if key is not None:
        _SHARED[(key, remat)] = shared
    self._bridged = shared

  @property
  def wrapped(self):
    """The module whose forward is bridged."""
    return self._wrapped

  def forward(self, *args, **kwargs):
    params, buffers, training = self._state.state()
    return self._bridged(params, buffers, training, args, kwargs)

  def train(self, mode=True):
    self._wrapped.train(mode)
    self.training = mode
    return self

  def __getattr__(self, name):
    try:
      return super().__getattr__(name)
    except AttributeError:
      return getattr(object.__getattribute__(self, "_wrapped"), name)

  def __getitem__(self, index):
    return self._wrapped[index]

  def __len__(self):
    return len(self._wrapped)

  def __iter__(self):
    return iter(self._wrapped)

  def extra_repr(self):
    return f"bridged: {type(self._wrapped).__name__}"


class PureModule(BridgeModule):
  """Upstream `torch_xla.experimental.assume_pure.PureModule`'s call: a `BridgeModule`.

  Example:
    >>> import torch, torch_xla_jaxbridge as jb
    >>> layer = jb.PureModule(torch.nn.Linear(4, 4).to("xla"))
  """
