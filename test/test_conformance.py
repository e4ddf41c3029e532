"""scripts/conformance.py on a pytorch/xla checkout (PYTORCH_XLA_SRC): every upstream test that
passes with upstream's names passes with ours (the script leaves out, with the reason, the tests
that read upstream's implementation). Slow: `make slow`."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.slow
def test_upstream_tests_pass_with_our_names(tmp_path):
  source = os.environ.get("PYTORCH_XLA_SRC")
  assert source, ("set PYTORCH_XLA_SRC to a pytorch/xla checkout matching the installed "
                  "torch_xla (its test/ and examples/ folders) to run upstream's tests")
  out = tmp_path / "conformance.json"
  done = subprocess.run([sys.executable, str(ROOT / "scripts" / "conformance.py"), source,
                         "--json", str(out)], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  for row in json.loads(out.read_text()):
    regressions = set(row["ours"]["failed"]) - set(row["upstream"]["failed"])
    assert not regressions, (row["file"], regressions, row["ours"]["log"])
    assert row["ours"]["passed"] >= row["upstream"]["passed"], row["file"]
