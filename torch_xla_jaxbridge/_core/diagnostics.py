"""Errors raised while torch code is traced, rewritten to name the user's line and the fix."""
from __future__ import annotations

import os
import re
import sysconfig
import traceback

from torch_xla_jaxbridge import errors
from torch_xla_jaxbridge._core import runtime

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
_LIBRARY_MARKERS = (f"{os.sep}jax{os.sep}", f"{os.sep}jaxlib{os.sep}", f"{os.sep}torch{os.sep}",
                    f"{os.sep}torchax{os.sep}", f"{os.sep}torch_xla{os.sep}", _PACKAGE_DIR)
_RECIPES_DIR = os.path.join(_PACKAGE_DIR, "recipes")
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]


class PlainTensorUsed(Exception):
  """Raised inside a trace when torch code mixes a tensor that is not being traced into its math;
  `translate` turns it into a `CapturedTensorError` naming the line."""


def is_library_file(filename: str) -> bool:
  """Whether a frame in `filename` is library code (JAX, torch, torchax, this package, Python's
  own), not the user's model (the recipes count as user models).

  Example:
    >>> is_library_file(__file__), is_library_file("/home/me/model.py")
    (True, False)
  """
  if filename.startswith(_RECIPES_DIR):
    return False
  if filename.startswith(_STDLIB_DIR) and "site-packages" not in filename:
    return True
  return any(marker in filename for marker in _LIBRARY_MARKERS)


def user_frame(exc: BaseException) -> str:
  """`file:line: source` of the innermost frame of `exc`'s traceback that is user code.

  Example:
    >>> user_frame(ValueError("no traceback"))
    '<unknown line>'
  """
  for frame in reversed(traceback.extract_tb(exc.__traceback__)):
    if not is_library_file(frame.filename):
      return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
  return "<unknown line>"


def _data_dependent_errors() -> tuple[type[Exception], ...]:
  errs = runtime.jax_module().errors
  return (errs.TracerBoolConversionError, errs.ConcretizationTypeError,
          errs.TracerIntegerConversionError, errs.NonConcreteBooleanIndexError,
          errs.TracerArrayConversionError)


def _rewrite_hint(source: str) -> str:
  """Two lines showing how to write the user's data-dependent line with tensors."""
  branch = re.match(r"\s*(?:el)?if (.+?):\s*$", source)
  loop = re.match(r"\s*while (.+?):\s*$", source)
  if branch:
    test = branch.group(1)
    return (f"  y = torch.cond({test}, lambda x: <value if true>, lambda x: <value if false>, (x,))\n"
            f"  y = torch.where({test}, <value if true>, <value if false>)  # element by element")
  if loop:
    return (f"  state = torch.while_loop(lambda s: {loop.group(1)}, lambda s: (<next s>,), (s,))\n"
            f"  state = jb.fori_loop(0, n, lambda i, s: <next s>, s)  # fixed count, differentiable")
  if ".item()" in source or ".tolist()" in source:
    return ("  s = x.max()          # keep the value a tensor (no .item())\n"
            "  y = x * s            # and use it in tensor math")
  return ("  y = torch.where(mask, x, 0)   # instead of x[mask]\n"
          "  y = (x * mask).sum()          # instead of x[mask].sum() or nonzero()")


def translate(exc: Exception, fn_name: str) -> errors.BridgeError:
  """The package error for an exception raised while `fn_name`'s torch code was traced.

  Example:
    >>> translate(KeyError("k"), "f").__class__.__name__
    'JaxTracingError'
  """
  where = user_frame(exc)
  kind = type(exc).__name__
  if isinstance(exc, _data_dependent_errors()):
    return errors.DataDependentError(
        f"{fn_name}: data-dependent Python control flow at {where}\n"
        f"The value of a tensor is not known while bridged code is traced ({kind}), so it "
        f"cannot steer Python (`if`, `while`, `.item()`, `nonzero`, boolean-mask indexing). "
        f"Write it with tensors, for example:\n{_rewrite_hint(where.split(': ', 1)[-1])}\n"
        f"See docs/control_flow.md (torch.cond, torch.while_loop, jb.fori_loop).")
  if isinstance(exc, PlainTensorUsed):
    shape = exc.args[0] if exc.args else "?"
    return errors.CapturedTensorError(
        f"{fn_name}: a torch tensor of shape {shape} that is not an input of the bridged function "
        f"was used at {where}. Tensors and modules the function reads from its enclosing scope, "
        f"its module's globals, `self` or a functools.partial's arguments, or through the plain "
        f"objects, dicts, lists and tuples held there (a few levels deep, by the attribute names "
        f"its code spells), and modules passed as arguments, become inputs (with their "
        f"parameters and buffers); this one was reached another way (a helper function's own "
        f"closure or globals, an object without `__dict__`, a plain tensor attribute of a "
        f"module). Pass it in as an argument (or the model holding it), or read it into a "
        f"variable the function captures (`w = holder.w`, `model = trainer.model` in the "
        f"enclosing scope), or register it as a parameter or buffer of the module.")
  return errors.JaxTracingError(f"{fn_name} failed while being traced, at {where}: "
                                f"{kind}: {exc}{_upstream_hint(exc)}")


# torch_xla's own wrappers that trace torch code their own way, and what replaces each inside
# bridged code (by the file a failing frame is in)
_UPSTREAM = {
    os.path.join("torch_xla", "experimental", "scan_layers.py"):
        ("torch_xla.experimental.scan_layers.scan_layers", "jb.scan_layers"),
    os.path.join("torch_xla", "experimental", "scan.py"):
        ("torch_xla.experimental.scan.scan", "jb.scan"),
    os.path.join("torch_xla", "experimental", "assume_pure.py"):
        ("torch_xla.experimental.assume_pure", "jb.assume_pure / jb.PureModule"),
}


def _upstream_hint(exc: BaseException) -> str:
  """A sentence naming the package's replacement when `exc` came from inside one of torch_xla's
  own tracing wrappers, which cannot run inside bridged code."""
  for frame in traceback.extract_tb(exc.__traceback__):
    for path, (upstream, replacement) in _UPSTREAM.items():
      if frame.filename.endswith(path):
        return (f". {upstream} cannot run inside bridged code (it traces the torch code its own "
                f"way); call {replacement} there, with the same arguments.")
  return ""
