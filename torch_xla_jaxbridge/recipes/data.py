"""Training batches: the shipped public-domain text read byte by byte, or random tokens.

Batch `step` depends only on (seed, step), so a resumed run sees the same batches.
"""
import pathlib

import torch

CORPUS = pathlib.Path(__file__).parent / "data" / "corpus.txt"


def corpus_tokens():
  """The shipped corpus as a 1-D uint8-valued long tensor (byte-level tokens, vocab 256).

  Example:
    >>> corpus_tokens()[:4].tolist()
    [70, 111, 117, 114]
  """
  return torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)


def batch(step, *, batch, seq, seed, source, vocab):
  """(inputs, targets), each (batch, seq) long tensors on the CPU, for training step `step`.

  Example:
    >>> x, y = batch(0, batch=2, seq=8, seed=0, source="corpus", vocab=256)
    >>> torch.equal(x[:, 1:], y[:, :-1])
    True
  """
  generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
  if source == "synthetic":
    windows = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
  else:
    tokens = corpus_tokens()
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=generator)
    windows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
  return windows[:, :-1], windows[:, 1:]


class Batches:
  """The batches of steps `start` .. `stop - 1`, in order, as an iterable of known length: what a
  `DataLoader`-style reader such as torch_xla's `MpDeviceLoader` consumes. Each pass starts again
  at `start`.

  Example:
    >>> batches = Batches(3, 5, batch=2, seq=8, seed=0, source="corpus", vocab=256)
    >>> len(batches), [tuple(x.shape) for x, y in batches]
    (2, [(2, 8), (2, 8)])
    >>> torch.equal(next(iter(batches))[0], batch(3, batch=2, seq=8, seed=0, source="corpus",
    ...                                            vocab=256)[0])
    True
  """

  def __init__(self, start: int, stop: int, **options):
    self.start, self.stop, self.options = start, stop, options

  def __len__(self) -> int:
    return max(0, self.stop - self.start)

  def __iter__(self):
    return (batch(step, **self.options) for step in range(self.start, self.stop))
