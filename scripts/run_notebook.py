"""Runs notebooks/tutorial_transformer.ipynb headless (nbclient, a real IPython kernel), prints
what the user would see (the comparison table included) and writes the executed notebook to
out/tutorial_transformer.ipynb. Metrics go to ORTRAIN_TRACKING_URI, or by default to the embedded
local MLflow server with its sqlite store in the working directory (./mlflow.db)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    steps = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ORTRAIN_TUTORIAL_STEPS", "100")
    os.environ["ORTRAIN_TUTORIAL_STEPS"] = steps
    nb = nbformat.read(ROOT / "notebooks" / "tutorial_transformer.ipynb", as_version=4)
    print(f"[demo] running notebooks/tutorial_transformer.ipynb headless, {steps} steps per run", flush=True)
    NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            if text and "image/png" not in out.get("data", {}):
                print(text.rstrip())
    (ROOT / "out").mkdir(exist_ok=True)
    nbformat.write(nb, ROOT / "out" / "tutorial_transformer.ipynb")
    print("[demo] executed notebook: out/tutorial_transformer.ipynb; MLflow store: ./mlflow.db (open the UI address printed above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
