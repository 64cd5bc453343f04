"""Results for people: aligned tables on stdout, PNG figures written atomically (matplotlib,
headless), and a running clock for long steps that report nothing themselves."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from fledge.core.files import atomic_write_bytes


def print_table(rows: list[list]) -> None:
    """Rows as aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths))))


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


@contextmanager
def ticking(desc: str, every_s: float = 1.0) -> Iterator[None]:
    """A line on stderr naming the step and its elapsed time, redrawn every `every_s` seconds,
    around a call that gives no progress of its own (a library parsing a large file)."""
    bar = tqdm(desc=desc, bar_format="{desc}: {elapsed}", mininterval=0)
    stop = threading.Event()

    def tick():
        while not stop.wait(every_s):
            bar.refresh()

    clock = threading.Thread(target=tick, daemon=True)
    clock.start()
    try:
        yield
    finally:
        stop.set()
        clock.join()
        bar.close()
