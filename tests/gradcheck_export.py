"""The cases of tests/test_gradcheck.py (one tiny float64 model per gradient rule, each with its
own attributes and broadcasting), written out for the CUDA backend's test
`backend::cuda::tests::grad_cases`, which runs each as one training step on the CPU executor and
on the CUDA executor (on a GPU, or on cuda-emu without one) and compares outputs and weight
gradients. test_gradcheck.py checks the CPU's gradients against central differences; this puts
the CUDA executor's next to them.

    DIR/cases.txt                 one case id per line
    DIR/<id>/model.onnx           the case's model (its weights are initializers, as drawn there)
    DIR/<id>/meta.txt             `weight NAME` per trainable weight, in order; `outputs N`
    DIR/<id>/weight_<j>.pb        weight j's values (TensorProto, float64)
    DIR/<id>/seed_<k>.pb          the backward seed of output k (float64 outputs only)
    DIR/<id>@f32/ (@f16, @bf16)   the same case in float32, float16 and bfloat16 (every float64
                                  weight, seed, constant and Cast target converted)

    python tests/gradcheck_export.py DIR
"""

from __future__ import annotations

import os
import shutil
import sys
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["ORTRAIN_DISABLE_PASSES"] = "all"  # each op's own rule, as test_gradcheck runs it

import test_gradcheck as gc  # noqa: E402


# the variants written beside each float64 case: (tag, numpy type, onnx type)
TYPES = (
    ("f32", np.float32, onnx.TensorProto.FLOAT),
    ("f16", np.float16, onnx.TensorProto.FLOAT16),
    ("bf16", ml_dtypes.bfloat16, onnx.TensorProto.BFLOAT16),
)


def _as_type(onnx_bytes: bytes, np_type, onnx_type: int) -> bytes:
    """The model with its float64 initializers and Cast targets in another float type."""
    m = onnx.ModelProto()
    m.ParseFromString(onnx_bytes)
    for i, t in enumerate(m.graph.initializer):
        if t.data_type == onnx.TensorProto.DOUBLE:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_type), t.name))
    for node in m.graph.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == onnx.TensorProto.DOUBLE:
                a.i = onnx_type
        if node.op_type == "DropoutAdd" and onnx_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            # what passes/fuse_dropout_add.rs writes for a 16-bit dropped tensor
            node.attribute.append(onnx.helper.make_attribute("dropped_type", onnx_type))
    return m.SerializeToString()


def _write_case(d: Path, onnx_bytes: bytes, wnames: list, n_out: int, weights: list, seeds: list) -> None:
    d.mkdir()
    (d / "model.onnx").write_bytes(onnx_bytes)
    (d / "meta.txt").write_text("".join(f"weight {n}\n" for n in wnames) + f"outputs {n_out}\n")
    for j, w in enumerate(weights):
        (d / f"weight_{j}.pb").write_bytes(numpy_helper.from_array(w).SerializeToString())
    for k, sd in enumerate(seeds):
        if sd is not None:
            (d / f"seed_{k}.pb").write_bytes(numpy_helper.from_array(np.asarray(sd)).SerializeToString())


def write(out: Path) -> list[str]:
    """Writes every case into `out` (emptied first); returns the case ids."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ids = []
    for case in gc.CASES:
        # the same draws as test_gradcheck: weights, then the seeds
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        weights = [spec.draw(rng) for spec in case.inputs if isinstance(spec, gc.W)]
        onnx_bytes, wnames = gc._model(case, weights)
        s = gc._ortrain.Session(onnx_bytes, wnames, [True] * len(wnames))
        p = s.forward([], [w.ctypes.data for w in weights], False, 1234)
        try:
            outs = gc._outputs(p, case.n_out)
        finally:
            p.release()
        seeds = [rng.standard_normal(o.shape) if o.dtype == np.float64 else None for o in outs]
        _write_case(out / case.id, onnx_bytes, wnames, case.n_out, weights, seeds)
        ids.append(case.id)
        for tag, np_type, onnx_type in TYPES:
            typed = [None if x is None else x.astype(np_type) for x in seeds]
            model = _as_type(onnx_bytes, np_type, onnx_type)
            _write_case(out / f"{case.id}@{tag}", model, wnames, case.n_out, [w.astype(np_type) for w in weights], typed)
            ids.append(f"{case.id}@{tag}")
    (out / "cases.txt").write_text("\n".join(ids) + "\n")
    return ids


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    ids = write(Path(args[0]))
    print(f"{len(ids)} gradient-check cases written to {args[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
