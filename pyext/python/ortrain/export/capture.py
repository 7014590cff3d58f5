"""One trace of the module straight to the ATen graph torch.onnx translates:
`capture_decomposed(wrapper, flat, dynamic_shapes, registry) -> ExportedProgram | None`.

torch.onnx.export traces twice: torch.export.export (non-strict, pre-dispatch IR), then
`run_decompositions(table)` re-traces that program through AOT dispatch to apply its ONNX
decomposition table (every aten op without a torchlib function is decomposed). The second trace
costs about as much as the first (0.7-1.2 s on 2 cores for the tutorial). Here the module is
traced once through AOT dispatch with the same table, the way the re-trace applies it:
the table split into CompositeImplicitAutograd ops (overridden during tracing) and the rest
(given to the AOT export), under the same context torch.onnx's capture and decomposition use
(dynamic RNN decompositions, `backed_size_oblivious`). torch.onnx.export then gets the program
with its decomposition step skipped (`skipping_decomposition`).

Private torch functions are used; where one is missing or the trace fails, None is returned
and the caller takes torch.onnx's own two traces.
"""
from __future__ import annotations

import contextlib
import functools

import torch


def capture_decomposed(wrapper: torch.nn.Module, flat: list, dynamic_shapes, registry):
    """The decomposed ExportedProgram of `wrapper(*flat)`, or None (then nothing was changed)."""
    if _shares_tensors(wrapper):
        return None
    try:
        from torch.export import _trace
        from torch.export import exported_program as _ep
        from torch.onnx import _flags
        from torch.onnx._internal.exporter import _capture_strategies, _decomp
        from torch.onnx._internal.exporter import _flags as _exporting

        ops = set(_decomp.get_onnx_implemented_overloads(registry))
        with _cia_ops_materialized_once():
            table = _decomp.create_onnx_friendly_decomposition_table(ops)
            cia, python_table = _ep._split_decomp_table_to_cia_and_python_decomp(dict(table))
        to_aten = _trace._export_to_aten_ir
        deferred = _flags.PREFER_DEFERRED_RUNTIME_ASSERTS_OVER_GUARDS
        # inside torch.onnx.export, torch.onnx.is_in_onnx_export() is True while it captures
        trace = _exporting.set_onnx_exporting_flag(_trace._export)
    except (ImportError, AttributeError, TypeError):
        return None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_capture_strategies.patch_dynamic_shape_rnn_decompositions(dynamic_shapes))
            stack.enter_context(torch.fx.experimental._config.patch(backed_size_oblivious=True))
            stack.enter_context(_ep._override_composite_implicit_decomp(cia))
            stack.enter_context(_without_stack_traces())
            _trace._export_to_aten_ir = functools.partial(to_aten, decomp_table=python_table)
            try:
                return trace(wrapper, tuple(flat), {}, dynamic_shapes, strict=False, pre_dispatch=False,
                             prefer_deferred_runtime_asserts_over_guards=deferred)
            finally:
                _trace._export_to_aten_ir = to_aten
    except Exception:  # torch.onnx.export's own capture strategies get their turn
        return None


@contextlib.contextmanager
def _cia_ops_materialized_once():
    """Within: torch's `_materialize_cpp_cia_ops` (which walks every CompositeImplicitAutograd op
    of the C++ dispatcher so that `torch.ops` namespaces list them) runs once, not once per op
    namespace per query: building and splitting the decomposition table ran it 60-odd times
    (~0.13 s). Nothing registers operators in between, so the walks after the first find nothing
    new. Without the private name, nothing is changed."""
    try:
        from torch._export import utils as _export_utils
        original = _export_utils._materialize_cpp_cia_ops
    except (ImportError, AttributeError):
        yield
        return
    done = []

    def materialize_once():
        if not done:
            original()
            done.append(True)

    _export_utils._materialize_cpp_cia_ops = materialize_once
    try:
        yield
    finally:
        _export_utils._materialize_cpp_cia_ops = original


@contextlib.contextmanager
def _without_stack_traces():
    """Within: FX nodes get no `stack_trace` (torch.fx.config.do_not_emit_stack_traces). Tracing
    records the Python stack of every node it creates and symbolizes it (0.07-0.13 s of the
    tutorial's trace); the ONNX graph only carries it as `pkg.torch.onnx.stack_trace` metadata,
    which nothing in ortrain reads. Where the flag does not exist, nothing is changed."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


def _shares_tensors(module: torch.nn.Module) -> bool:
    """Whether one tensor is several of the module's parameters or buffers (tied weights). The
    single trace gives each name its own graph input (GPT-2's wte and lm_head: two initializers),
    where torch.export + run_decompositions give the tensor one: such modules take torch.onnx's
    two traces, so that their graphs stay as before."""
    named = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    return len({id(t) for _, t in named}) < len(named)


@contextlib.contextmanager
def skipping_decomposition(program, registry):
    """Within: torch.onnx.export does not decompose `program` again (it was traced decomposed
    for `registry`) when it translates with that registry; anything else is decomposed as usual."""
    try:
        from torch.onnx._internal.exporter import _fx_passes
        original = _fx_passes.decompose_with_registry
    except (ImportError, AttributeError):
        yield
        return

    def decompose_with_registry(exported_program, registry_used):
        if program is not None and exported_program is program and registry is registry_used:
            return exported_program
        return original(exported_program, registry_used)

    _fx_passes.decompose_with_registry = decompose_with_registry
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original
