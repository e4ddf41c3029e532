"""Train a small MLP on CPU with the loss and gradients computed by JAX inside the torch_xla step.

Each step adds one `call_jax` node (JAX `value_and_grad` of the loss) to the LazyTensor graph,
updates the torch parameters with SGD, and runs the step as one XLA program at `torch_xla.sync()`.

  python scripts/train_call_jax.py [--steps 150] [--lr 0.2]
"""
import argparse
import time

import torch_xla_jaxbridge as jb
import jax
import jax.numpy as jnp
import torch
import torch_xla


def loss_fn(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  pred = h @ params["w2"] + params["b2"]
  return jnp.mean((pred - y) ** 2)


def loss_and_grads(params, x, y):
  return jax.value_and_grad(loss_fn)(params, x, y)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--lr", type=float, default=0.2)
  opts = parser.parse_args()
  torch.manual_seed(0)
  dev = torch_xla.device()
  x = torch.randn(256, 8)
  y = torch.sin(x.sum(dim=1, keepdim=True) / 3)  # the function to learn
  x, y = x.to(dev), y.to(dev)
  params = {"w1": torch.randn(8, 64) * 0.3, "b1": torch.zeros(64),
            "w2": torch.randn(64, 1) * 0.1, "b2": torch.zeros(1)}
  params = {k: v.to(dev) for k, v in params.items()}
  for step in range(opts.steps):
    start = time.perf_counter()
    loss, grads = jb.call_jax(loss_and_grads, (params, x, y))
    params = {k: params[k] - opts.lr * grads[k] for k in params}
    torch_xla.sync()
    print(f"step {step:3d}  loss {loss.item():.5f}  {1e3 * (time.perf_counter() - start):6.1f} ms",
          flush=True)
  info = jb.cache_info()
  print(f"traces: {info.misses}, cache hits: {info.hits}")


if __name__ == "__main__":
  main()
