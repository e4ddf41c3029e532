"""The package's exception types. Every message says what was wrong and what to do."""


class BridgeError(Exception):
  """Base class of the errors raised by torch_xla_jaxbridge."""


class BadArgumentError(BridgeError, TypeError):
  """An argument cannot cross the torch/JAX boundary (wrong device, unhashable static, ...)."""


class JaxTracingError(BridgeError):
  """The JAX function raised while being traced for one abstract signature."""
