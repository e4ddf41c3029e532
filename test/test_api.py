"""assume_pure's upstream keywords: use_cache."""
import torch

import torch_xla_jaxbridge as jb


def test_use_cache_false_traces_every_call(dev):
  scale = {"by": 2.0}

  def times(a):
    return a * scale["by"]

  cached, every_call = jb.assume_pure(times), jb.assume_pure(times, use_cache=False)
  x = torch.ones(2, device=dev)
  misses = jb.cache_info().misses
  assert cached(x).cpu().tolist() == [2.0, 2.0]
  assert cached(x).cpu().tolist() == [2.0, 2.0]  # nothing changed: the cached trace
  scale["by"] = 3.0
  assert cached(x).cpu().tolist() == [3.0, 3.0]  # a plain value it reads changed: traced again
  assert jb.cache_info().misses == misses + 2
  assert every_call(x).cpu().tolist() == [3.0, 3.0]
  assert every_call(x).cpu().tolist() == [3.0, 3.0]  # nothing changed, traced all the same
  assert jb.cache_info().misses == misses + 4
