"""PyTorch's operator database (`op_db` of torch.testing._internal, every public op with sample
inputs) through plain LazyTensor code and through bridged code, each against eager CPU torch:
result types, dtypes, shapes, values and, where the op supports autograd, gradients.
scripts/opinfo_sweep.py runs every float32 op in child processes; test_opinfo.py a subset.

  outcome = check(OPS["cummax"])   # {"forward": {"lazy": ..., "bridged": ...}, "backward": ...}
"""
import itertools
import time
import warnings

import torch
import torch.utils._pytree as pytree
import torch_xla
from torch.testing._internal.common_methods_invocations import op_db

import torch_xla_jaxbridge as jb

SAMPLES = 2  # samples of each op checked
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # values, forward
GRAD_TOLERANCE = dict(rtol=1e-3, atol=1e-4)

# Ops whose values torch leaves unspecified (random draws, uninitialized memory): only the result's
# type, dtype and shape are compared.
UNSPECIFIED_VALUES = {
    "bernoulli", "cauchy", "empty", "empty_like", "empty_permuted", "empty_strided",
    "exponential", "geometric", "log_normal", "multinomial", "new_empty", "new_empty_strided",
    "normal", "normal.in_place", "normal.number_mean", "rand_like", "randint", "randint_like",
    "randn", "randn_like", "uniform", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "svd_lowrank", "pca_lowrank", "empty.default",
}


def full_name(op) -> str:
  return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


OPS = {full_name(op): op for op in op_db if torch.float32 in op.supported_dtypes("cpu")}


def check(op, samples: int = SAMPLES) -> dict:
  """Each mode's outcome on the op's first `samples` samples: `{"forward": {"lazy": o,
  "bridged": o}, "backward": {...}}`, each `o` a `[status, detail]` with status `pass`, `fail`,
  `fallback` (bridged code ran as plain LazyTensor code, reported) or `n/a`."""
  outcome = {"forward": {}, "backward": {}}
  forward = _samples(op, False, samples)
  for mode in ("lazy", "bridged"):
    outcome["forward"][mode] = _worst(_eager_runs(_forward, op, s, mode) for s in forward)
  backward = _samples(op, True, samples) if op.supports_autograd else []
  for mode in ("lazy", "bridged"):
    outcome["backward"][mode] = (
        _worst(_eager_runs(_backward, op, s, mode) for s in backward) if backward
        else ["n/a", "no autograd"])
  return outcome


def _eager_runs(check_sample, op, sample, mode):
  """`check_sample`'s outcome, or `n/a` where eager CPU torch itself raises (a CUDA-only op)."""
  try:
    return check_sample(op, sample, mode)
  except Exception as exc:  # raised by eager torch, outside `_run`
    return ["n/a", f"eager CPU torch raises {type(exc).__name__}"]


def _samples(op, requires_grad, count):
  torch.manual_seed(0)
  return list(itertools.islice(op.sample_inputs("cpu", torch.float32,
                                                requires_grad=requires_grad), count))


_RANK = {"fail": 3, "fallback": 2, "n/a": 1, "pass": 0}


def _worst(outcomes):
  return max(outcomes, key=lambda o: (_RANK[o[0]], bool(o[1])), default=["n/a", "no samples"])


def _forward(op, sample, mode):
  expected = op(sample.input, *sample.args, **sample.kwargs)

  def compare(out):
    outcome = _compare(out, expected, op, TOLERANCE)
    if "values differ" in outcome[1] and _compact(sample) and _as_accurate_as_eager(
        out, expected, op, sample):
      return ["pass", "as close to torch's float64 result as eager float32 is"]
    return outcome

  return _run(op, sample, mode, compare)


def _compact(sample):
  """Whether every tensor of the sample is its whole storage, in order: only then do a float64
  copy and the XLA device see what eager's op saw (`as_strided` reads the storage)."""
  return all(t.is_contiguous() and t.storage_offset() == 0 and
             t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in _tensors(sample))


def _in_float64(sample):
  """The sample's leaves with each float tensor a float64 copy of its own, and their pytree."""
  leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
  return [leaf.detach().double().contiguous() if isinstance(leaf, torch.Tensor) and
          leaf.is_floating_point() else leaf for leaf in leaves], spec


def _as_accurate_as_eager(got, expected, op, sample):
  """Whether `got` is as close to the op's float64 result as eager's float32 one (within 2x,
  or the tolerance), eager being close to it (1%): where two float32 algorithms differ (JAX's
  `expm` and torch's), neither is the yardstick."""
  leaves, spec = _in_float64(sample)
  x, a, k = pytree.tree_unflatten(leaves, spec)
  try:
    reference = pytree.tree_leaves(op(x, *a, **k))
  except Exception:  # no float64 kernel: no yardstick
    return False
  for g, e, r in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), reference):
    if isinstance(e, torch.Tensor) and e.is_floating_point():
      scale = r.abs() + TOLERANCE["atol"]
      error = lambda t: ((t.cpu().double() - r).abs() / scale).max().item()  # noqa: E731
      eager = error(e.detach())
      if eager > 1e-2 or not error(g) <= 2 * max(eager, TOLERANCE["rtol"]):
        return False
  return True


def _backward(op, sample, mode):
  inputs = [t for t in _tensors(sample) if t.requires_grad]
  if not inputs:
    return ["n/a", "no input requires grad"]
  out = pytree.tree_leaves(sample.output_process_fn_grad(
      _differentiated(op)(sample.input, *sample.args, **sample.kwargs)))
  differentiable = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.requires_grad]
  if not differentiable:
    return ["n/a", "no output requires grad"]
  outs = [out[i] for i in differentiable]
  cotangents = _cotangents(outs)
  expected = _grads(outs, inputs, cotangents)

  def compare(out):
    leaves = pytree.tree_leaves(sample.output_process_fn_grad(out))
    got_outs = [leaves[i] for i in differentiable]
    if not all(isinstance(t, torch.Tensor) and t.requires_grad for t in got_outs):
      return ["fail", f"results {differentiable} do not all require grad, as torch's do"]
    got = [g.cpu() for g in _grads(got_outs, moved_inputs,
                                   [c.to(got_outs[0].device) for c in cotangents])]
    outcome = _compare(got, expected, op, GRAD_TOLERANCE)
    if outcome[0] == "fail" and _compact(sample):
      numerical = _numerical_grads(op, sample, differentiable, cotangents)
      if _compare(got, numerical, op, GRAD_TOLERANCE)[0] == "pass":
        return ["pass", "equal to the float64 numerical gradient, where eager's is not"]
    return outcome

  moved_inputs = []
  return _run(op, sample, mode, compare, moved_inputs, _differentiated(op))


def _differentiated(op):
  """The op as OpInfo's gradient checks call it (e.g. a Hermitian input made so)."""
  return lambda *args, **kwargs: op.gradcheck_wrapper(op, *args, **kwargs)


def _numerical_grads(op, sample, differentiable, cotangents, eps=1e-6):
  """The gradient by central differences in float64: the yardstick where torch's own differs."""
  leaves, spec = _in_float64(sample)
  wanted = [leaf for leaf, original in zip(leaves, pytree.tree_leaves(
      (sample.input, sample.args, sample.kwargs))) if isinstance(original, torch.Tensor)
            and original.requires_grad]

  def loss():
    x, a, k = pytree.tree_unflatten(leaves, spec)
    out = pytree.tree_leaves(sample.output_process_fn_grad(_differentiated(op)(x, *a, **k)))
    return sum((out[i].double() * c.double()).sum() for i, c in zip(differentiable, cotangents))

  grads = []
  for x in wanted:
    grad, flat = torch.zeros_like(x), x.view(-1)
    for j in range(flat.numel()):
      kept = flat[j].item()
      flat[j] = kept + eps
      up = loss()
      flat[j] = kept - eps
      grad.view(-1)[j] = (up - loss()) / (2 * eps)
      flat[j] = kept
    grads.append(grad.float())
  return grads


def _cotangents(outs):
  generator = torch.Generator().manual_seed(1)
  return [torch.randn(o.shape, generator=generator, dtype=o.dtype) if o.is_floating_point()
          else torch.zeros_like(o) for o in outs]


def _grads(outs, inputs, cotangents):
  loss = sum((o * c).sum() for o, c in zip(outs, cotangents))
  grads = torch.autograd.grad(loss, inputs, allow_unused=True)
  return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]


def _tensors(sample):
  return [t for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
          if isinstance(t, torch.Tensor)]


def _run(op, sample, mode, compare, moved_inputs=None, function=None):
  """Runs the op on the XLA device (as plain LazyTensor code or inside `jb.bridge`) and
  compares with `compare`; an error anywhere is a `fail` with its type and message."""
  device = torch_xla.device()
  leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
  leaves = [_to_device(leaf, device) for leaf in leaves]
  places = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
  if moved_inputs is not None:
    moved_inputs.extend(leaves[i] for i in places if leaves[i].requires_grad)

  def call(*tensors):
    args = list(leaves)
    for i, t in zip(places, tensors):
      args[i] = t
    x, a, k = pytree.tree_unflatten(args, spec)
    return (function or op)(x, *a, **k)

  since = jb.bridge_report()
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      fn = call if mode == "lazy" else jb.bridge(call, name=f"opinfo_{full_name(op)}")
      out = fn(*[leaves[i] for i in places])
      result = compare(out)
      torch_xla.sync()
  except Exception as exc:  # the outcome of any failure is recorded, not raised
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    return ["fail", f"{type(exc).__name__}: {first_line}"]
  fell_back = [r for r in jb.bridge_report(since=since).rows if r.status == "fallback"]
  if fell_back and result[0] == "pass":
    return ["fallback", fell_back[0].reason[:300]]
  return result


def _to_device(leaf, device):
  if isinstance(leaf, torch.Tensor):
    moved = leaf.detach().to(device)
    return moved.requires_grad_(leaf.requires_grad) if leaf.is_floating_point() or \
        leaf.is_complex() else moved
  if isinstance(leaf, torch.device) and leaf.type == "cpu":
    return device
  if leaf == "cpu":
    return str(device)
  return leaf


def _compare(got, expected, op, tolerance):
  got_leaves, expected_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
  if len(got_leaves) != len(expected_leaves):
    return ["fail", f"{len(got_leaves)} results where torch gives {len(expected_leaves)}"]
  for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
    if isinstance(e, torch.Tensor) != isinstance(g, torch.Tensor) or (
        not isinstance(e, torch.Tensor) and type(g) is not type(e)):
      return ["fail", f"result {i}: a {type(g).__name__} where torch gives a {type(e).__name__}"]
    if not isinstance(e, torch.Tensor):
      if full_name(op) not in UNSPECIFIED_VALUES and not _close(g, e):
        return ["fail", f"result {i}: {g!r} where torch gives {e!r}"]
      continue
    if g.dtype != e.dtype:
      return ["fail", f"result {i}: dtype {g.dtype} where torch gives {e.dtype}"]
    if g.shape != e.shape:
      return ["fail", f"result {i}: shape {tuple(g.shape)} where torch gives {tuple(e.shape)}"]
    if full_name(op) in UNSPECIFIED_VALUES:
      continue
    try:
      torch.testing.assert_close(g.cpu(), e.detach(), equal_nan=True, **tolerance)
    except AssertionError as exc:
      lines = [line.strip() for line in str(exc).splitlines() if "difference" in line]
      return ["fail", f"result {i}: values differ ({'; '.join(lines)[:200]})"]
  return ["pass", ""]


def _close(got, expected):
  if isinstance(expected, float):
    return abs(got - expected) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(expected) or (
        got != got and expected != expected)
  return got == expected


def timed_check(name: str, samples: int = SAMPLES) -> dict:
  """`check` of the op named `name` (a key of `OPS`) with its wall time in seconds."""
  start = time.perf_counter()
  outcome = check(OPS[name], samples)
  return {"op": name, "seconds": round(time.perf_counter() - start, 2), **outcome}
