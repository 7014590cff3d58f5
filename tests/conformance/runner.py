"""ONNX conformance through the onnx package's own node tests.

Each case is a directory ``test_*/`` holding ``model.onnx`` and ``test_data_set_*/input_*.pb`` /
``output_*.pb`` (onnx's layout). They come from ``onnx/backend/test/data/node`` when the installed
onnx ships them; onnx wheels that do not are served from a cache written once by onnx's own case
generators (``onnx.backend.test.case.node.collect_testcases``), in the same layout.

A case runs through the engine as a forward-only Session with no bound weights (initializers
become constants); outputs are compared as onnx's backend tests do: rtol 1e-3 / atol 1e-7 for
floats, exact for integers and bools, same dtype and shape.

The training cases the engine cannot import as-is (ai.onnx.preview.training ops) run through
adapters that check the same numbers through the engine's own optimizer and autodiff:
Adam -> ``_ortrain.adam_step``, Momentum -> ``_ortrain.sgd_step``, Gradient -> a Session with
trainable weights and a backward pass.

    python -m tests.conformance.runner --all                  # every case of the claimed ops
    python -m tests.conformance.runner --all --write-manifest # ... and rewrite manifest.txt
    python -m tests.conformance.runner test_add test_relu     # some cases, verbose
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.txt"
RTOL, ATOL = 1e-3, 1e-7

# numpy dtype -> the engine's element type name
DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.bool_): "bool",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int8): "int8",
    np.dtype(np.float16): "float16",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
}
# the 16-bit floats are compared in float32 (numpy has no bfloat16 arithmetic of its own)
HALF_FLOATS = {np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
NP_OF = {v: k for k, v in DTYPES.items()}

TRAINING_DOMAIN = "ai.onnx.preview.training"


# ---------------------------------------------------------------------------------------------
# the case data


def data_dir() -> Path:
    """The directory of node cases: onnx's own if shipped, else a cache generated from onnx."""
    shipped = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    if shipped.is_dir() and any(shipped.glob("test_*/model.onnx")):
        return shipped
    root = os.environ.get("ORTRAIN_ONNX_NODE_DATA")
    if root:
        cache = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        cache = base / "ortrain" / f"onnx-node-tests-{onnx.__version__}"
    if not (cache / ".complete").exists():
        _generate(cache)
    return cache


def _generate(out: Path) -> None:
    """Writes onnx's node cases in onnx's data layout (what `backend-test-tools generate-data`
    writes for node tests)."""
    import shutil
    import tempfile

    import onnx.backend.test.case.node as node_cases

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=out.parent))
    # onnx's generators overflow on purpose (Cast to float16/float8 cases); whether numpy warns
    # depends on the CPU's SIMD path (seen on an AVX2-only EPYC, not on Zen4), and pytest turns
    # warnings into errors. Collecting runs once per process: a half-done collection cannot be
    # retried (onnx refuses the names it already registered).
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = list(node_cases.collect_testcases(None))
    for case in cases:
        if case.kind != "node" or case.model is None:
            continue
        d = tmp / case.name
        d.mkdir()
        (d / "model.onnx").write_bytes(case.model.SerializeToString())
        g = case.model.graph
        for i, (inputs, outputs) in enumerate(case.data_sets or []):
            ds = d / f"test_data_set_{i}"
            ds.mkdir()
            for kind, values, infos in (("input", inputs, g.input), ("output", outputs, g.output)):
                for j, v in enumerate(values):
                    (ds / f"{kind}_{j}.pb").write_bytes(_serialize(v, infos[j]))
    (tmp / ".complete").write_text(onnx.__version__)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _serialize(v, info) -> bytes:
    t = info.type
    if t.HasField("sequence_type"):
        return numpy_helper.from_list(v, info.name).SerializeToString()
    if t.HasField("optional_type"):
        return numpy_helper.from_optional(v, info.name).SerializeToString()
    if t.HasField("map_type"):
        return numpy_helper.from_dict(v, info.name).SerializeToString()
    if isinstance(v, onnx.TensorProto):
        return v.SerializeToString()
    return numpy_helper.from_array(np.asarray(v), info.name).SerializeToString()


@dataclass
class Case:
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list, list]] = field(default_factory=list)
    non_tensor: str | None = None  # why the case's inputs/outputs are not plain tensors

    @property
    def op_types(self) -> list[str]:
        return [n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in self.model.graph.node]


def case_names(d: Path | None = None) -> list[str]:
    d = d or data_dir()
    return sorted(p.parent.name for p in d.glob("test_*/model.onnx"))


def load_case(name: str, d: Path | None = None) -> Case:
    cdir = (d or data_dir()) / name
    model = onnx.load_model(str(cdir / "model.onnx"))
    case = Case(name, model)
    g = model.graph
    for info in list(g.input) + list(g.output):
        if not info.type.HasField("tensor_type"):
            case.non_tensor = f"'{info.name}' is a {info.type.WhichOneof('value')}"
            return case
    for ds in sorted(glob.glob(str(cdir / "test_data_set_*"))):
        ins = [_read_tensor(Path(ds) / f"input_{j}.pb") for j in range(len(g.input))]
        outs = [_read_tensor(Path(ds) / f"output_{j}.pb") for j in range(len(g.output))]
        case.data_sets.append((ins, outs))
    return case


def _read_tensor(p: Path) -> np.ndarray:
    t = onnx.TensorProto()
    t.ParseFromString(p.read_bytes())
    return numpy_helper.to_array(t)


# ---------------------------------------------------------------------------------------------
# grouping: which op a case tests


def case_op(case: Case, d: Path | None = None) -> str:
    """The op type a case tests: the single node's op, or for function-expanded cases
    (`*_expanded*`) the op of the unexpanded case, else the last node's op."""
    ops = case.op_types
    if case.name.startswith("test_gradient_of_"):
        return "Gradient"
    if "_expanded" in case.name:
        base = case.name[: case.name.index("_expanded")]
        p = (d or data_dir()) / base / "model.onnx"
        if p.exists():
            m = onnx.load_model(str(p), load_external_data=False)
            if len(m.graph.node) == 1:
                n = m.graph.node[0]
                return n.op_type
    non_const = [o for o in ops if o != "Constant"]
    return (non_const or ops or ["?"])[-1].split("::")[-1]


# ---------------------------------------------------------------------------------------------
# running one case


class Unsupported(Exception):
    """The case cannot be expressed for the engine (not an engine failure)."""


def _engine():
    from ortrain import _ortrain

    return _ortrain


def claimed_ops() -> set[str]:
    """ONNX op types the engine imports and runs on CPU, plus those checked through adapters."""
    ops = {op for op, _grad, cpu, internal, _cuda in _engine().op_table() if cpu and not internal}
    return ops | {"Constant"} | set(ADAPTERS_BY_OP)


def _feed(arrs):
    feed, keep = [], []
    for a in arrs:
        a = np.require(a, requirements="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
        name = DTYPES.get(a.dtype)
        if name is None:
            raise Unsupported(f"input dtype {a.dtype} not supported by the engine")
        keep.append(a)
        feed.append((a.ctypes.data, name, list(a.shape)))
    return feed, keep


def run_model(model_bytes: bytes, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Forward-only run through the engine, no bound weights; returns the outputs."""
    o = _engine()
    s = o.Session(model_bytes, [], [])
    feed, keep = _feed(inputs)
    p = s.forward(feed, [], False, 0)
    outs = []
    try:
        for k in range(len(s.output_names)):
            _, dt, shape = p.output(k)
            arr = np.empty(shape, dtype=NP_OF[dt])
            if arr.size:
                p.copy_output(k, arr.ctypes.data)
            outs.append(arr)
    finally:
        p.release()
    del keep
    return outs


def compare(name: str, expected: np.ndarray, got: np.ndarray) -> str | None:
    """None when equal within the backend-test tolerances, else a one-line reason."""
    expected = np.asarray(expected)
    if expected.dtype != got.dtype:
        return f"{name}: dtype {got.dtype}, expected {expected.dtype}"
    if expected.shape != got.shape:
        return f"{name}: shape {list(got.shape)}, expected {list(expected.shape)}"
    if expected.dtype in HALF_FLOATS:
        expected, got = expected.astype(np.float32), got.astype(np.float32)
    if expected.dtype.kind == "f":
        bad = ~np.isclose(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True)
        if bad.any():
            diff = np.abs(got.astype(np.float64) - expected)[bad]
            return f"{name}: {int(bad.sum())}/{bad.size} differ, max |diff| {np.nanmax(diff):.3g}"
    elif not np.array_equal(got, expected):
        return f"{name}: {int((got != expected).sum())}/{expected.size} differ"
    return None


def run_case(case: Case) -> str | None:
    """Raises AssertionError (mismatch), Unsupported, or the engine's error. Returns a note on
    how the case ran (None: as-is)."""
    if case.name in ADAPTERS:
        ADAPTERS[case.name](case)
        return ADAPTERS_BY_OP_NOTE.get(ADAPTERS[case.name])
    if case.non_tensor:
        raise Unsupported(f"non-tensor value: {case.non_tensor}")
    if not case.data_sets:
        raise Unsupported("no data sets")
    note = None
    for i, (ins, outs) in enumerate(case.data_sets):
        try:
            got = run_model(case.model.SerializeToString(), ins)
        except Exception as e:
            # The engine plans shapes before the step: inputs that decide shapes (Reshape's shape,
            # Slice's starts, Reduce's axes, ...) must be known then. The node tests feed them as
            # graph inputs; run such cases again with the integer and scalar inputs as
            # initializers holding the data set's values (the way exported models carry them).
            if "before the step" not in str(e):
                raise
            model, ins, const = _int_inputs_as_constants(case.model, ins)
            got = run_model(model.SerializeToString(), ins)
            note = "inputs " + ", ".join(const) + " given as constants"
        names = [o.name for o in case.model.graph.output]
        errs = [e for e in (compare(f"{n}", x, y) for n, x, y in zip(names, outs, got)) if e]
        if len(got) != len(outs):
            errs.append(f"{len(got)} outputs, expected {len(outs)}")
        if errs:
            raise AssertionError(f"data set {i}: " + "; ".join(errs))
    return note


def _int_inputs_as_constants(model: onnx.ModelProto, ins: list) -> tuple[onnx.ModelProto, list, list[str]]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep, feed, const = [], [], []
    for info, v in zip(model.graph.input, ins):
        if np.asarray(v).dtype.kind in "iu" or np.ndim(v) == 0:
            m.graph.initializer.append(numpy_helper.from_array(np.asarray(v), info.name))
            const.append(info.name)
        else:
            keep.append(info)
            feed.append(v)
    del m.graph.input[:]
    m.graph.input.extend(keep)
    return m, feed, const


def check(name: str, d: Path | None = None) -> tuple[str, str]:
    """Runs one case: ('pass'|'fail'|'error'|'unsupported', detail)."""
    try:
        case = load_case(name, d) if name not in SYNTHETIC else SYNTHETIC[name]()
        note = run_case(case)
        return "pass", note or ""
    except Unsupported as e:
        return "unsupported", str(e)
    except AssertionError as e:
        return "fail", str(e)
    except Exception as e:  # the engine's errors: import, shape rule, kernel
        return "error", f"{type(e).__name__}: {e}".splitlines()[0]
    except BaseException as e:  # pyo3 PanicException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        return "error", f"panic: {e}".splitlines()[0]


# ---------------------------------------------------------------------------------------------
# adapters for the ai.onnx.preview.training cases


def _node(case: Case, op: str) -> onnx.NodeProto:
    nodes = [n for n in case.model.graph.node if n.op_type == op]
    if len(nodes) != 1:
        raise Unsupported(f"expected one {op} node")
    return nodes[0]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _f32(a) -> np.ndarray:
    return np.array(a, dtype=np.float32, order="C")


def _adam_adapter(case: Case) -> None:
    """ONNX Adam through the engine's Adam (torch.optim.Adam arithmetic). ONNX adds epsilon to
    sqrt(H) before the bias correction, torch after it: eps_torch = eps / sqrt(1 - beta^t);
    t = 0 (no bias correction) is torch's step -> infinity, where both corrections are 1."""
    node = _node(case, "Adam")
    a = _attrs(node)
    alpha, beta = a.get("alpha", 0.9), a.get("beta", 0.999)
    eps, wd, post = a.get("epsilon", 1e-6), a.get("norm_coefficient", 0.0), a.get("norm_coefficient_post", 0.0)
    for ins, outs in case.data_sets:
        r, t = float(ins[0]), int(ins[1])
        n = (len(ins) - 2) // 4
        xs, gs, vs, hs = (list(map(_f32, ins[2 + k * n : 2 + (k + 1) * n])) for k in range(4))
        step = t if t > 0 else 2**31 - 1
        bc2 = 1.0 - float(np.float64(beta) ** step)
        tensors = [(x.ctypes.data, g.ctypes.data, v.ctypes.data, h.ctypes.data, x.size, step) for x, g, v, h in zip(xs, gs, vs, hs)]
        _engine().adam_step(tensors, r, alpha, beta, eps / np.sqrt(bc2), wd, False, False)
        if post:
            xs = [x * (1 - post) for x in xs]
        _compare_all(node, xs + vs + hs, outs)


def _momentum_adapter(case: Case) -> None:
    """ONNX Momentum (standard / nesterov) through the engine's SGD: momentum = alpha,
    dampening = 1 - beta (1 - 1 = 0 at t = 0), weight decay = norm_coefficient."""
    node = _node(case, "Momentum")
    a = _attrs(node)
    mode = a.get("mode", b"standard")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    for ins, outs in case.data_sets:
        r, t = float(ins[0]), int(ins[1])
        n = (len(ins) - 2) // 3
        xs, gs, vs = (list(map(_f32, ins[2 + k * n : 2 + (k + 1) * n])) for k in range(3))
        beta = a["beta"] if t > 0 else 1.0
        tensors = [(x.ctypes.data, g.ctypes.data, v.ctypes.data, x.size, False) for x, g, v in zip(xs, gs, vs)]
        _engine().sgd_step(tensors, r, a["alpha"], 1.0 - beta, a.get("norm_coefficient", 0.0), mode == "nesterov", False)
        _compare_all(node, xs + vs, outs)


def _compare_all(node, got, outs) -> None:
    errs = [e for e in (compare(n, x, y) for n, x, y in zip(node.output, outs, got)) if e]
    if errs:
        raise AssertionError("; ".join(errs))


def _gradient_adapter(case: Case) -> None:
    """ai.onnx.preview.training Gradient(xs, y): the forward graph without the Gradient node,
    xs bound as trainable weights, backward from y with a seed of ones; compares y and dy/dxs."""
    gnode = _node(case, "Gradient")
    a = _attrs(gnode)
    xs = [x.decode() if isinstance(x, bytes) else x for x in a["xs"]]
    y = a["y"].decode() if isinstance(a["y"], bytes) else a["y"]
    o = _engine()
    for ins, outs in case.data_sets:
        g = case.model.graph
        values = dict(zip([i.name for i in g.input], ins))
        fwd = [n for n in g.node if n.op_type != "Gradient"]
        inits = [numpy_helper.from_array(np.asarray(values[x]), x) for x in xs]
        other = [i for i in g.input if i.name not in xs]
        yinfo = onnx.helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)
        graph = onnx.helper.make_graph(fwd, "fwd", other, [yinfo], initializer=inits)
        m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
        s = o.Session(m.SerializeToString(), xs, [True] * len(xs))
        w = [_f32(values[x]) for x in xs]
        feed, keep = _feed([values[i.name] for i in other])
        p = s.forward(feed, [x.ctypes.data for x in w], True, 0)
        _, dt, shape = p.output(0)
        yv = np.empty(shape, NP_OF[dt])
        p.copy_output(0, yv.ctypes.data)
        seed = np.ones_like(yv)
        grads = [np.zeros_like(x) for x in w]
        s.backward(p, [x.ctypes.data for x in w], [seed.ctypes.data], [gr.ctypes.data for gr in grads])
        got = {y: yv} | dict(zip(gnode.output, grads))
        names = [oi.name for oi in g.output]
        errs = [e for e in (compare(n, x, got[n]) for n, x in zip(names, outs)) if e]
        if errs:
            raise AssertionError("; ".join(errs))
        del keep


def _synthetic_gradient_cases() -> dict:
    """test_gradient_of_add*: onnx ≤ 1.15 shipped these (onnx/backend/test/case/node/gradient.py);
    later onnx releases dropped them. Rebuilt here with the same graphs and numbers."""
    from onnx import helper

    def make(name, nodes, outputs, a, b, expected):
        gnode = helper.make_node(
            "Gradient", ["a", "b"], outputs[-2:], name="my_gradient", domain=TRAINING_DOMAIN, xs=["a", "b"], y=outputs[0]
        )
        vi = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, []) for n in ("a", "b")]
        vo = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, []) for n in outputs]
        graph = helper.make_graph(nodes + [gnode], name, vi, vo)
        m = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 12), helper.make_opsetid(TRAINING_DOMAIN, 1)]
        )
        return lambda: Case(name, m, [([a, b], expected)])

    a, b = np.array(1.0, np.float32), np.array(2.0, np.float32)
    c = a + b
    one = np.array(1.0, np.float32)
    add = helper.make_node("Add", ["a", "b"], ["c"], name="my_add")
    mul = helper.make_node("Mul", ["a", "c"], ["d"], name="my_mul")
    return {
        "test_gradient_of_add": make("test_gradient_of_add", [add], ["c", "dc_da", "dc_db"], a, b, [c, one, one]),
        "test_gradient_of_add_and_mul": make(
            "test_gradient_of_add_and_mul",
            [add, mul],
            ["d", "dd_da", "dd_db"],
            a,
            b,
            [c * a, (c + a).astype(np.float32), a.copy()],
        ),
    }


SYNTHETIC = _synthetic_gradient_cases()
ADAPTERS_BY_OP = {"Adam": _adam_adapter, "Momentum": _momentum_adapter, "Gradient": _gradient_adapter}
ADAPTERS = {
    "test_adam": _adam_adapter,
    "test_adam_multiple": _adam_adapter,
    "test_momentum": _momentum_adapter,
    "test_momentum_multiple": _momentum_adapter,
    "test_nesterov_momentum": _momentum_adapter,
    "test_gradient_of_add": _gradient_adapter,
    "test_gradient_of_add_and_mul": _gradient_adapter,
}
ADAPTERS_BY_OP_NOTE: dict = {}
ADAPTER_NOTE = {
    "Adam": "adapter: ONNX Adam numbers through _ortrain.adam_step",
    "Momentum": "adapter: ONNX Momentum numbers through _ortrain.sgd_step",
    "Gradient": "adapter: the engine's autodiff (Session backward); cases from onnx <= 1.15",
}


# ---------------------------------------------------------------------------------------------
# the manifest


def read_manifest(path: Path = MANIFEST) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def run_all(verbose: bool = False) -> dict:
    """Runs every case of every claimed op. Returns {op: [(name, status, detail)]}."""
    d = data_dir()
    claimed = claimed_ops()
    by_op: dict[str, list] = collections.defaultdict(list)
    names = case_names(d) + sorted(SYNTHETIC)
    for name in names:
        case = SYNTHETIC[name]() if name in SYNTHETIC else load_case(name, d)
        op = case_op(case, d)
        if op not in claimed:
            continue
        status, detail = check(name, d)
        by_op[op].append((name, status, detail))
        if verbose and status != "pass":
            print(f"  {status:11} {name}: {detail}")
    return dict(sorted(by_op.items()))


def write_manifest(results: dict, path: Path = MANIFEST) -> None:
    lines = [
        "# ONNX node-test cases the engine passes (regenerate: python -m tests.conformance.runner --all --write-manifest).",
        "# One case per line, grouped by the op under test; failing cases of claimed ops are listed as comments.",
        "# Cases whose shape-deciding inputs (Reshape shape, Slice starts, Reduce axes, Range bounds...) are",
        "# graph inputs run with those inputs as initializers (the engine plans shapes before the step).",
        f"# onnx {onnx.__version__}",
    ]
    for op, rows in results.items():
        n_pass = sum(s == "pass" for _, s, _ in rows)
        note = f" ({ADAPTER_NOTE[op]})" if op in ADAPTER_NOTE else ""
        lines += ["", f"## {op}: {n_pass}/{len(rows)}{note}"]
        lines += [name for name, s, _ in rows if s == "pass"]
        for name, s, detail in rows:
            if s != "pass":
                lines.append(f"# {name}: {s}: {_short(detail)}")
    path.write_text("\n".join(lines) + "\n")


def _short(s: str, n: int = 160) -> str:
    import re

    s = " ".join(s.split())
    s = re.sub(r"element type code (\d+)", lambda m: f"element type {onnx.TensorProto.DataType.Name(int(m.group(1)))}", s)
    s = s.replace("EngineError: ", "").replace("invalid ONNX model: ", "").replace(" (see doc/SUPPORTED-OPS.md)", "")
    return s if len(s) <= n else s[: n - 3] + "..."


def summary(results: dict) -> str:
    out, tp, tn = [], 0, 0
    for op, rows in results.items():
        n_pass = sum(s == "pass" for _, s, _ in rows)
        tp, tn = tp + n_pass, tn + len(rows)
        out.append(f"{op:32} {n_pass:4}/{len(rows):<4}")
    out.append(f"{'TOTAL':32} {tp:4}/{tn:<4}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.conformance.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="case names to run (default with --all: every case of the claimed ops)")
    ap.add_argument("--all", action="store_true", help="run every case of the ops the engine claims")
    ap.add_argument("--write-manifest", action="store_true", help="rewrite manifest.txt from the --all results")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    args = ap.parse_args(argv)
    if args.cases:
        bad = 0
        for name in args.cases:
            status, detail = check(name)
            bad += status != "pass"
            print(f"{status:11} {name} {detail}")
        return 1 if bad else 0
    if not args.all:
        ap.error("name cases or pass --all")
    t0 = time.perf_counter()
    results = run_all(verbose=args.verbose)
    print(summary(results))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.write_manifest:
        write_manifest(results)
        print(f"wrote {MANIFEST}")
    else:
        listed = set(read_manifest()) if MANIFEST.exists() else set()
        regressed = [n for rows in results.values() for n, s, _ in rows if s != "pass" and n in listed]
        if regressed:
            print("REGRESSED (in the manifest, now failing):", ", ".join(regressed))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
