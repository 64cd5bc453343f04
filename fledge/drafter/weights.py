"""A checkpoint directory as an engine finds it, read without torch and without raising.

`open_checkpoint` reads config.json and every weight file's header, in the engines' lookup
order (the sharded index if present, else every *.safetensors, else pytorch_model*.bin), and
says in words what is missing or broken, each problem starting with the file it is about:
`fledge doctor` reports them all, the commands that load a checkpoint refuse the first.
Tensors are read as numpy; only a pytorch_model.bin, a pickle of torch tensors, needs torch.
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
            t = t[start:stop] if self.shapes[name] else t
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


def scan_files(files: list[Path]) -> tuple[Weights, list[str]]:
    """Every tensor's file, shape and dtype, and the problems: files that cannot be read,
    tensors in two files."""
    w, problems = Weights(), []
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


def _find_files(ck: Checkpoint) -> dict | None:
    """Set the files an engine would read, note what is wrong with them, and return the
    index's weight_map (None without a usable index)."""
    d, index = ck.path, ck.path / INDEX
    shards = sorted(d.glob("*.safetensors"))
    if not index.exists():
        ck.files = shards or sorted(d.glob("pytorch_model*.bin"))
        if not ck.files:
            ck.fails.append("model.safetensors: missing (nor any *.safetensors or .bin)")
        return None
    try:
        wmap = json.loads(index.read_text())["weight_map"]
        names = sorted(set(wmap.values()), key=str)
    except Exception as e:
        ck.fails.append(f"{INDEX}: not a safetensors index ({type(e).__name__})")
        return None
    ck.fails += [p for n in names if (p := _shard_problem(d, n))]
    if ck.fails:
        return None
    named = [d / n for n in names]
    ck.files = [p for p in named if p.exists()]
    ck.fails += [f"{INDEX}: names {p.name}, which is missing" for p in named if not p.exists()]
    ck.warns += [f"{p.name}: not in {INDEX}, so engines skip it" for p in shards if p not in named]
    return wmap


def _apply_index(ck: Checkpoint, wmap: dict, w: Weights) -> None:
    """Drop tensors the index does not list (engines never see them) and report both ways."""
    bad = [k for k, f in wmap.items() if k not in w.files or w.files[k].name != f]
    extra = [k for k in w.files if k not in wmap]
    for k in extra:
        del w.files[k]
    if bad:
        ck.fails.append(f"{INDEX}: lists {len(bad)} tensors not in the named shard (e.g. {bad[0]})")
    if extra:
        ck.warns.append(f"{INDEX}: {len(extra)} tensors in shards are not in it, so never loaded (e.g. {extra[0]})")


def model_config(path) -> dict:
    """A model's config.json (of directory `path`, or that file), the decoder's fields: a
    multimodal config nests them in text_config."""
    p = Path(path)
    cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    return cfg.get("text_config") or cfg


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
    weights: Weights | None = None  # None unless every weight file could be read
    files: list[Path] = field(default_factory=list)
    fails: list[str] = field(default_factory=list)  # what no engine would load (a config problem first)
    warns: list[str] = field(default_factory=list)  # what engines load, but not all of

    def unreadable(self) -> list[str]:
        """What stops the checkpoint loading at all, each line naming its file (a config problem
        first); [] when its config and every weight file read."""
        return [f"{self.path}/{p}" for p in self.fails]


def open_checkpoint(path) -> Checkpoint:
    d = Path(path)
    config, problem = read_config(d)
    ck = Checkpoint(d, config)
    wmap = _find_files(ck)
    w, unreadable = scan_files(ck.files)
    ck.fails += unreadable
    if wmap is not None and not ck.fails:
        _apply_index(ck, wmap, w)
    ck.weights = None if ck.fails else w
    ck.fails[:0] = [problem] if problem else []
    return ck
