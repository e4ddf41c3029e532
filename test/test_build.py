"""BUILD declares a py_library with every package module, one with the test helpers and a py_test
per test file: the BUILD file evaluated (its Starlark here is Python) with Bazel's `glob`."""
import fnmatch
import pathlib

ROOT = pathlib.Path(__file__).parents[1]


def glob(include, exclude=()):
  """Bazel's `glob` over the checkout: files matching a pattern (`**`: any folders, none
  included), sorted."""
  def matches(path, pattern):
    if "/**/" in pattern:
      return fnmatch.fnmatch(path, pattern) or matches(path, pattern.replace("/**/", "/"))
    return fnmatch.fnmatch(path, pattern) and path.count("/") == pattern.count("/")

  found = set()
  for pattern in include:
    base = ROOT.joinpath(*pattern.split("*")[0].split("/")[:-1])
    for path in base.rglob("*") if "**" in pattern else base.glob("*"):
      relative = str(path.relative_to(ROOT))
      if path.is_file() and matches(relative, pattern) and not any(
          matches(relative, p) for p in exclude):
        found.add(relative)
  return sorted(found)


def build_rules():
  """(kind, attributes) of each rule BUILD declares."""
  rules = []
  rule = lambda kind: lambda **kw: rules.append((kind, kw))  # noqa: E731
  exec((ROOT / "BUILD").read_text(), {"glob": glob, "py_library": rule("py_library"),
                                      "py_test": rule("py_test")})
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


def test_glob_matches_as_bazels():
  assert "torch_xla_jaxbridge/_core/call.py" in glob(["torch_xla_jaxbridge/**/*.py"])
  assert "torch_xla_jaxbridge/__init__.py" in glob(["torch_xla_jaxbridge/**/*.py"])
  assert glob(["test/*.py"], exclude=["test/test_*.py"]) == sorted(
      str(p.relative_to(ROOT)) for p in (ROOT / "test").glob("*.py")
      if not p.name.startswith("test_"))
  assert "test/test_build.py" not in glob(["*.py"])
