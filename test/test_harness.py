"""scripts/harness.py, the benchmarks' one harness: its docstring examples, and a child process
run the way every benchmark runs its modes (`harness.main` on one side, `run_child` on the
other)."""
import doctest
import importlib.util
import pathlib

import pytest

SCRIPTS = pathlib.Path(__file__).parents[1] / "scripts"
_spec = importlib.util.spec_from_file_location("harness", SCRIPTS / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)  # not on sys.path: scripts/ names no test module's imports


def test_the_docstring_examples_hold():
  failed, tried = doctest.testmod(harness)
  assert tried > 10 and failed == 0


CHILD = '''import sys
sys.path.insert(0, {scripts!r})
import harness


def child(mode: str, layers: int, same: bool, config: dict) -> dict:
  return {{"mode": mode, "layers": layers, "same": same, "config": config}}


def main():
  return 3


if __name__ == "__main__":
  harness.main(main, child)
'''


def test_a_child_gets_its_arguments_typed_and_its_result_comes_back(tmp_path):
  script = tmp_path / "bench_sample.py"
  script.write_text(CHILD.format(scripts=str(SCRIPTS)))
  results = harness.rounds([("plain",), ("bridged",)], 2, lambda mode: harness.run_child(
      str(script), [mode, 8, True, {"a": [1]}]), log=None)
  assert results[("bridged",)] == [{"mode": "bridged", "layers": 8, "same": True,
                                    "config": {"a": [1]}}] * 2
  assert [r["mode"] for r in harness.in_order(results)] == ["plain", "bridged"] * 2


def test_a_failing_child_raises_with_its_output(tmp_path):
  script = tmp_path / "bench_sample.py"
  script.write_text(CHILD.format(scripts=str(SCRIPTS)).replace(
      '  return {"mode"', '  raise ValueError("no such mode")\n  return {"mode"'))
  with pytest.raises(RuntimeError, match="no such mode"):
    harness.run_child(str(script), ["plain", 8, False, {}])
