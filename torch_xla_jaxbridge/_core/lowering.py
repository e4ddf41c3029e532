"""JAX function + abstract signature -> torch_xla computation, and the cache that holds them.

A signature is everything the traced program depends on: the pytree structure of the arguments,
each tensor's shape and dtype, each static (non-tensor) value, and JAX's trace-time config.
Functions are held weakly, so closures that die take their entries with them.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import re
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, MutableMapping, Sequence

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._compat import jax_lowering_private, jax_private, torch_xla_private
from torch_xla_jaxbridge._core import cpu_convolutions, cpu_linalg, dtypes, runtime

if TYPE_CHECKING:
  import jax

logger = logging.getLogger("torch_xla_jaxbridge.lowering")  # the documented name (docs/call_jax.md)

_REASONS_KEPT = 256

CacheInfo = collections.namedtuple(
    "CacheInfo", ["hits", "misses", "maxsize", "currsize", "retrace_reasons"])


@dataclasses.dataclass(frozen=True)
class Lowered:
  """One traced and lowered signature: the computation to call and how to rebuild its outputs."""
  op_name: str
  computation: Any  # torch_xla XlaComputation
  out_tree: jax.tree_util.PyTreeDef  # of the outputs
  leaf_paths: tuple  # readable path of each input leaf, for re-trace reasons
  kept: tuple[int, ...] | None = None  # the inputs the program reads (None: all of them)


def lower(flat_fn: Callable[..., tuple[list, Any]], avals: Sequence[Any], *, op_name: str,
          enable_x64: bool, platform: str | None = None) -> tuple[Any, Any, tuple | None]:
  """Traces `flat_fn(*avals)` and lowers it to a torch_xla computation: `(computation, out_tree,
  kept)`, `kept` the positions of the inputs the program reads (None: all of them). An input it
  never reads is not a parameter of the computation, so a call passes only the kept ones: a
  node's inputs cost host time each (a Hugging Face cache passed whole to each layer gives layer
  i the earlier layers' keys and values, which it does not read).

  `flat_fn` takes the tensor leaves and returns `(out_leaves, out_tree)` as a JAX function would;
  `out_tree` is captured during tracing.

  Example:
    >>> jax = runtime.jax_module()
    >>> avals = [jax.ShapeDtypeStruct((2,), jax.numpy.float32)]
    >>> comp, tree, kept = lower(lambda x, y: jax.tree.flatten(x * 2), avals * 2,
    ...                          op_name="xla::double", enable_x64=False)
    >>> kept
    (0,)
  """
  with runtime.gc_paused():  # the trace's many objects set off collections (`gc_paused`)
    return _traced_and_lowered(flat_fn, avals, op_name, enable_x64, platform)


def _traced_and_lowered(flat_fn: Callable[..., tuple[list, Any]], avals: Sequence[Any],
                        op_name: str, enable_x64: bool,
                        platform: str | None) -> tuple[Any, Any, tuple | None]:
  jax = runtime.jax_module()
  out_tree = []

  def leaves_only(*flat_args: Any) -> list:
    leaves, tree = flat_fn(*flat_args)
    out_tree.append(tree)
    return leaves

  traced = _trace(jax, leaves_only, avals, op_name, enable_x64)
  if enable_x64 and needs_32_bit_mode(traced, avals):
    enable_x64 = False
    traced = _trace(jax, leaves_only, avals, op_name, enable_x64)
  platform = platform or runtime.lowering_platform()
  lowered = _lower(jax, traced, enable_x64, platform)
  kept: tuple[int, ...] | None = jax_lowering_private.kept_inputs(lowered)
  if avals and not kept:  # reads none of its inputs: a node takes one at least, so all of them
    lowered = _lower(jax, _trace(jax, leaves_only, avals, op_name, enable_x64, keep_unused=True),
                     enable_x64, platform)
  if kept == tuple(range(len(avals))) or not kept:
    kept = None
  with jax_private.enable_x64(enable_x64), jax_private.gspmd_partitioner():
    proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
  refuse_foreign_custom_calls(proto, op_name)
  computation = torch_xla_private.computation_from_proto(op_name, without_module_id(proto))
  return computation, out_tree[-1], kept


def _lower(jax: types.ModuleType, traced: Any, enable_x64: bool, platform: str) -> Any:
  with jax_private.enable_x64(enable_x64), jax_private.gspmd_partitioner():
    with runtime_forms(platform):
      return traced.lower(lowering_platforms=(platform,))


@contextlib.contextmanager
def runtime_forms(platform: str) -> Iterator[None]:
  """Context: lower in the forms torch_xla's runtime on `platform` needs. On CPU: convolutions
  channels-last (XLA:CPU's fast kernels need it, made for them only in the program's entry) and
  linear algebra without jaxlib's LAPACK calls (torch_xla's runtime has no handler for them).

  Example:
    >>> with runtime_forms("cpu"):
    ...   pass
  """
  with contextlib.ExitStack() as forms:
    if platform == "cpu":
      forms.enter_context(cpu_convolutions.channels_last())
      forms.enter_context(cpu_linalg.portable_linalg())
    yield


def refuse_foreign_custom_calls(proto: bytes, op_name: str) -> None:
  """Raises `NoLoweringError` (the region falls back) when the lowered program calls a custom
  call target that only jaxlib's own runtime has (a LAPACK or cuSOLVER routine, a Python
  callback): torch_xla's runtime would fail on it when the program runs.

  Example:
    >>> refuse_foreign_custom_calls(b"...stablehlo.add...", "xla::f")
    >>> refuse_foreign_custom_calls(b"...lapack_sgeev_ffi...", "xla::f")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torch_xla_jaxbridge.errors.NoLoweringError: f: its JAX program calls lapack_sgeev_ffi, ...
  """
  targets = _foreign_targets()
  found = sorted(t for prefix, names in targets.items() if prefix in proto
                 for t in names if t.encode() in proto)
  if found:
    raise errors.NoLoweringError(
        f"{op_name.removeprefix('xla::')}: its JAX program calls {', '.join(found)}, a routine "
        f"jaxlib registers with JAX's own runtime only; torch_xla's runtime, which runs the "
        f"program, cannot call it. Bridged regions run such code as plain LazyTensor code "
        f"(torch_xla's own lowering); in call_jax, use a JAX function without it.")


@functools.cache
def _foreign_targets() -> dict[bytes, list[str]]:
  """jaxlib's custom call targets by their prefix (a fast first test on large programs)."""
  targets = collections.defaultdict(list)
  for name in jax_lowering_private.jaxlib_custom_call_targets():
    targets[name.split("_")[0].encode() + b"_"].append(name)
  return dict(targets)


def needs_32_bit_mode(traced: Any, avals: Sequence[Any]) -> bool:
  """Whether a program traced in JAX's 64-bit mode must be traced again without it: it calls a
  Pallas kernel (which lowers, for TPU and in interpret mode, in 32-bit mode only) and no input
  is 64-bit (the mode was asked for torch's dtypes inside bridged code, not by the inputs).

  Example:
    >>> jax = runtime.jax_module()
    >>> avals = [jax.ShapeDtypeStruct((2,), jax.numpy.float32)]
    >>> needs_32_bit_mode(jax.jit(lambda x: x * 2).trace(*avals), avals)
    False
  """
  return (not dtypes.needs_x64([a.dtype for a in avals])
          and jax_private.holds_pallas_kernel(traced.jaxpr))


def _trace(jax: types.ModuleType, fn: Callable, avals: Sequence[Any], op_name: str,
           enable_x64: bool, keep_unused: bool = False) -> Any:
  with jax_private.enable_x64(enable_x64), jax_private.gspmd_partitioner():
    try:
      with jax.checking_leaks():
        return jax.jit(fn, keep_unused=keep_unused).trace(*avals)
    except Exception as e:
      if not jax_private.is_leak_error(e):
        raise
      raise errors.LeakedTensorError(_leak_message(op_name, str(e))) from None


_MODULE_ID = 5  # `int64 id = 5;` of XLA's `HloModuleProto` (xla/service/hlo.proto)


def without_module_id(proto: bytes) -> bytes:
  """A serialized `HloModuleProto` without its `id`, a number JAX counts up at each lowering.
  torch_xla keys its compiled programs by a hash of the proto: without the id, a program lowered
  again (a function traced again once its trace went with the last module using it, or after
  `clear_cache()`) finds the program compiled before instead of compiling and keeping another.

  Example:
    >>> without_module_id(b"\\n\\x01m(\\x07")  # name "m", id 7
    b'\\n\\x01m'
  """
  kept, i = bytearray(), 0
  while i < len(proto):
    start = i
    key, i = _varint(proto, i)
    wire = key & 7
    if wire == 0:
      _, i = _varint(proto, i)
    elif wire in (1, 5):  # fixed 64 / 32 bits
      i += 8 if wire == 1 else 4
    elif wire == 2:  # length-delimited
      length, i = _varint(proto, i)
      i += length
    else:  # groups: not in an HloModuleProto; leave the proto as it is
      return proto
    if key != _MODULE_ID << 3:
      kept += proto[start:i]
  return bytes(kept)


def _varint(data: bytes, i: int) -> tuple[int, int]:
  """The protobuf varint at `data[i]`, and the position after it."""
  value = shift = 0
  while True:
    byte = data[i]
    value |= (byte & 0x7F) << shift
    i += 1
    if byte < 0x80:
      return value, i
    shift += 7


MAX_SIGNATURES_PER_FUNCTION = 64


def _leak_message(op_name: str, jax_message: str) -> str:
  """Our message for JAX's 'Leaked trace' report: who holds the first leaked value."""
  chain = []
  for line in jax_message.splitlines():
    if "is referred to by" in line:
      chain.append(line.strip())
    elif chain:
      break  # the first leaked value's chain is enough
  holder = "an object outside the function"
  for line in chain:
    subject, referrer = (part.strip() for part in line.split("is referred to by", 1))
    if not referrer.startswith("<"):  # a module-level name: the clearest answer
      holder = referrer
      break
    if subject.startswith("<Tensor ") and holder == "an object outside the function":
      holder = re.sub(r"<(\w+) \d+>", r"\1", referrer)
  return (f"{op_name.removeprefix('xla::')}: a tensor computed inside the traced function was "
          f"kept outside it, in {holder}. Traced code runs once, so that tensor would hold a "
          f"placeholder, not a value: return it as an output instead of storing it in a global, "
          f"a list or an attribute (`self.x = ...`). How it is held:\n  " + "\n  ".join(chain))


class _FunctionEntries:
  """The lowered signatures of one function (least recently used first) and its last signature."""
  __slots__ = ("by_signature", "last_signature")

  def __init__(self) -> None:
    self.by_signature: dict[Hashable, Lowered] = {}
    self.last_signature: Hashable = None


class LoweringCache:
  """Lowered computations keyed by (function, signature).

  Functions are held weakly; code objects (the anchor of closures over plain values, see
  `call._cache_anchor`) strongly, as they live as long as the program. Each function keeps at most
  `MAX_SIGNATURES_PER_FUNCTION` signatures, evicting the least recently used.

  Example:
    >>> cache = LoweringCache()
    >>> cache.info().currsize
    0
  """

  def __init__(self) -> None:
    self._weak: weakref.WeakKeyDictionary[Any, dict[object, _FunctionEntries]] = (
        weakref.WeakKeyDictionary())
    self._strong: dict[Any, dict[object, _FunctionEntries]] = {}
    self._lock = threading.Lock()
    self.hits = 0
    self.misses = 0
    self._reasons: collections.deque[str] = collections.deque(maxlen=_REASONS_KEPT)

  def _table(self, anchor: object) -> MutableMapping[Any, dict[object, _FunctionEntries]]:
    return self._strong if isinstance(anchor, types.CodeType) else self._weak

  def _function(self, anchor: object, subkey: object) -> _FunctionEntries | None:
    entries = self._table(anchor).get(anchor)
    return entries.get(subkey) if entries is not None else None

  def lookup(self, anchor: object, subkey: object, signature: Hashable) -> Lowered | None:
    """Returns the `Lowered` for this signature (counting a hit), or None."""
    per_function = self._function(anchor, subkey)
    if per_function is not None:
      table = per_function.by_signature
      found = table.get(signature)  # hashing a signature of many tensors costs: once if we can
      if found is not None:
        with self._lock:
          if len(table) > 1 and signature in table:  # most recently used last
            table[signature] = table.pop(signature)
          self.hits += 1
          per_function.last_signature = signature
        return found
    return None

  def previous(self, anchor: object, subkey: object) -> tuple[Hashable, Lowered] | None:
    """The (signature, Lowered) this function was last called with, or None if never traced."""
    per_function = self._function(anchor, subkey)
    if per_function is None or per_function.last_signature not in per_function.by_signature:
      return None
    last = per_function.last_signature
    return last, per_function.by_signature[last]

  def add(self, anchor: object, subkey: object, signature: Hashable, lowered: Lowered,
          reason: str | None = None) -> None:
    """Stores a newly lowered signature (counting a miss: one per trace); `reason` says why a
    known function was re-traced."""
    with self._lock:
      self.misses += 1
      entries = self._table(anchor).setdefault(anchor, {})
      per_function = entries.setdefault(subkey, _FunctionEntries())
      table = per_function.by_signature
      table[signature] = lowered
      while len(table) > MAX_SIGNATURES_PER_FUNCTION:
        del table[next(iter(table))]
      per_function.last_signature = signature
    if reason is not None:
      self._reasons.append(reason)
      logger.debug("re-trace: %s", reason)

  def info(self) -> CacheInfo:
    """Counters in the shape of functools' CacheInfo, plus the recent re-trace reasons."""
    size = 0
    for table in (self._weak, self._strong):
      for entries in list(table.values()):
        size += sum(len(e.by_signature) for e in entries.values())
    return CacheInfo(self.hits, self.misses, MAX_SIGNATURES_PER_FUNCTION, size,
                     list(self._reasons))

  def clear(self) -> None:
    """Drops every entry and resets the counters."""
    with self._lock:
      self._weak = weakref.WeakKeyDictionary()
      self._strong = {}
      self.hits = self.misses = 0
      self._reasons.clear()


CACHE = LoweringCache()


def cache_info() -> CacheInfo:
  """Returns `CacheInfo(hits, misses, maxsize, currsize, retrace_reasons)` for `call_jax`.

  `maxsize` is the number of signatures kept per function (least recently used evicted); entries
  live only as long as their function does. `retrace_reasons` lists, newest last, one line per re-trace of an already-traced function, such as
  `"double: args[0] shape (4, 4) -> (8, 4)"`.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> jb.clear_cache(); jb.cache_info().currsize
    0
  """
  return CACHE.info()


def clear_cache() -> None:
  """Forgets every lowered computation and resets the counters of `cache_info()`.

  Example:
    >>> import torch_xla_jaxbridge as jb
    >>> jb.clear_cache()
  """
  CACHE.clear()
