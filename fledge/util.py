"""Errors that reach the user as one line, and writes that never leave half a file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


class FledgeError(Exception):
    """A problem the user can fix. The CLI prints `fledge: error: <message>` and exits 2.

    Messages name the file (or argument) and the problem in one line.
    """


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary sibling, fsync, then rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory that becomes `path` only if the block succeeds.

    An existing `path` is kept unless `overwrite`; it is replaced only after the new
    content is complete, so a crash never leaves a half-written output directory.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FledgeError(f"{path}: already exists (pass --overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def append_jsonl(f, record: dict) -> None:
    """Append one record as a single write + flush + fsync: a kill loses at most this line,
    and readers (`read_jsonl`) skip a torn final line instead of failing."""
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike, on_bad=None):
    """Yield (line_number, record). A malformed line is passed to `on_bad(lineno, err)` and
    skipped; with no handler it raises a FledgeError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                if on_bad is None:
                    raise FledgeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                on_bad(lineno, e)


def cache_dir() -> Path:
    """Where fetched packages and converted models live ($FLEDGE_CACHE, else ~/.cache/fledge)."""
    return Path(os.environ.get("FLEDGE_CACHE", Path.home() / ".cache" / "fledge"))


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> None:
    """Write a matplotlib figure as PNG atomically, then close it (figures hold memory)."""
    import io

    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
