"""A checkpoint directory as an engine finds it, read without torch and without raising.

`open_checkpoint` reads config.json and every weight file's header, in the engines' lookup
order (the sharded index if present, else every *.safetensors, else pytorch_model*.bin), and
says in words what is missing or broken, each problem starting with the file it is about.
`fledge doctor` reports the problems, `fledge import`/`export` (fledge.checkpoint) and
`fledge vocab` refuse the first one. Tensors are read as numpy (`Weights.read`); only a
pytorch_model.bin, a pickle of torch tensors, needs torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tqdm import tqdm

INDEX = "model.safetensors.index.json"
_CHUNK = 1 << 22  # elements per fp32 chunk: a 163840x7168 embedding never sits in fp32 whole
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def read_safetensor(path: Path, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
    """Tensor `name` of a safetensors file (rows start:stop of it) as numpy, bfloat16 widened
    exactly to float32: a bfloat16 is the upper half of a float32's bits. safetensors' numpy
    reader refuses bfloat16, so those bits are read where the file's header says they lie (the
    format: an 8-byte little-endian header length, the JSON header, then the data)."""
    with safe_open(path, "np") as f:
        view = f.get_slice(name)
        shape = tuple(view.get_shape())
        whole = start is None and stop is None or not shape
        a, b, _ = (0, 1, 1) if not shape else slice(start, stop).indices(shape[0])  # clamped, as Python's
        b = max(a, b)
        if view.get_dtype() != "BF16":
            return f.get_tensor(name) if whole else view[a:b]
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        begin = 8 + n + json.loads(fh.read(n))[name]["data_offsets"][0]
    row = math.prod(shape[1:])
    bits = np.fromfile(path, dtype="<u2", count=(b - a) * row, offset=begin + 2 * a * row)
    return (bits.astype("<u4") << 16).view("<f4").reshape((b - a, *shape[1:]) if shape else ())


@dataclass
class Stats:
    ndim: int
    nonfinite: int
    lo: float  # finite min and max
    hi: float


@dataclass
class Weights:
    """Where each tensor lives, with its shape and dtype, read from file headers only."""

    files: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    bin_tensors: dict = field(default_factory=dict)  # pytorch_model.bin's torch tensors, mmapped

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """The tensor (or rows start:stop of it) as numpy, in its stored dtype; bfloat16, which
        numpy lacks, widened exactly to float32."""
        if name in self.bin_tensors:
            t = self.bin_tensors[name]
            t = t if start is None or not self.shapes[name] else t[start:stop]
            return (t.float() if self.dtypes[name] == "bfloat16" else t).numpy()
        return read_safetensor(self.files[name], name, start, stop)

    def chunks(self, name: str):
        """The tensor in fp32, a chunk of rows at a time."""
        shape = self.shapes[name]
        if not shape:
            yield self.read(name).astype(np.float32)
            return
        step = max(1, _CHUNK // max(1, math.prod(shape[1:])))
        for a in range(0, shape[0], step):
            yield self.read(name, a, a + step).astype(np.float32, copy=False)

    def scan(self) -> dict[str, Stats]:
        """Non-finite count and finite min/max of every float tensor, in fp32."""
        names = [k for k in sorted(self.files) if is_float(self.dtypes[k])]
        out = {}
        with tqdm(total=sum(math.prod(self.shapes[k]) for k in names), unit="el", unit_scale=True,
                  desc="doctor: weights", leave=False) as bar:
            for k in names:
                bad, lo, hi = 0, math.inf, -math.inf
                for x in self.chunks(k):
                    x = x.ravel()
                    fin = np.isfinite(x)
                    n_bad = x.size - int(fin.sum())
                    bad, x = bad + n_bad, x[fin] if n_bad else x
                    if x.size:
                        lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
                    bar.update(fin.size)
                out[k] = Stats(len(self.shapes[k]), bad, lo, hi)
        return out

    def torch_tensors(self) -> dict:
        """Every tensor as torch, in its stored dtype (this one loads torch)."""
        from safetensors.torch import load_file

        out = {k: t for k, t in self.bin_tensors.items() if k in self.files}
        for f in sorted({f for k, f in self.files.items() if k not in out}):
            out.update((k, t) for k, t in load_file(f).items() if self.files.get(k) == f)
        return out


def scan_files(files: list[Path], w: Weights | None = None) -> tuple[Weights, list[str]]:
    """Every tensor's file, shape and dtype, and the problems: files that cannot be read,
    tensors in two files."""
    w, problems = w or Weights(), []
    for path in files:
        try:
            if path.suffix == ".bin":
                import torch  # a pickle of torch tensors: only torch reads it

                tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                items = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in tensors.items()]
                w.bin_tensors.update(tensors)
            else:
                with safe_open(path, "np") as f:
                    items = [(k, tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()]
                items = [(k, shape, _ST_DTYPES.get(dt, dt.lower())) for k, shape, dt in items]
        except Exception as e:  # a truncated or foreign file: any error is the finding
            why = (str(e).splitlines() or [""])[0][:120]
            problems.append(f"{path.name}: not a readable weights file ({type(e).__name__}: {why})")
            continue
        dup = [k for k, _, _ in items if k in w.files]
        if dup:
            problems.append(f"{path.name}: {dup[0]} appears twice ({w.files[dup[0]].name} too)"
                            + (f", and {len(dup) - 1} more tensors" if len(dup) > 1 else ""))
        for k, shape, dtype in items:
            w.files[k], w.shapes[k], w.dtypes[k] = path, shape, dtype
    return w, problems


def _shard_problem(d: Path, name) -> str | None:
    """An index must not make fledge read, or an engine load, a file outside the directory."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return f"{INDEX}: shard {name!r} is not a file name inside the checkpoint"
    if not (d / name).resolve().is_relative_to(d.resolve()):
        return f"{INDEX}: shard {name!r} leads outside the checkpoint"
    return None


def _weight_files(d: Path) -> tuple[list[Path], dict | None, list[str], list[str]]:
    """(files to read, the index's weight_map, FAIL problems, WARN problems)."""
    index = d / INDEX
    shards = sorted(d.glob("*.safetensors"))
    if not index.exists():
        files = shards or sorted(d.glob("pytorch_model*.bin"))
        return files, None, [] if files else ["model.safetensors: missing (nor any *.safetensors or .bin)"], []
    try:
        wmap = json.loads(index.read_text())["weight_map"]
        names = sorted(set(wmap.values()), key=str)
    except Exception as e:
        return [], None, [f"{INDEX}: not a safetensors index ({type(e).__name__})"], []
    fails = [p for n in names if (p := _shard_problem(d, n))]
    if fails:
        return [], None, fails, []
    named = [d / n for n in names]
    fails = [f"{INDEX}: names {p.name}, which is missing" for p in named if not p.exists()]
    warns = [f"{p.name}: not in {INDEX}, so engines skip it" for p in shards if p not in named]
    return [p for p in named if p.exists()], wmap, fails, warns


def _apply_index(wmap: dict, w: Weights) -> tuple[list[str], list[str]]:
    """Drop tensors the index does not list (engines never see them) and report both ways."""
    bad = [k for k, f in wmap.items() if k not in w.files or w.files[k].name != f]
    extra = [k for k in w.files if k not in wmap]
    for k in extra:
        del w.files[k]
    fails = [f"{INDEX}: lists {len(bad)} tensors not in the named shard (e.g. {bad[0]})"] if bad else []
    warns = ([f"{INDEX}: {len(extra)} tensors in shards are not in it, so never loaded (e.g. {extra[0]})"]
             if extra else [])
    return fails, warns


def read_config(d: Path) -> tuple[dict | None, str | None]:
    """config.json as a dict, or (None, the problem)."""
    try:
        cfg = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        return None, "config.json: missing"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"config.json: not valid JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e})"
    except OSError as e:
        return None, f"config.json: unreadable ({e.strerror or e})"
    if not isinstance(cfg, dict):
        return None, f"config.json: a JSON {type(cfg).__name__}, not an object of config fields"
    return cfg, None


@dataclass
class Checkpoint:
    path: Path
    config: dict | None
    weights: Weights | None  # None unless every weight file could be read
    files: list[Path]
    fails: list[str]  # what no engine would load (a config problem first)
    warns: list[str]  # what engines load, but not all of


def open_checkpoint(path) -> Checkpoint:
    d = Path(path)
    config, cfg_problem = read_config(d)
    files, wmap, fails, warns = _weight_files(d)
    w, problems = scan_files(files)
    fails += problems
    if wmap is not None and not fails:
        more_fails, more_warns = _apply_index(wmap, w)
        fails, warns = fails + more_fails, warns + more_warns
    return Checkpoint(d, config, None if fails else w, files, ([cfg_problem] if cfg_problem else []) + fails, warns)
