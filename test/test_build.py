"""BUILD declares a py_library with every package module and a py_test per test file."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[1]


def build_rules():
  tree = ast.parse((ROOT / "BUILD").read_text())
  rules = []
  for node in tree.body:
    call = node.value
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    rules.append((call.func.id, kwargs))
  return rules


def libraries():
  return {kw["name"]: kw for kind, kw in build_rules() if kind == "py_library"}


def test_library_lists_every_module():
  modules = {str(p.relative_to(ROOT)) for p in (ROOT / "torch_xla_jaxbridge").rglob("*.py")}
  assert set(libraries()["torch_xla_jaxbridge"]["srcs"]) == modules


def test_support_library_lists_every_helper():
  helpers = {str(p.relative_to(ROOT)) for p in (ROOT / "test").glob("*.py")
             if not p.name.startswith("test_")}
  assert set(libraries()["test_support"]["srcs"]) == helpers


def test_one_py_test_per_test_file():
  tests = {kw["name"]: kw for kind, kw in build_rules() if kind == "py_test"}
  files = {p.stem: str(p.relative_to(ROOT)) for p in (ROOT / "test").glob("test_*.py")}
  assert set(tests) == set(files)
  for name, kw in tests.items():
    assert kw["srcs"] == [files[name]]
    assert kw["deps"] == [":torch_xla_jaxbridge", ":test_support"]
