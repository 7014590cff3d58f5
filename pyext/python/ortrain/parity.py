"""`ortrain.check_parity(model, *args, **kwargs)`: where, on one batch, the engine and PyTorch
part ways: the first operator whose output differs beyond tolerance, named by its ONNX op type
and node, the PyTorch op it came from and the module it belongs to.

How: the model is exported as `accelerate()` exports it (into copies of the module, so the
user's model, its optimizer and its RNG streams are untouched), keeping the torch.export program
behind the ONNX graph. Its FX node names are the ONNX graph's value names, so every
intermediate value can be computed twice on the same inputs: by PyTorch, running that program
node by node, and by the engine, running the same ONNX graph with every such value added as an
output. The values are compared in graph order. Then the final outputs are compared with the
user's module itself (a difference there that the program shares is the export's, not the
engine's), and the parameter gradients of both for the same output gradient.

Dropout is off in all copies during the check (masks come from different random streams by
design); everything else runs in the module's current train/eval mode.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch

#: a value differs when max|engine - torch| > atol + rtol * max|torch|
RTOL = 1e-3
ATOL = 1e-5


#: ONNX ops that only move data or compute shapes: left out when listing what a PyTorch op became
_PLUMBING = frozenset({"Constant", "Shape", "Cast", "CastLike", "Concat", "Slice", "Reshape", "Squeeze", "Unsqueeze",
                       "Identity", "Range", "ConstantOfShape", "Expand", "Gather", "Transpose", "Size"})


@dataclasses.dataclass
class ValueDiff:
    """One compared value: the engine's against PyTorch's."""

    value: str  # ONNX value name = FX node name
    op_type: str  # ONNX op producing it in the engine's graph
    node: str  # that ONNX node's name
    torch_op: str  # the PyTorch (aten) op it was exported from
    module: str  # the module path it belongs to ("" at the top level)
    shape: tuple
    max_abs: float
    ref_max: float  # max|PyTorch value|
    onnx_ops: tuple = ()  # every ONNX op type the PyTorch op was exported as, in graph order

    @property
    def rel(self) -> float:
        return self.max_abs / self.ref_max if self.ref_max > 0 else (0.0 if self.max_abs == 0 else math.inf)

    def describe(self) -> str:
        where = f" in {self.module}" if self.module else ""
        compute = list(dict.fromkeys(op for op in self.onnx_ops if op not in _PLUMBING))
        parts = (f"; exported as {len(self.onnx_ops)} ONNX nodes, computing with {', '.join(compute)}"
                 if len(self.onnx_ops) > 1 and compute else "")
        return (f"{self.torch_op}{where}: ONNX {self.op_type} node '{self.node}'{parts}; value '{self.value}' "
                f"{list(self.shape)}: max |diff| {self.max_abs:.3g}, {self.rel:.3g} of max |value| {self.ref_max:.3g}")


@dataclasses.dataclass
class ParityReport:
    compared: int  # intermediate values compared
    first: ValueDiff | None  # the first (in graph order) beyond tolerance
    worst: ValueDiff | None  # the largest relative difference, within tolerance or not
    export_rel: float  # final outputs: the exported program against the module itself
    output_rel: float  # final outputs: the engine against the module itself
    grads: list  # [(parameter name, relative difference)] sorted worst first
    rtol: float
    atol: float
    notes: list

    @property
    def ok(self) -> bool:
        return self.first is None and self.output_rel <= self.rtol and all(r <= self.rtol for _, r in self.grads)

    def __str__(self) -> str:
        lines = [f"ortrain parity check (one batch, dropout off, tolerance {self.atol:g} + {self.rtol:g} x max |value|):"]
        if self.first is not None:
            lines.append(f"  first diverging op: {self.first.describe()}")
            lines.append(f"  its inputs agreed: every value before it in the graph ({self.compared} compared in all) "
                         "was within tolerance")
        else:
            lines.append(f"  forward: all {self.compared} intermediate values agree"
                         + (f" (largest: {self.worst.rel:.2g} at {self.worst.op_type} '{self.worst.node}')" if self.worst else ""))
        lines.append(f"  outputs vs the module: engine {self.output_rel:.2g}, exported program {self.export_rel:.2g}")
        if self.export_rel > self.rtol:
            lines.append("  the exported program itself differs from the module: the export, not the engine, changed the result")
        if self.grads:
            name, rel = self.grads[0]
            bad = [n for n, r in self.grads if r > self.rtol]
            lines.append(f"  parameter gradients: {len(self.grads)} compared, worst {rel:.2g} ({name})"
                         + (f"; beyond tolerance: {', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else "") if bad else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def check_parity(model: torch.nn.Module, *args, rtol: float = RTOL, atol: float = ATOL, **kwargs) -> ParityReport:
    """Compares the engine with PyTorch on one call `model(*args, **kwargs)`; see the module doc.
    The model is not changed. Raises OrtrainError when the engine cannot run the model."""
    import ortrain  # the lazy public name, not the submodule (see ortrain/__init__.py)
    from ortrain.export.dynamo import capture_programs
    from ortrain.export.inputs import flatten_call
    from ortrain.export.outputs import flatten_outputs
    from ortrain.data_parallel import unwrap

    model = unwrap(model)  # a DistributedDataParallel: the module it holds
    device = "cuda" if any(p.is_cuda for p in model.parameters()) else "cpu"
    with _plain(model) as plain:
        ref = copy.deepcopy(plain)
        eng = copy.deepcopy(plain)
    notes = []
    switched = _dropout_off(ref) + _dropout_off(eng)
    if switched:
        notes.append(f"dropout set to 0 in {switched // 2} place(s) for the check")
    _, flat = flatten_call(model, args, kwargs)
    rng = torch.random.get_rng_state()
    try:
        ortrain.accelerate(eng, device=device, strict=True, fuse_loss=False, exporter="dynamo")
        with capture_programs() as programs:
            eng_out = eng(*args, **kwargs)
        ref_out = ref(*args, **kwargs)
        _, eng_flat, _ = flatten_outputs(eng_out)
        _, ref_flat, _ = flatten_outputs(ref_out)
        grads = _compare_grads(ref, eng, ref_flat, eng_flat)
        output_rel = max((_rel(e, r) for e, r in zip(eng_flat, ref_flat)), default=0.0)
        state = eng.__dict__["_ortrain_state"]
        runner = state.runners[state.last_key]
        torch_values, program_out = _run_program(programs[-1], flat)
        export_rel = max((_rel(p, r) for p, r in zip(program_out, ref_flat)), default=0.0)
        diffs = _compare_values(runner, ref, flat, torch_values, programs[-1])
    finally:
        torch.random.set_rng_state(rng)
    first = next((d for d in diffs if d.max_abs > atol + rtol * d.ref_max), None)
    worst = max(diffs, key=lambda d: d.rel, default=None)
    return ParityReport(len(diffs), first, worst, export_rel, output_rel, grads, rtol, atol, notes)


@contextlib.contextmanager
def _plain(model):
    """The module without ortrain's takeover (an accelerated module's state is not copied)."""
    saved = {k: model.__dict__.pop(k) for k in ("_ortrain_state", "forward") if k in model.__dict__}
    try:
        yield model
    finally:
        model.__dict__.update(saved)


def _dropout_off(module) -> int:
    """Sets every dropout probability in `module` to 0: nn.Dropout modules and float attributes
    named like `*dropout*` (nn.MultiheadAttention.dropout, Hugging Face attention_dropout)."""
    n = 0
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            n += 1
            continue
        for name, v in list(vars(m).items()):
            if "dropout" in name and isinstance(v, float) and 0 < v < 1:
                setattr(m, name, 0.0)
                n += 1
    return n


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    if not (a.is_floating_point() and ref.is_floating_point()):
        return 0.0 if torch.equal(a.cpu(), ref.cpu()) else math.inf
    a, ref = a.detach().double(), ref.detach().double()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (a - ref).abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _compare_grads(ref, eng, ref_flat, eng_flat) -> list:
    """Parameter gradients of both for the same (random, fixed) output gradients."""
    params_r = dict(ref.named_parameters())
    params_e = dict(eng.named_parameters())
    names = [n for n, p in params_r.items() if p.requires_grad]
    if not names:
        return []
    g = torch.Generator(device="cpu").manual_seed(0)
    pairs = [(r, e) for r, e in zip(ref_flat, eng_flat) if r.is_floating_point() and r.requires_grad and e.requires_grad]
    if not pairs:
        return []
    seeds = [torch.randn(r.shape, generator=g, dtype=r.dtype).to(r.device) for r, _ in pairs]
    gr = torch.autograd.grad([r for r, _ in pairs], [params_r[n] for n in names], seeds, allow_unused=True)
    ge = torch.autograd.grad([e for _, e in pairs], [params_e[n] for n in names], seeds, allow_unused=True)
    out = [(n, _rel(b, a)) for n, a, b in zip(names, gr, ge) if a is not None and b is not None]
    return sorted(out, key=lambda t: -t[1])


def _run_program(program, flat: list) -> tuple[dict, list]:
    """Runs the exported program node by node in PyTorch: {FX node name: tensor}, outputs."""
    values: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                values[n.name] = result.detach()
            return result

    with torch.no_grad():
        out = Recorder(program.module()).run(*flat)
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    return values, [o for o in out if isinstance(o, torch.Tensor)]


def _origins(program) -> dict:
    """FX node name -> (torch op, module path) from the program's node metadata."""
    found = {}
    for n in program.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        path = path.removeprefix("ortrain_inner").lstrip(".")  # export's wrapper around the user's module
        found[n.name] = (str(n.target), path)
    return found


def _compare_values(runner, module, flat: list, torch_values: dict, program) -> list:
    """The engine's value of every intermediate the program also computed, in graph order."""
    import onnx
    from onnx import helper

    from ortrain.engine.runner import Runner

    model = onnx.load_from_string(runner.exported.onnx_bytes)
    existing = {o.name for o in model.graph.output}
    wanted = []  # (value, op type, node name) in graph order
    parts: dict = {}  # FX node name -> the ONNX op types it was exported as
    for node in model.graph.node:
        fx = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
        if fx.startswith("%") and " " in fx:
            parts.setdefault(fx[1:fx.index(" ")], []).append(node.op_type)
        for v in node.output:
            if v in torch_values and v not in existing and torch_values[v].numel() > 0:
                wanted.append((v, node.op_type, node.name))
                model.graph.output.append(helper.make_empty_tensor_value_info(v))
    probe = dataclasses.replace(runner.exported, onnx_bytes=model.SerializeToString(),
                                output_names=list(runner.exported.output_names) + [v for v, _, _ in wanted])
    device = "cuda" if runner.on_cuda else "cpu"
    outs = Runner(module, probe, device=device)([x.to(runner.device) for x in flat], grad=False)
    engine_values = outs[len(runner.exported.output_names):]
    origins = _origins(program)
    diffs = []
    for (v, op_type, node), got in zip(wanted, engine_values):
        want = torch_values[v]
        if got.shape != want.shape:
            diffs.append(ValueDiff(v, op_type, node, *origins.get(v, ("?", "")), tuple(want.shape), math.inf, 0.0,
                                   tuple(parts.get(v, ()))))
            continue
        a, b = got.detach().double().cpu(), want.double().cpu()
        ref_max = b.abs().max().item()
        max_abs = (a - b).abs().max().item()
        if math.isnan(max_abs) and not (a.isnan() == b.isnan()).all():
            max_abs = math.inf
        elif math.isnan(max_abs):
            max_abs = (a - b).nan_to_num(0.0).abs().max().item()
        diffs.append(ValueDiff(v, op_type, node, *origins.get(v, ("?", "")), tuple(want.shape), max_abs, ref_max,
                               tuple(parts.get(v, ()))))
    return diffs
