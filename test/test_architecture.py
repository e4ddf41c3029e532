"""The package's layout rules, checked on its source: which package may import which, no private
name of another package, no cycle, recipes on the public API only and scripts on it and `_compat`,
other libraries' internals only in `_compat` (in the package and in scripts), sizes, and type
hints on the public API (ARCHITECTURE.md)."""
import ast
import inspect
import pathlib
import re
import types

import torch

import torch_xla_jaxbridge as jb

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "torch_xla_jaxbridge"
NAME = "torch_xla_jaxbridge"

# package -> the packages it may import (besides itself). The public modules at the top (spmd,
# dlpack, remat, flash_attention) and `__init__` only re-export; the recipes use the public API.
ALLOWED = {
    "errors": set(),
    "_compat": set(),
    "_core": {"_compat", "errors"},
    "_integrations": {"_core", "_compat", "errors"},
    "_bridge": {"_core", "_compat", "errors"},
    "optim": {"_core", "_compat", "errors"},
    "_training": {"_bridge", "optim", "_core", "_compat", "errors"},
    "_interop": {"_bridge", "_core", "_compat", "errors"},
}
PUBLIC_MODULES = {"errors", "spmd", "dlpack", "remat", "flash_attention", "optim"}
RE_EXPORTS = {"spmd", "dlpack", "remat", "flash_attention", "__init__"}


def module_name(path):
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module):
  """`_core`, `optim`, `recipes`, ... for a module of the package; `__init__` for the package."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def _type_checking_only(tree):
  """The nodes under `if TYPE_CHECKING:` blocks of `tree`: imports for annotations only."""
  return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
          and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
          for stmt in node.body for inner in ast.walk(stmt)}


def imports(path, runtime_only=False):
  """`(module, names, line)` for each import of the package anywhere in `path` (`runtime_only`:
  not those under `if TYPE_CHECKING:`, which annotations read and Python never runs)."""
  found = []
  tree = ast.parse(path.read_text())
  skipped = _type_checking_only(tree) if runtime_only else set()
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == NAME:
      found.append((node.module, [a.name for a in node.names], node.lineno))
    elif isinstance(node, ast.Import):
      found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == NAME]
  return found


def resolve(module, names):
  """The package modules an import statement reads."""
  out = set()
  for name in names or [None]:
    candidate = f"{module}.{name}" if name else module
    exists = (ROOT / (candidate.replace(".", "/") + ".py")).exists() or (
        ROOT / candidate.replace(".", "/") / "__init__.py").exists()
    out.add(candidate if name and exists else module)
  return out


def import_graph(runtime_only=False):
  return {module_name(p): set().union(*[resolve(m, n) for m, n, _ in imports(p, runtime_only)]
                                      or [set()]) - {module_name(p)} for p in PACKAGE.rglob("*.py")}


def find_cycle(graph):
  state = {}

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return path[path.index(nxt):] + [nxt] if nxt in path else path + [nxt]
      if nxt not in state:
        cycle = visit(nxt, path + [nxt])
        if cycle:
          return cycle
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node, [node])
      if cycle:
        return cycle
  return None


def without_package_inits(graph):
  """The graph less the edges into a package's `__init__` made by importing its modules (Python
  runs the `__init__` first, but it imports nothing back)."""
  return {m: {t for t in targets if not (m.startswith(t + ".") and t != NAME)}
          for m, targets in graph.items() if m != NAME}


def test_the_import_graph_has_no_cycle():
  graph = without_package_inits(import_graph(runtime_only=True))
  assert f"{NAME}._core.tracing" in graph
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_each_package_imports_only_what_it_may():
  offenders = []
  for module, targets in import_graph().items():
    source = package_of(module)
    if source in RE_EXPORTS or source == "recipes":
      continue
    for target in targets:
      wanted = package_of(target)
      if wanted != source and wanted not in ALLOWED[source]:
        offenders.append(f"{module} imports {target} ({source} may import "
                         f"{sorted(ALLOWED[source]) or 'nothing'})")
  assert not offenders, "\n".join(offenders)


def test_the_package_list_matches_the_tree():
  on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - {"recipes"}
  assert on_disk == set(ALLOWED) - {"errors"}
  for package in on_disk | {"recipes"}:
    assert (PACKAGE / package / "README.md").exists(), f"{package} has no README.md"


def modules_on_disk(package):
  return {p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__"}


def named(text):
  """The names written as code (`name` or `name.py`) in `text`."""
  return set(re.findall(r"`([A-Za-z_]\w*)(?:\.\w+)*`", text))


def table_modules(readme):
  """The module names in the first column of a README's module table (`| `a`, `b` | ... |`)."""
  return {name for line in readme.splitlines() if line.startswith("| `")
          for name in named(line.split("|")[1])}


def test_each_readme_and_the_architecture_name_exactly_the_modules_on_disk():
  architecture, problems = (ROOT / "ARCHITECTURE.md").read_text(), []
  for package in sorted(set(ALLOWED) - {"errors"} | {"recipes"}):
    on_disk = modules_on_disk(package)
    readme = (PACKAGE / package / "README.md").read_text()
    problems += [f"{package}/README.md does not name {m}" for m in sorted(on_disk - named(readme))]
    problems += [f"{package}/README.md's table lists {m}, not on disk"
                 for m in sorted(table_modules(readme) - on_disk)]
    (row,) = [line for line in architecture.splitlines() if line.startswith(f"| `{package}/`")]
    problems += [f"ARCHITECTURE.md's {package}/ row does not name {m}"
                 for m in sorted(on_disk - named(row.split("|")[2]))]
  assert not problems, "\n".join(problems)


def registrations(path):
  """The `register_*` calls (with `_core.tracing`) in the module at `path`."""
  return [node.func.attr for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr.startswith("register_")]


def test_integrations_holds_only_modules_that_register_themselves_and_imports_each():
  folder = PACKAGE / "_integrations"
  silent = [p.stem for p in sorted(folder.glob("*.py")) if p.stem != "__init__"
            and not registrations(p)]
  assert not silent, f"_integrations/ modules that register nothing (move them): {silent}"
  (_, imported, _), = imports(folder / "__init__.py")
  assert set(imported) == modules_on_disk("_integrations")


def test_the_readme_check_finds_a_stale_table_row():
  assert table_modules("| module | holds |\n|---|---|\n| `gone`, `kept` | x |") == {"gone", "kept"}


def private_names_of_other_packages(path):
  """`file:line: import` where `path` reads a `_name` (module or attribute) of another package."""
  source = package_of(module_name(path))
  found = []
  for module, names, line in imports(path):
    target = package_of(module) if module != NAME else None
    inner = module.split(".")[2:] + names if target else names
    if target != source and any(part.startswith("_") for part in inner):
      found.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {', '.join(names)}")
  return found


def test_no_private_name_of_another_package_is_used():
  offenders = []
  for path in PACKAGE.rglob("*.py"):
    if package_of(module_name(path)) not in RE_EXPORTS:
      offenders += private_names_of_other_packages(path)
  assert not offenders, "\n".join(offenders)


SCRIPTS = ROOT / "scripts"


def non_public_imports(path, sealed_allowed):
  """`file:line: import` for each import in `path` of the package's private modules; with
  `sealed_allowed` (scripts/), `_compat`'s modules are allowed: the one way a script reaches
  another library's internals (a benchmark of torch_xla's own entry points), as the package
  does."""
  offenders = []
  for module, names, line in imports(path):
    parts = module.split(".")
    public = (len(parts) == 1 and all(n in jb.__all__ or n == "recipes" for n in names)) or (
        parts[1] in PUBLIC_MODULES | {"recipes"} and not any(
            p.startswith("_") for p in parts[2:] + names))
    sealed = sealed_allowed and parts[1:2] == ["_compat"] and not any(
        p.startswith("_") for p in parts[2:] + names)
    if not (public or sealed):
      offenders.append(f"{path.relative_to(ROOT)}:{line}: {module} {names}")
  return offenders


def test_recipes_use_only_the_public_api_and_scripts_also_compat():
  offenders = []
  for path in (PACKAGE / "recipes").rglob("*.py"):
    offenders += non_public_imports(path, sealed_allowed=False)
  for path in SCRIPTS.glob("*.py"):
    offenders += non_public_imports(path, sealed_allowed=True)
  assert not offenders, "\n".join(offenders)


def test_the_public_api_check_allows_scripts_compat_and_nothing_else_private(tmp_path):
  sample = tmp_path / "bench_sample.py"
  sample.write_text(f"import {NAME} as jb\nfrom {NAME}._compat import torch_xla_private\n"
                    f"from {NAME}._core import call\nfrom {NAME}._compat.jax_private import _jax\n"
                    f"from {NAME}.recipes import train\n")
  global ROOT
  saved, ROOT = ROOT, tmp_path
  try:
    as_script = non_public_imports(sample, sealed_allowed=True)
    as_recipe = non_public_imports(sample, sealed_allowed=False)
  finally:
    ROOT = saved
  assert [f.split(": ", 1)[1] for f in as_script] == [
      f"{NAME}._core ['call']", f"{NAME}._compat.jax_private ['_jax']"]
  assert len(as_recipe) == 3


# --- other libraries' internals only in _compat --------------------------------------------------

def _foreign_private_names():
  """Private names that belong to torch's base classes even where the package's classes set
  them (`self._parameters` on a Module subclass)."""
  opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
  return (set(dir(torch.nn.Module)) | set(vars(torch.nn.Module())) | set(dir(torch.Tensor)) |
          set(dir(torch.optim.Optimizer)) | set(vars(opt)) | set(dir(torch.autograd.Function)))


def _own_private_names(paths):
  """Private names the package defines: functions, classes, assignments, attributes it sets."""
  names = set()
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        names.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
  return {n for n in names if n.startswith("_")} - _foreign_private_names()


def _is_op_namespace(node):
  """`torch.ops.<namespace>.<op>`: an op's registered name, not a private attribute."""
  while isinstance(node, ast.Attribute):
    if (isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr == "ops"):
      return True
    node = node.value
  return False


# JAX's modules for extending it: public, but changed between versions; sealed as private ones.
SEALED = ("jax.interpreters", "jax.extend")


def _sealed(name):
  return any(name == s or name.startswith(s + ".") for s in SEALED)


# a named tuple's documented methods: the underscore only keeps them apart from field names
NAMED_TUPLE_API = {"_asdict", "_replace", "_make", "_fields", "_field_defaults"}


def foreign_private_uses(path, own):
  """`file:line: what` for each private attribute of another library's object read in `path`,
  each import of another library's private module, and each use of a sealed module."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
    if isinstance(node, ast.Attribute) and _sealed(ast.unparse(node)) and not (
        isinstance(node.value, ast.Attribute) and _sealed(ast.unparse(node.value))):
      found.append(f"{where}: {ast.unparse(node)}")
    elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not (
        node.attr.startswith("__") and node.attr.endswith("__")):
      base = node.value
      if (isinstance(base, ast.Name) and base.id in ("self", "cls")) or node.attr in own or (
          node.attr in NAMED_TUPLE_API):
        continue
      if not _is_op_namespace(node):
        found.append(f"{where}: {ast.unparse(node)}")
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] not in (
        NAME, "__future__"):
      if any(p.startswith("_") for p in node.module.split(".") + [a.name for a in node.names]) \
          or _sealed(node.module):
        found.append(f"{where}: from {node.module} import ...")
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] != NAME and (_sealed(alias.name) or any(
            p.startswith("_") for p in alias.name.split("."))):
          found.append(f"{where}: import {alias.name}")
  return found


def test_private_internals_of_other_libraries_only_in_compat():
  paths = list(PACKAGE.rglob("*.py")) + list(SCRIPTS.glob("*.py"))
  own = _own_private_names(paths)
  offenders = []
  for path in paths:
    if "_compat" not in path.parts:
      offenders += foreign_private_uses(path, own)
  assert not offenders, "private internals outside _compat/:\n" + "\n".join(offenders)


def test_the_private_internal_check_finds_them(tmp_path):
  sample = tmp_path / "sample.py"
  sample.write_text("import torch._dynamo\nfrom jax._src import config\n"
                    "x = torch_xla._XLAC\ny = module._parameters\nz = self._mine\n"
                    "w = torch.ops.aten._softmax.default\nfrom jax.interpreters import ad\n"
                    "v = jax.extend.core.Primitive\n")
  relative = sample.relative_to(tmp_path)
  global ROOT
  saved, ROOT = ROOT, tmp_path
  try:
    found = foreign_private_uses(sample, set())
  finally:
    ROOT = saved
  assert sorted(f.split(": ", 1)[1] for f in found) == sorted([
      "import torch._dynamo", "from jax._src import ...", "torch_xla._XLAC", "module._parameters",
      "from jax.interpreters import ...", "jax.extend"
  ]) and all(f.startswith(str(relative)) for f in found)


def test_the_private_internal_check_finds_them_in_a_script(tmp_path):
  sample = tmp_path / "scripts" / "bench_sample.py"
  sample.parent.mkdir()
  sample.write_text("import torch_xla\nout = None\n"
                    "torch_xla._XLAC._xla_sync_multi([out], [], True)\n"
                    "info = jb.cache_info()._asdict()\n")
  global ROOT
  saved, ROOT = ROOT, tmp_path
  try:
    found = foreign_private_uses(sample, _own_private_names([sample]))
  finally:
    ROOT = saved
  assert sorted(f.split(": ", 1)[1] for f in found) == [
      "torch_xla._XLAC", "torch_xla._XLAC._xla_sync_multi"]
  assert all(f.startswith("scripts/bench_sample.py:3") for f in found)


def test_no_compat_function_hands_out_a_module():
  from torch_xla_jaxbridge._compat import (jax_private, torch_private, torch_xla_private,
                                           torchax_private)

  for compat in (jax_private, torch_private, torch_xla_private, torchax_private):
    for name, fn in vars(compat).items():
      if callable(fn) and not name.startswith("_") and fn.__module__ == compat.__name__:
        source = inspect.getsource(fn)
        assert "return torch_xla._XLAC\n" not in source and "return torch.utils._pytree\n" not in (
            source), f"{compat.__name__}.{name} hands out a private module"


# --- sizes and types -----------------------------------------------------------------------------

MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 400, 120, 60


def code_lines(node):
  """Lines of a function or class, less its docstrings (its own and those of the definitions in
  it): documentation is not what makes a definition hard to read."""
  size = node.end_lineno - node.lineno + 1
  for inner in ast.walk(node):
    body = getattr(inner, "body", None)
    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and (
        isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and
        isinstance(body[0].value.value, str)):
      size -= body[0].end_lineno - body[0].lineno + 1
  return size


def test_modules_classes_and_functions_stay_small():
  offenders = []
  for path in PACKAGE.rglob("*.py"):
    text = path.read_text()
    lines = text.splitlines()
    where = path.relative_to(ROOT)
    if len(lines) > MAX_MODULE:
      offenders.append(f"{where}: {len(lines)} lines (at most {MAX_MODULE})")
    for node in ast.walk(ast.parse(text)):
      limit = (MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION if isinstance(
          node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
      if limit is None:
        continue
      size = code_lines(node)
      excused = re.search(r"#\s*size:", lines[node.lineno - 1])  # "# size: why" on the def line
      if size > limit and not excused:
        offenders.append(f"{where}:{node.lineno}: {node.name} has {size} lines (at most {limit})")
  assert not offenders, "\n".join(offenders)


def public_api():
  """Every public function and class: the package's names and its public namespaces'."""
  found = {}
  for name in jb.__all__:
    value = getattr(jb, name)
    if isinstance(value, types.ModuleType):
      for inner in getattr(value, "__all__", [n for n in vars(value) if not n.startswith("_")]):
        found[f"jb.{name}.{inner}"] = getattr(value, inner)
    else:
      found[f"jb.{name}"] = value
  return {k: v for k, v in found.items() if inspect.isfunction(v) or inspect.isclass(v)}


def _unannotated(fn, skip_first):
  signature = inspect.signature(fn)
  params = list(signature.parameters.values())[1 if skip_first else 0:]
  missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
  if signature.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
    missing.append("return")
  return missing


def test_every_public_function_and_class_is_typed():
  offenders = []
  for name, value in public_api().items():
    if inspect.isfunction(value):
      missing = _unannotated(value, skip_first=False)
    elif issubclass(value, BaseException) or "__init__" not in vars(value) or (
        __import__("dataclasses").is_dataclass(value)):
      continue  # exceptions, dataclasses and namedtuples are typed by their fields
    else:
      missing = _unannotated(value.__init__, skip_first=True)
    if missing:
      offenders.append(f"{name}: no annotation for {', '.join(missing)}")
  assert not offenders, "\n".join(offenders)


def test_the_package_says_it_is_typed():
  assert (PACKAGE / "py.typed").exists()


TYPED_PACKAGES = ("_core", "_bridge", "_training")  # every function annotated (mypy.ini: strict)


def untyped_definitions(tree, where):
  """`where:line: name (what)` for each function in `tree` with an unannotated parameter (a
  method's `self`/`cls` aside) or no return annotation (`__init__` aside)."""
  methods = {id(f) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
             for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    args = node.args
    params = [*args.posonlyargs, *args.args]
    static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
    if id(node) in methods and not static and params:
      params = params[1:]
    params += [*args.kwonlyargs, *[a for a in (args.vararg, args.kwarg) if a is not None]]
    missing = [a.arg for a in params if a.annotation is None]
    if node.returns is None and node.name != "__init__":
      missing.append("return")
    if missing:
      found.append(f"{where}:{node.lineno}: {node.name} ({', '.join(missing)})")
  return found


def test_every_function_of_the_typed_packages_is_annotated():
  offenders = []
  for package in TYPED_PACKAGES:
    for path in sorted((PACKAGE / package).glob("*.py")):
      offenders += untyped_definitions(ast.parse(path.read_text()), path.relative_to(ROOT))
  assert not offenders, "functions without annotations:\n" + "\n".join(offenders)


def test_the_annotation_check_finds_them():
  sample = ast.parse("class A:\n  def m(self, x: int) -> None: ...\n  @staticmethod\n"
                     "  def s(ctx, y: int) -> int: ...\n  def __init__(self, z): ...\n"
                     "def f(a: int, *rest, k: int = 1, **more: int):\n  def inner(b) -> int: ...\n")
  assert sorted(untyped_definitions(sample, "s")) == [
      "s:4: s (ctx)", "s:5: __init__ (z)", "s:6: f (rest, return)", "s:7: inner (b)"]


def test_one_optional_style():
  """`X | None` and `A | B` (Python 3.10+), never `Optional[X]` or `Union[A, B]`."""
  offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"\b(Optional|Union)\[", line)]
  assert not offenders, "write `X | None` / `A | B`:\n" + "\n".join(offenders)
