"""Install torch_xla_jaxbridge. Use `make test` / `make train`: they install the pinned stack in order."""
from setuptools import find_packages, setup

# torch_xla's wheel bundles an old torchax/ that imports flax; the Makefile force-reinstalls the
# pinned torchax after torch_xla so its files win (test/test_install.py checks the result).
STACK = [
    "torch==2.9.0",
    "torch_xla==2.9.0",
    "jax==0.7.1",
    "jaxlib==0.7.1",
    "torchax==0.0.13",
    "absl-py",
    "pyyaml",
]

setup(
    name="torch_xla_jaxbridge",
    version="0.1.0",
    description="Run the heavy parts of PyTorch/XLA training as JAX inside the LazyTensor graph.",
    packages=find_packages(include=["torch_xla_jaxbridge", "torch_xla_jaxbridge.*"]),
    package_data={"torch_xla_jaxbridge": ["py.typed", "recipes/configs/*.yaml",
                                          "recipes/configs/model/*.yaml", "recipes/data/*"]},
    python_requires=">=3.11",
    install_requires=STACK,
    extras_require={"test": ["pytest", "transformers==4.57.1", "mypy==1.13.0", "accelerate==1.11.0",
                             "torchvision==0.24.0", "expecttest==0.3.0"]},
)
