"""Generates the Databricks source notebook from notebooks/tutorial_transformer.ipynb, and parses
one back (used by the tests to prove the round trip). Run from the repository root:

    python databricks/make_notebook.py            # writes databricks/tutorial_transformer.py
    python databricks/make_notebook.py --check    # exits 1 if the committed file is stale

Format: the first line `# Databricks notebook source`, cells separated by `# COMMAND ----------`;
markdown cells and cells that start with a magic are written as `# MAGIC` lines."""
from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = "# Databricks notebook source"
SEP = "# COMMAND ----------"
ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "notebooks" / "tutorial_transformer.ipynb"
TARGET = ROOT / "databricks" / "tutorial_transformer.py"


def _magic(lines: list) -> str:
    return "\n".join(("# MAGIC " + ln) if ln else "# MAGIC" for ln in lines)


def cells_of(ipynb: Path) -> list:
    """[(cell_type, source)] of a .ipynb."""
    nb = json.loads(ipynb.read_text())
    return [(c["cell_type"], "".join(c["source"]).strip("\n")) for c in nb["cells"]]


def to_databricks(cells: list) -> str:
    out = []
    for kind, src in cells:
        lines = src.split("\n")
        if kind == "markdown":
            out.append(_magic(["%md"] + lines))
        elif src.lstrip().startswith("%"):
            # a cell magic owns the whole cell; a line magic alone in a cell is written the same way
            out.append(_magic(lines))
        else:
            out.append(src)
    return HEADER + "\n" + ("\n\n" + SEP + "\n\n").join(out) + "\n"


def from_databricks(text: str) -> list:
    """Parses a Databricks source notebook back into [(cell_type, source)]."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != HEADER:
        raise ValueError(f"not a Databricks source notebook: the first line is not {HEADER!r}")
    cells = []
    for chunk in "\n".join(lines[1:]).split("\n" + SEP + "\n"):
        chunk = chunk.strip("\n")
        body = chunk.split("\n")
        if body and all(ln == "# MAGIC" or ln.startswith("# MAGIC ") for ln in body):
            body = [ln[len("# MAGIC "):] if ln != "# MAGIC" else "" for ln in body]
            if body[0].strip() == "%md":
                cells.append(("markdown", "\n".join(body[1:]).strip("\n")))
                continue
            cells.append(("code", "\n".join(body)))
        else:
            cells.append(("code", chunk))
    return cells


def main(argv: list) -> int:
    text = to_databricks(cells_of(SOURCE))
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is stale: run python databricks/make_notebook.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
