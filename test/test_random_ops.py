"""Random ops whose torchax conversion drew wrong numbers (or none), against plain torch_xla's
draws of the same op: the same distribution (moments, support, quantiles), fresh numbers each
call, with `fallback=False` (nothing falls back)."""
import pytest
import torch
import torch_xla

import torch_xla_jaxbridge as jb

N = 20000
OPS = {
    "exponential_": lambda t: t.exponential_(2.0),
    "normal_ with mean and std": lambda t: t.normal_(2.0, 3.0),
    "random_ from to": lambda t: t.random_(0, 10),
    "random_ to": lambda t: t.random_(4),
    "random_ of an int64 tensor": lambda t: t.long().random_(3, 7).float(),
    "normal of two tensors": lambda t: torch.normal(torch.zeros_like(t), torch.full_like(t, 2.0)),
    "normal of a tensor and a float": lambda t: torch.normal(torch.ones_like(t), 2.0),
    "normal of a float and a tensor": lambda t: torch.normal(1.0, torch.full_like(t, 2.0)),
}


def _draw(op, bridged):
  fn = (lambda x: op(torch.zeros(N, device=x.device)))
  x = torch.ones(1, device="xla")
  if bridged:
    fn = jb.bridge(fn, fallback=False)
  first, second = fn(x).cpu(), fn(x).cpu()
  torch_xla.sync()
  return first, second


@pytest.mark.parametrize("name", OPS)
def test_a_random_op_draws_plain_torch_xlas_distribution_afresh(name):
  torch_xla.manual_seed(0)
  plain, _ = _draw(OPS[name], bridged=False)
  got, again = _draw(OPS[name], bridged=True)
  assert got.dtype == plain.dtype and not torch.equal(got, again)
  assert abs(got.mean() - plain.mean()) < 0.1 * plain.std() + 1e-3
  assert abs(got.std() / plain.std() - 1) < 0.05
  assert got.min() >= plain.min() - 3 * plain.std() and got.max() <= plain.max() + 3 * plain.std()
  if name.startswith("random_"):  # integers: the same values, `to` excluded
    assert set(got.tolist()) == set(plain.tolist())


def test_cauchy_and_gumbel_softmax_draw_as_plain_torch_xla():
  """`cauchy_` left its input as it was; `F.gumbel_softmax` (`exponential_` inside) gave NaN."""
  cauchy = lambda x: torch.zeros(N, device=x.device).cauchy_(1.0, 2.0)  # noqa: E731
  got = jb.bridge(cauchy, fallback=False)(torch.ones(1, device="xla")).cpu()
  quartiles = torch.quantile(got, torch.tensor([0.25, 0.5, 0.75]))
  torch.testing.assert_close(quartiles, torch.tensor([-1.0, 1.0, 3.0]), atol=0.15, rtol=0)
  gumbel = lambda logits: torch.nn.functional.gumbel_softmax(logits, tau=0.5)  # noqa: E731
  logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(N // 4, 3).to("xla")
  soft = jb.bridge(gumbel, fallback=False)(logits).cpu()
  assert torch.isfinite(soft).all()
  torch.testing.assert_close(soft.sum(-1), torch.ones(N // 4))
  picked = torch.bincount(soft.argmax(-1), minlength=3) / (N // 4)  # Gumbel-max: the probabilities
  torch.testing.assert_close(picked, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)
