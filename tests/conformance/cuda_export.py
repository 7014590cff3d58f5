"""The manifest's ONNX node cases, written out for the CUDA backend's conformance test.

The engine's Rust test `backend::cuda::tests::node_cases` runs every case on the CUDA executor
(on a GPU, or on cuda-emu without one) and compares its outputs with onnx's expected outputs,
as tests/conformance/runner.py does for the CPU. This writes what it reads, one folder per
(case, data set) of tests/conformance/manifest.txt that runs as a plain forward-only model:

    DIR/cases.txt                 one folder name per line
    DIR/<case>.<k>/model.onnx     the case's model; where the CPU run needed it, with its integer
                                  and scalar inputs as initializers (runner.run_case's rewrite)
    DIR/<case>.<k>/input_<j>.pb   the inputs it is fed (TensorProto)
    DIR/<case>.<k>/output_<j>.pb  onnx's expected outputs

The adapter cases (Adam, Momentum, Gradient: the engine's optimizer and autodiff, not a forward
model) are left out. Each case is run once on the CPU here to decide the rewrite, so a written
case is one the CPU passes.

    python -m tests.conformance.cuda_export DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from onnx import numpy_helper

from . import runner


def _needs_constants(model_bytes: bytes, ins: list) -> bool:
    try:
        runner.run_model(model_bytes, ins)
    except Exception as e:  # the engine's error: only the plan-time shape one asks for the rewrite
        if "before the step" in str(e):
            return True
        raise
    return False


def write(out: Path) -> list[str]:
    """Writes the cases into `out` (emptied first); returns the folder names."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    d = runner.data_dir()
    names = []
    for name in runner.read_manifest():
        if name in runner.ADAPTERS or name in runner.SYNTHETIC:
            continue
        case = runner.load_case(name, d)
        for k, (ins, outs) in enumerate(case.data_sets):
            model = case.model
            if _needs_constants(model.SerializeToString(), ins):
                model, ins, _ = runner._int_inputs_as_constants(case.model, ins)
            folder = out / f"{name}.{k}"
            folder.mkdir()
            (folder / "model.onnx").write_bytes(model.SerializeToString())
            for kind, values in (("input", ins), ("output", outs)):
                for j, v in enumerate(values):
                    (folder / f"{kind}_{j}.pb").write_bytes(numpy_helper.from_array(np.asarray(v)).SerializeToString())
            names.append(folder.name)
    (out / "cases.txt").write_text("\n".join(names) + "\n")
    return names


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    names = write(Path(args[0]))
    print(f"{len(names)} node cases (case.data set) written to {args[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
