"""`jb.optim`: optimizers whose whole step is one graph node, and learning-rate schedules.

Each optimizer is a `torch.optim.Optimizer` over an update `Rule` (JAX functions over one
parameter's arrays); `jb.train_step` runs the same rule inside its own node. A new optimizer is
one module: its rule, its class and `register` (docs/optim.md).
"""
from torch_xla_jaxbridge.optim._adafactor import Adafactor as Adafactor
from torch_xla_jaxbridge.optim._adamw import AdamW as AdamW
from torch_xla_jaxbridge.optim._lion import Lion as Lion
from torch_xla_jaxbridge.optim._optimizer import RuleOptimizer as RuleOptimizer
from torch_xla_jaxbridge.optim._rule import Rule as Rule
from torch_xla_jaxbridge.optim._rule import optimizers as optimizers
from torch_xla_jaxbridge.optim._rule import register as register
from torch_xla_jaxbridge.optim._step import apply_rule as apply_rule
from torch_xla_jaxbridge.optim._schedules import warmup_constant as warmup_constant
from torch_xla_jaxbridge.optim._schedules import warmup_cosine as warmup_cosine
from torch_xla_jaxbridge.optim._schedules import warmup_linear as warmup_linear
from torch_xla_jaxbridge.optim._sgd import SGD as SGD

__all__ = ["SGD", "AdamW", "Lion", "Adafactor", "RuleOptimizer", "Rule", "register",
           "optimizers", "apply_rule", "warmup_cosine", "warmup_linear", "warmup_constant"]
