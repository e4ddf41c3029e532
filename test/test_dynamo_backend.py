"""torch.compile(backend="jaxbridge"): CPU and XLA inputs, gradients, modules, graph breaks."""
import torch
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_jaxbridge as jb
from torch_xla_jaxbridge._interop import dynamo_backend


def mlp_loss(x, w1, w2):
  return (torch.nn.functional.gelu(x @ w1) @ w2).square().mean()


def inputs():
  torch.manual_seed(0)
  return (torch.randn(8, 16), torch.randn(16, 32, requires_grad=True),
          torch.randn(32, 4, requires_grad=True))


def eager_reference():
  x, w1, w2 = inputs()
  loss = mlp_loss(x, w1, w2)
  loss.backward()
  return loss.detach(), w1.grad, w2.grad


def test_backend_is_registered_on_import():
  assert "jaxbridge" in torch._dynamo.list_backends(exclude_tags=())


def test_cpu_inputs_run_bridged_and_come_back_on_cpu_without_copies():
  torch._dynamo.reset()
  loss_ref, g1_ref, g2_ref = eager_reference()
  compiled = torch.compile(mlp_loss, backend="jaxbridge")
  x, w1, w2 = inputs()
  compiled(x, w1, w2).backward()  # warm up: trace, lower and compile both halves
  transfers = met.metric_data("TransferToDeviceTime")
  traces = jb.cache_info().misses
  w1.grad = w2.grad = None
  loss = compiled(x, w1, w2)
  loss.backward()
  assert loss.device.type == "cpu" and w1.grad.device.type == "cpu"
  assert met.metric_data("TransferToDeviceTime") == transfers  # DLPack, not .to("xla")
  assert jb.cache_info().misses == traces, jb.cache_info().retrace_reasons  # traced once
  torch.testing.assert_close(loss, loss_ref)
  torch.testing.assert_close(w1.grad, g1_ref)
  torch.testing.assert_close(w2.grad, g2_ref)


def test_xla_inputs_stay_on_xla_with_matching_gradients(dev):
  torch._dynamo.reset()
  loss_ref, g1_ref, g2_ref = eager_reference()
  x, w1, w2 = (t.detach().to(dev).requires_grad_(t.requires_grad) for t in inputs())
  loss = torch.compile(mlp_loss, backend="jaxbridge")(x, w1, w2)
  assert loss.is_xla
  ir = torch_xla._XLAC._get_xla_tensors_text([loss])
  assert "xla::GraphModule" in ir and "aten::gelu" not in ir  # one bridged node, no torch ops
  loss.backward()
  torch.testing.assert_close(loss.detach().cpu(), loss_ref)
  torch.testing.assert_close(w1.grad.cpu(), g1_ref)
  torch.testing.assert_close(w2.grad.cpu(), g2_ref)


def test_compiled_module_trains_like_eager():
  torch._dynamo.reset()
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
  reference = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
  reference.load_state_dict(model.state_dict())
  x = torch.randn(4, 16)
  compiled = torch.compile(model, backend="jaxbridge")
  for net in (compiled, reference):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
      opt.zero_grad()
      net(x).square().sum().backward()
      opt.step()
  for p, r in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p, r)


def test_graph_break_falls_back_to_eager_between_bridged_graphs():
  torch._dynamo.reset()
  graphs = []

  def counting_backend(gm, example_inputs):
    graphs.append(gm)
    return dynamo_backend.jaxbridge_backend(gm, example_inputs)

  def fn(x):
    y = torch.sin(x) * 2
    torch._dynamo.graph_break()
    return torch.cos(y) + x

  x = torch.randn(5, requires_grad=True)
  out = torch.compile(fn, backend=counting_backend)(x)
  out.sum().backward()
  ref = x.detach().clone().requires_grad_()
  fn(ref).sum().backward()
  assert len(graphs) == 2
  torch.testing.assert_close(out, fn(x.detach()))
  torch.testing.assert_close(x.grad, ref.grad)


def test_in_place_change_of_a_cpu_result_before_backward_works_as_in_eager():
  torch._dynamo.reset()
  x = torch.randn(3, requires_grad=True)
  y = torch.compile(lambda t: torch.sin(t) * 2, backend="jaxbridge")(x)
  y.add_(1)
  y.sum().backward()
  torch.testing.assert_close(x.grad, 2 * torch.cos(x.detach()))


class _Residual(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

  def forward(self, x):
    return x + self.b(torch.nn.functional.gelu(self.a(x)))


def _stack_loss(model, x, backend):
  """Loss and gradients of `model` compiled with `backend` on `x`."""
  torch._dynamo.reset()
  model.zero_grad()
  loss = torch.compile(model, backend=backend)(x).square().mean()
  loss.backward()
  return loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


def test_a_model_with_bridged_layers_compiles_with_torch_xlas_backend_as_plain(dev):
  """`torch.compile(model, backend="openxla")`: Dynamo traces the bridged layers' torch code
  (a bridge called while Dynamo traces runs plain), as for the model without the bridge."""
  torch.manual_seed(0)
  eager = torch.nn.Sequential(_Residual(), _Residual())
  x = torch.randn(4, 8)
  expected = _stack_loss(eager, x, "eager")
  for bridged in (False, True):
    model = torch.nn.Sequential(_Residual(), _Residual()).to(dev)
    model.load_state_dict(eager.state_dict())
    if bridged:
      jb.bridge_modules(model, ["_Residual"])
    loss, grads = _stack_loss(model, x.to(dev), "openxla")
    torch.testing.assert_close(loss, expected[0])
    for got, want in zip(grads, expected[1]):
      torch.testing.assert_close(got, want)
