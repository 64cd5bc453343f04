"""Feature shards on disk: meta.json (what the features are), shard_NNNNN.safetensors (aux,
hidden and lengths of `shard_size` samples each) and manifest.json (each finished shard's
size and sha256).

A shard is written under a temporary name and renamed, then entered in the manifest, which is
rewritten the same way. A run killed at any point leaves every shard either in the manifest
and whole, or out of it (a finished file not yet listed is written again on resume), so a
rerun loses, duplicates and tears nothing. Readers trust only what the manifest lists and
check each file against it before training starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_bytes, atomic_write_json, sha256_file


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.safetensors"


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`, or one line saying what is wrong with the file."""
    try:
        obj = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise FledgeError(f"{path}: {what} is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FledgeError(f"{path}: {what} must be a JSON object, not a {type(obj).__name__}")
    return obj


class ShardWriter:
    """Shards of one feature directory, for a run that writes them (first or resumed)."""

    def __init__(self, root, meta: dict):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            old = read_json_object(meta_path, "meta.json")
            if old != meta:
                diff = sorted(k for k in meta.keys() | old.keys() if old.get(k) != meta.get(k))
                raise FledgeError(f"{self.root}: holds features of another run ({', '.join(diff)} differ); use a new --out")
        else:
            atomic_write_json(meta_path, meta)
        self.manifest = self._resumable_manifest()

    def _resumable_manifest(self) -> dict:
        """The manifest's entries whose files are still there and whole; a listed file that is
        gone or changed is dropped, so it is written again."""
        path = self.root / "manifest.json"
        listed = read_json_object(path, "manifest.json").get("shards", {}) if path.exists() else {}
        return {name: e for name, e in listed.items()
                if (self.root / name).is_file() and (self.root / name).stat().st_size == e.get("bytes")
                and sha256_file(self.root / name) == e.get("sha256")}

    def done(self, i: int) -> bool:
        return shard_name(i) in self.manifest

    def write(self, i: int, data: bytes, samples: int) -> None:
        name = shard_name(i)
        atomic_write_bytes(self.root / name, data)
        self.manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "samples": samples}
        atomic_write_json(self.root / "manifest.json", {"shards": dict(sorted(self.manifest.items()))})

    def bytes_on_disk(self) -> int:
        return sum(e["bytes"] for e in self.manifest.values())


def verify_shards(root: Path, n_shards: int, shard_size: int, lengths: list[int] | None) -> None:
    """Refuse, in one line, a directory whose shards are not all listed, whole and matching:
    a shard missing, torn (size or sha256 off), unreadable, or whose lengths disagree with the
    samples (`lengths`: each sample's token count, None to skip that check)."""
    path = root / "manifest.json"
    if not path.exists():
        raise FledgeError(f"{root}: no manifest.json; the features are unfinished (rerun `fledge features`)")
    listed = read_json_object(path, "manifest.json").get("shards")
    if not isinstance(listed, dict):
        raise FledgeError(f"{path}: no 'shards' object")
    missing = [shard_name(i) for i in range(n_shards) if shard_name(i) not in listed]
    if missing:
        raise FledgeError(f"{root}: {len(missing)} of {n_shards} shards not finished ({missing[0]} first); "
                          "rerun `fledge features` to finish")
    for i in range(n_shards):
        name = shard_name(i)
        f, entry = root / name, listed[name]
        if not f.is_file():
            raise FledgeError(f"{f}: listed in manifest.json but missing; rerun `fledge features`")
        if f.stat().st_size != entry.get("bytes") or sha256_file(f) != entry.get("sha256"):
            raise FledgeError(f"{f}: torn or changed (size or sha256 differ from manifest.json); "
                              "delete it and rerun `fledge features`")
        if lengths is not None:
            want = lengths[i * shard_size:(i + 1) * shard_size]
            got = shard_lengths(f)
            if got != want:
                raise FledgeError(f"{f}: sample lengths {got[:4]}... disagree with the data's {want[:4]}... "
                                  "(features of other samples or another --max-len)")


def shard_lengths(f: Path) -> list[int]:
    try:
        with safe_open(str(f), "pt") as s:
            return s.get_tensor("lengths").tolist()
    except (SafetensorError, OSError, KeyError) as e:
        raise FledgeError(f"{f}: not a readable feature shard ({e})") from None
