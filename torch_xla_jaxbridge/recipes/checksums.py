"""Checksums of a checkpoint directory's files: written when a checkpoint is committed, verified
before it is loaded, so bytes changed on disk or in a copy are found before training resumes
from them.

`checksums.json` in the directory holds `{"algorithm": "crc32", "files": {name: {"bytes": n,
"digest": hex}}}` for every other file (data files, `.metadata`, `config.json`). CRC32 (zlib)
by default: it finds every single-bit flip and every burst of up to 32 changed bits, and hashes
a checkpoint about twice as fast as SHA-256 (docs/recipes.md, "The run directory"); it is not a
defence against deliberate changes, which could rewrite `checksums.json` too.
"""
import hashlib
import json
import os
import pathlib
import zlib

FILE = "checksums.json"
_CHUNK = 16 << 20  # bytes read at a time


def record(path: str | os.PathLike, algorithm: str = "crc32") -> dict:
  """The `checksums.json` record of directory `path`: the size and `algorithm` digest ("crc32",
  or any `hashlib` name such as "sha256") of each file in it but `checksums.json`.

  Example:
    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (path / "data").write_bytes(b"abc")
    >>> record(path)
    {'algorithm': 'crc32', 'files': {'data': {'bytes': 3, 'digest': '352441c2'}}}
  """
  path = pathlib.Path(path)
  files = {f.name: {"bytes": f.stat().st_size, "digest": digest(f, algorithm)}
           for f in sorted(path.iterdir()) if f.is_file() and f.name != FILE}
  return {"algorithm": algorithm, "files": files}


def write(path: str | os.PathLike, algorithm: str = "crc32") -> None:
  """Writes (and fsyncs) `path/checksums.json`, the `record` of directory `path`.

  Example:
    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp())
    >>> write(path)
    >>> json.loads((path / FILE).read_text())
    {'algorithm': 'crc32', 'files': {}}
  """
  write_durably(pathlib.Path(path) / FILE, json.dumps(record(path, algorithm), indent=2))


def mismatch(path: str | os.PathLike) -> str | None:
  """Why a file of directory `path` does not match its `checksums.json` record (changed,
  missing, or the record unreadable), or None: every file matches, or there is no record.

  Example:
    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (path / "data").write_bytes(b"abc")
    >>> write(path)
    >>> mismatch(path) is None
    True
    >>> _ = (path / "data").write_bytes(b"abd")
    >>> mismatch(path).startswith("file data does not match its crc32 checksum (saved 352441c2")
    True
  """
  path = pathlib.Path(path)
  if not (path / FILE).is_file():
    return None
  try:
    saved = json.loads((path / FILE).read_text())
    algorithm = saved["algorithm"]
    for name, want in sorted(saved["files"].items()):
      file = path / name
      if not file.is_file():
        return f"file {name} listed in {FILE} is missing"
      got = {"bytes": file.stat().st_size, "digest": digest(file, algorithm)}
      if got != {"bytes": want["bytes"], "digest": want["digest"]}:
        return (f"file {name} does not match its {algorithm} checksum (saved {want['digest']}, "
                f"{want['bytes']} bytes; now {got['digest']}, {got['bytes']} bytes): its bytes "
                f"changed after the save (disk, copy or transfer damage)")
  except (ValueError, KeyError, TypeError, AttributeError) as e:  # also an unknown algorithm
    return f"unreadable {FILE} ({type(e).__name__}: {e})"
  return None


def digest(file: str | os.PathLike, algorithm: str = "crc32") -> str:
  """The hex digest of `file`'s bytes: "crc32" (zlib), or any `hashlib` algorithm.

  Example:
    >>> import tempfile
    >>> file = pathlib.Path(tempfile.mkdtemp()) / "data"
    >>> _ = file.write_bytes(b"abc")
    >>> digest(file), digest(file, "sha256")[:16]
    ('352441c2', 'ba7816bf8f01cfea')
  """
  hasher = _Crc32() if algorithm == "crc32" else hashlib.new(algorithm)
  with open(file, "rb") as f:
    while chunk := f.read(_CHUNK):
      hasher.update(chunk)
  return hasher.hexdigest()


def write_durably(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to file `path` and fsyncs it (its directory entry is the caller's to sync).

  Example:
    >>> import tempfile
    >>> file = pathlib.Path(tempfile.mkdtemp()) / "note"
    >>> write_durably(file, "hello")
    >>> file.read_text()
    'hello'
  """
  with open(path, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


class _Crc32:
  """zlib's CRC32 with hashlib's `update` / `hexdigest`."""

  def __init__(self):
    self.value = 0

  def update(self, chunk):
    self.value = zlib.crc32(chunk, self.value)

  def hexdigest(self):
    return f"{self.value:08x}"
