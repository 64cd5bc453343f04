"""Files that are never left half-written: atomic writes of files and directories, appending to a
resumable JSONL output, one writer per output (`output_lock`), the checks that keep an output
from destroying an input, and the cache."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import gzip
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from fledge.core.errors import FledgeError


@contextlib.contextmanager
def naming(path: str | os.PathLike, force: bool = False):
    """Give an OSError raised in the block `path` as its file name when it carries none (a
    full disk fails in write/flush/fsync, which name no file), so the CLI's one line says
    which output could not be written. `force`: also replace the name it carries (a temp
    file's name means nothing to the user)."""
    try:
        yield
    except OSError as e:
        if (e.filename is not None and not force) or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror or os.strerror(e.errno), str(path)) from None


@contextlib.contextmanager
def keeping(path: str | os.PathLike, kept: str, own_name: bool = False):
    """Re-raise an OSError from the block naming `path` (the output the user knows, not a
    temporary file) and saying what is `kept`. `own_name`: keep a file name the error carries
    (one inside the output, already given as the user knows it)."""
    try:
        yield
    except OSError as e:
        name = e.filename if own_name and e.filename is not None else str(path)
        said = "; " in (e.strerror or "")  # an inner `keeping` already said what is kept, more closely
        raise OSError(e.errno, e.strerror if said else f"{e.strerror or e}; {kept}", name) from None


def _lock_holder(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def output_lock(path: str | os.PathLike):
    """Hold the one-writer lock of the output `path` for the block; a second writer is refused.

    The lock is `.NAME.writer.lock` beside `path`, holding the writer's pid, under an advisory
    `flock`: the kernel drops it when its holder dies (kill -9 included), so a dead run's
    lock is taken over, never trusted by the pid it names. A lock this process already
    holds is entered again (a command locks its output, then `atomic_dir` does too). Taking
    it clears what a killed writer left half-written (`clear_dead_temps`)."""
    path = Path(path)
    lock = path.parent / f".{path.name}.writer.lock"
    with naming(path.parent, force=True):
        fd = _take_lock(path, lock)
    if fd is None:  # this process holds it already
        yield path
        return
    try:
        clear_dead_temps(path)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # before the unlock: a waiter that opened the old file sees it gone and retries
        os.close(fd)


def clear_dead_temps(path: Path) -> None:
    """Remove the temporary files and folders a killed writer of `path` left: `.NAME.*.tmp`
    beside it and, for a folder, `.*.tmp` inside it (`atomic_write_bytes`, `atomic_dir`). Only
    the holder of `path`'s `output_lock` may call it: no live writer owns them then."""
    inside = list(path.glob(".*.tmp")) if path.is_dir() else []
    for tmp in [*path.parent.glob(f".{glob.escape(path.name)}.*.tmp"), *inside]:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _take_lock(path: Path, lock: Path) -> int | None:
    """The fd holding `lock` with our pid in it; None if this process holds it already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            if holder == os.getpid():
                return None
            raise FledgeError(f"{path}: another fledge run (pid {holder}) is writing it; wait for it to end "
                              f"or stop it (its lock: {lock})") from None
        with contextlib.suppress(FileNotFoundError):  # still the file at that name, not one a releaser unlinked
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
        os.close(fd)


def write_file(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` and fsync it (a plain write, for files inside an `atomic_dir`)."""
    with naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Iterable[bytes]) -> None:
    """Write to a temporary sibling, fsync, then rename: readers see old or new, never half.
    `data` may come in chunks; an error while they are made leaves `path` as it was."""
    path = Path(path)
    with naming(path.parent, force=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming(path), os.fdopen(fd, "wb") as f:
            for chunk in [data] if isinstance(data, bytes) else data:
                f.write(chunk)
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
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _old_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def settle_dir(path: str | os.PathLike) -> Path:
    """Finish an `atomic_dir` swap that a kill interrupted, and return `path`.

    The swap is two renames (path → .path.old, new → path). Killed between them, only
    `.path.old` is left: it is the last complete content, so it becomes `path` again. Killed
    after both, `.path.old` is a stale copy and goes. Only the process that owns `path` may
    call it (`atomic_dir` before writing, `fledge train` before resuming its checkpoint): run
    by a reader, it could race a writer between its renames.
    """
    path = Path(path)
    old = _old_dir(path)
    if old.is_dir():
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, path)
    return path


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory that becomes `path` only if the block succeeds.

    An existing `path` is kept unless `overwrite`; it is replaced only after the new
    content is complete, so a crash never leaves a half-written output directory, and a
    kill between the swap's two renames is undone by the next `settle_dir`, and temporary
    dirs of writers killed mid-write are removed (one writer per `path`: its `output_lock`
    clears them).
    An OSError without a file name (a full disk) is given `path`'s.
    """
    with output_lock(path):
        yield from _atomic_dir(Path(path), overwrite)


def _atomic_dir(path: Path, overwrite: bool):
    path = settle_dir(path)
    if path.exists() and not overwrite:
        raise FledgeError(f"{path}: already exists (pass --overwrite to replace it)")
    with naming(path.parent, force=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        try:
            with naming(path):
                yield tmp
        except OSError as e:  # name the file as the user will know it, not its temporary home
            if e.filename is None or not str(e.filename).startswith(str(tmp)) or e.errno is None:
                raise
            raise type(e)(e.errno, e.strerror, str(path) + str(e.filename)[len(str(tmp)):]) from None
        if path.exists():
            old = _old_dir(path)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_no_overlap(output: str | os.PathLike, inputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse an output path that is, contains or lies inside one of `inputs` (flag name →
    path; None is skipped): replacing the output (--overwrite) would delete or move the input.
    Paths are compared resolved, so `a/../b`, symlinks and relative spellings are caught."""
    out = Path(output).resolve()
    for flag, p in inputs.items():
        if p is None:
            continue
        src = Path(p).resolve()
        if out == src or out in src.parents or src in out.parents:
            what = "is" if out == src else "contains" if out in src.parents else "lies inside"
            raise FledgeError(f"{output}: the output {what} the input {flag} {p}; write it elsewhere")


@contextlib.contextmanager
def appending(path: str | os.PathLike, kept: str):
    """`path` open for appending records (its folder made, its `output_lock` held), for a
    resumable output. It is opened before any work, so an unwritable path fails at once; a file
    this call created and left empty is removed on the way out, so a run that kept nothing
    leaves no output behind. An OSError in the block without a file name is given `path`'s."""
    path = Path(path)
    with output_lock(path):
        with keeping(path, kept):
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.exists()
            f = open(path, "a", encoding="utf-8")
        try:
            with naming(path), f:
                yield f
        finally:
            with contextlib.suppress(OSError):
                if new and path.stat().st_size == 0:
                    path.unlink()


def append_jsonl(f, record: dict) -> None:
    """Append one record to `f` (from `appending`) as a single write + fsync: a kill loses at
    most this line, and readers (`read_jsonl`) skip a torn final line instead of failing. A
    write that fails (a full disk) is cut back off the file: no torn line is left behind."""
    data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode())
    fd = f.fileno()  # past f's buffer, which would retry a failed write when f closes
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def check_jsonl_output(path: str | os.PathLike, what: str) -> None:
    """Refuse an existing `path` that is not a JSONL output of `what` before the command
    touches it (cuts a torn tail, appends): every complete line a JSON object, and anything
    after the last newline the start of one (a write cut by a kill). A file the command did
    not write is never truncated or appended to."""
    path = Path(path)
    if not path.is_file():
        return
    refuse = f"{path}: not a {what} output (%s); give a new output file"
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                if not line.lstrip().startswith(b"{"):
                    raise FledgeError(refuse % f"line {lineno} is not JSON")
                break
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except (ValueError, RecursionError):
                ok = False
            if not ok:
                raise FledgeError(refuse % f"line {lineno} is not a JSON object")


def read_jsonl(path: str | os.PathLike, on_bad=None):
    """Yield (line_number, record) of a JSONL file, plain or .gz. A malformed line is passed to
    `on_bad(lineno, err)` and skipped; with no handler it raises a FledgeError naming the file
    and line."""
    with (gzip.open if Path(path).suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                if on_bad is None:
                    raise FledgeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                on_bad(lineno, e)


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_dir() -> Path:
    """Where fetched packages and converted models live ($FLEDGE_CACHE, else ~/.cache/fledge)."""
    return Path(os.environ.get("FLEDGE_CACHE", Path.home() / ".cache" / "fledge"))


