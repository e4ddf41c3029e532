"""The package's dependencies run one way, and private internals are reached only through _compat."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "torch_xla_jaxbridge"


def module_name(path):
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path):
  """Package modules imported anywhere in `path` (top level or inside functions)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
        "torch_xla_jaxbridge"):
      for alias in node.names:
        candidate = f"{node.module}.{alias.name}"
        found.add(candidate if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists()
                  else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("torch_xla_jaxbridge."))
  return found


def import_graph():
  return {module_name(p): package_imports(p) - {module_name(p)}
          for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


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


def test_the_import_graph_has_no_cycle():
  graph = import_graph()
  assert "torch_xla_jaxbridge.tracing" in graph
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_tracing_imports_no_feature_module():
  leaves = {"torch_xla_jaxbridge._compat", "torch_xla_jaxbridge.diagnostics",
            "torch_xla_jaxbridge.errors", "torch_xla_jaxbridge.rng", "torch_xla_jaxbridge.runtime"}
  assert import_graph()["torch_xla_jaxbridge.tracing"] <= leaves


PRIVATE = re.compile(r"\bjax\._src\b|\._XLAC\b|\._elem\b|(from|import) jaxlib\b|"
                     r"from torchax\.ops|__dynamo_disable|\.py_impl\(")


def test_private_internals_only_in_compat():
  offenders = []
  for path in PACKAGE.rglob("*.py"):
    if path.name == "_compat.py":
      continue
    for number, line in enumerate(path.read_text().splitlines(), start=1):
      if PRIVATE.search(line):
        offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
  assert not offenders, "private internals outside _compat.py:\n" + "\n".join(offenders)
