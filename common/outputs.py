"""Writing results: files that appear whole or not at all, JSON, figures, markdown tables. Every tool writes
through these, so a crash or a full disk never leaves a half-written result behind."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call write(file_object) on a temporary file beside path, fsync it, then rename it over path.

    A crash at any moment leaves either the old file or the new one, never a partial file.
    """
    path = Path(path)
    tmp = path.with_name(f".tmp.{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def own_folder_problem(out: Path, marker: str, tool: str, default: str) -> str:
    """Why a tool that empties and remakes what it writes inside `out` may not write there ("" when it may): out
    must be new, empty, or the tool's own from an earlier run (its marker file, which claim_own_folder leaves)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return f"--out={out} is a file: give --out a folder"
    if out.is_dir() and any(out.iterdir()) and not (out / marker).exists():
        return (f"--out={out} holds files {tool} did not write, and {tool} removes and remakes what it writes "
                f"inside --out: give --out a new or empty folder (default {default})")
    return ""


def claim_own_folder(out: Path, marker: str) -> None:
    """Make out (checked by own_folder_problem) and mark it as the tool's own."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / marker).touch()


def write_json(obj, path) -> None:
    """obj as indented JSON (and a final newline), atomically."""
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def save_figure(fig, path, dpi: int = 120):
    """A matplotlib figure as a PNG, atomically (its folder made if needed), then closed; returns the path."""
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    plt.close(fig)
    return path


def markdown_table(header: list, rows: list[list], right: set[int] = frozenset(), aligned: bool = False) -> str:
    """A markdown table: the header, its separator, one line per row. Unescaped | in cells are escaped.
    aligned: columns padded to their widest cell, the columns in `right` right-aligned (run comparisons'
    tables, read as text too); else compact (the README's)."""
    cells = [[re.sub(r"(?<!\\)\|", r"\\|", str(cell)) for cell in row] for row in [header, *rows]]
    widths = [max(3, *(len(row[i]) for row in cells)) if aligned else 0 for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                       for i, (c, w) in enumerate(zip(row, widths))) + " |")
        if n == 0:
            lines.append("|" + "|".join(("-" * (w + 1) + ":" if i in right else ":" + "-" * (w + 1)) if aligned
                                        else "---" for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)
