"""Files of a run on local disk or in a bucket (`gs://...`), through one path type: `etils.epath`.

Local paths behave as plain files. Object stores have no append and no rename, so the writers
here take what a bucket does offer: an object appears whole when its upload finishes, or not at
all. A file that grows (`Appender`) is rewritten whole on a bucket; an atomic write
(`write_atomic`) is a single upload there (local: a temporary file, then `os.replace`); a
directory written file by file on a bucket (an export) holds a marker (`IN_PROGRESS`) from its
first write until its last, and a reader refuses a directory that holds it.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

from etils import epath

Path = epath.Path
IN_PROGRESS = ".in_progress"  # in a directory being written; deleted after its last file


def path(p: str | os.PathLike) -> epath.Path:
  """`p` as an `epath.Path`; a local path made absolute (what Orbax takes)."""
  out = epath.Path(p)
  return out if is_remote(out) else epath.Path(os.path.abspath(os.fspath(out)))


def is_remote(p: str | os.PathLike) -> bool:
  """Whether `p` names an object store (`gs://`, `s3://`, ...) rather than local disk."""
  return "://" in os.fspath(p)


def check_bucket(p: str | os.PathLike) -> None:
  """Raise `FileNotFoundError` (one line naming `p`) when `p` lies in a bucket that does not exist
  or cannot be reached with these credentials; nothing for a local path."""
  if not is_remote(p):
    return
  scheme, rest = os.fspath(p).split("://", 1)
  bucket = f"{scheme}://{rest.split('/')[0]}"
  try:
    found = epath.Path(bucket).exists()
  except Exception as e:  # credentials, network: whatever the client raises
    text = (str(e).splitlines() or [""])[0]
    raise FileNotFoundError(f"{p}: cannot reach bucket {bucket} ({type(e).__name__}: {text}); "
                            "check the network and the credentials (gcloud auth "
                            "application-default login)") from e
  if not found:
    raise FileNotFoundError(f"{p}: no bucket {bucket}, or no access to it (check its name and the "
                            "credentials: gcloud auth application-default login)")


def raise_if_bucket_lost(p: str | os.PathLike, error: BaseException) -> None:
  """After `error`: when `p`'s bucket is now gone or unreachable, raise that as one line naming
  `p` (the cause kept); else return."""
  try:
    check_bucket(p)
  except FileNotFoundError as lost:
    raise FileNotFoundError(f"{lost}; the run stopped, its last complete checkpoint is kept: rerun "
                            "the same command once the bucket is back") from error


def makedirs(p: epath.Path) -> None:
  """Create a local directory (with parents). A bucket has no directories: nothing to do, and
  nothing created (gcsfs would create a missing bucket)."""
  if not is_remote(p):
    p.mkdir(parents=True, exist_ok=True)


def write_atomic(p: epath.Path, text: str) -> None:
  """Write `text` to `p` so that a reader sees the old or the new content, never a part."""
  if is_remote(p):
    p.write_text(text)  # an object appears when its upload completes
    return
  tmp = p.with_name(p.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, p)


class Appender:
  """Lines appended to a text file: on local disk with `open(..., "a")`; on a bucket (no append)
  kept in memory and the file rewritten whole by `sync`."""

  def __init__(self, p: epath.Path, initial: str = ""):
    """`initial`: the file's content to start from (it is written now)."""
    self.path = p
    self._remote = is_remote(p)
    self._text = initial
    self._dirty = False
    if self._remote:
      p.write_text(initial)
    else:
      write_atomic(p, initial)

  def append(self, text: str) -> None:
    if self._remote:
      self._text += text
      self._dirty = True
    else:
      with self.path.open("a") as f:
        f.write(text)

  def sync(self) -> None:
    """Upload what was appended since the last sync (a bucket); nothing to do on local disk."""
    if self._dirty:
      self.path.write_text(self._text)
      self._dirty = False


def append_text(p: epath.Path, text: str) -> None:
  """Append `text` to `p` once (a bucket: read, then rewrite whole)."""
  if is_remote(p):
    p.write_text((p.read_text() if p.exists() else "") + text)
  else:
    with p.open("a") as f:
      f.write(text)


@contextlib.contextmanager
def local_copy(p: epath.Path):
  """A local path holding `p`'s bytes (`p` itself on local disk), for readers that need one."""
  if not is_remote(p):
    yield p
    return
  with tempfile.NamedTemporaryFile(suffix=p.suffix) as f:
    f.write(p.read_bytes())
    f.flush()
    yield f.name


def check_complete(directory: epath.Path) -> None:
  """Raise (one line naming it) if `directory` is a half-written export."""
  if (directory / IN_PROGRESS).exists():
    raise FileNotFoundError(f"{directory} is incomplete (it holds {IN_PROGRESS}: its writing "
                            "stopped before the end); write it again")
