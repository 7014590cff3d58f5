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

The ops the table keeps (linear, scaled_dot_product_attention, ...: torchlib translates them
whole) still need output types while tracing; torch finds them by running the op's whole
CompositeImplicitAutograd decomposition on fake tensors with symbolic shapes, which was a third
of the tutorial's trace. For linear, layer_norm and scaled_dot_product_attention (with dropout)
the output is made from the input shapes instead (`_shape_rules`), where that gives the same
type and adds no guard.

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
        cia = _overrides_that_change_something(cia)
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
            stack.enter_context(_shape_rules(cia))  # before torch registers its own for these ops
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


def _overrides_that_change_something(cia: dict) -> dict:
    """The CompositeImplicitAutograd ops of `cia` less those whose entry is the op's own
    decomposition (`_special_op_to_decompose_cia` bound to the op itself: ~410 of ~510 for
    torch.onnx's table). A trace without pre-dispatch decomposes a CIA op with its own kernel
    anyway; overriding it only routes the same decomposition through Python dispatcher entries,
    ~20 registrations per op (0.1-0.25 s CPU for the table). The ops kept whole and those with
    another decomposition are overridden as before (tests/test_export_capture.py: same graphs)."""
    def own(op, fn):
        return (isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "_special_op_to_decompose_cia"
                and fn.keywords.get("kernel") is op and not fn.args)

    return {op: fn for op, fn in cia.items() if not own(op, fn)}


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
def _shape_rules(kept):
    """Within: for the kept CompositeImplicitAutograd ops of `_kept_rules()` (those in `kept`
    without a fake-tensor rule yet), a rule that makes the output from the input shapes where the
    op's `_kept_rules()` entry knows it is what the op's decomposition gives, and otherwise runs
    the decomposition, as torch's own rule for kept ops does (`_override_composite_implicit_decomp`,
    whose exit also removes these rules). Without the private names, nothing is changed.
    (Ops whose fake computation is a Python decomposition, such as triu, cannot be given a rule
    this way: with symbolic shapes FakeTensorMode runs the decomposition before any rule.)"""
    try:
        from torch._subclasses import fake_impls
        from torch.export import exported_program as _ep

        # each op's decomposition is read before torch's override replaces it, as torch does
        rules = [(op, rule, _ep._get_decomp_for_cia(op)) for op, rule in _kept_rules().items()
                 if op in kept and not fake_impls._is_op_registered_to_fake_rule(op)]
    except (ImportError, AttributeError, TypeError):
        yield
        return
    registered = []
    try:
        for op, rule, decomposition in rules:
            fake_impls.register_op_impl(op)(functools.partial(_apply_rule, rule=rule, decomposition=decomposition))
            registered.append(op)
    except (AttributeError, TypeError, AssertionError):
        for op in registered:
            fake_impls._deregister_op_impl(op)
        registered = []
    try:
        yield
    finally:
        for op in registered:
            fake_impls._deregister_op_impl(op)


def _apply_rule(fake_mode, func, *args, rule, decomposition, **kwargs):
    """The output of `func(*args, **kwargs)` on fake tensors: a contiguous tensor of `rule`'s
    shape where it gives one, else the op's decomposition's."""
    made = rule(*args, **kwargs)
    with fake_mode:
        if made is None:
            return decomposition(*args, **kwargs)
        like, shape = made
        return like.new_empty(shape)


def _same(a, b) -> bool:
    """Whether sizes a and b (ints or SymInts) are the same for every value of the symbols, read
    from their expressions: no guard, and no node in the traced graph (`==` on a SymInt would
    record one)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a = a.node.expr if isinstance(a, torch.SymInt) else a
    b = b.node.expr if isinstance(b, torch.SymInt) else b
    return bool(a == b)


def _linear(input, weight, bias=None):
    """aten.linear: [..., in] x [out, in] (+ [out]) -> [..., out], contiguous (the mm, addmm or
    folded matmul of its decomposition) when the inner sizes are the same expressions (else the
    decomposition's checks would add guards) and the dtypes agree."""
    if input.dim() < 2 or weight.dim() != 2 or input.dtype != weight.dtype:
        return None
    if not _same(input.shape[-1], weight.shape[1]):
        return None
    if bias is not None and (bias.dim() != 1 or bias.dtype != input.dtype
                             or not _same(bias.shape[0], weight.shape[0])):
        return None
    return input, (*input.shape[:-1], weight.shape[0])


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
               enable_gqa=False):
    """aten.scaled_dot_product_attention: [*B, L, E], [*B, S, E], [*B, S, Ev] -> [*B, L, Ev],
    contiguous, as its math path gives it (softmax(q kᵀ) v as batched matmuls), which is the one
    taken on the CPU with dropout (the flash kernel, without dropout, gives another layout), when
    q, k, v have the same rank, batch sizes and dtype, the mask (if any) broadcasts to [*B, L, S]
    without new guards, and no grouped-query repeat is asked for. (A mask with is_causal is an
    error the decomposition raises.)"""
    if not (isinstance(dropout_p, float) and 0.0 < dropout_p <= 1.0 and query.device.type == "cpu"):
        return None
    if enable_gqa or (is_causal and attn_mask is not None) or not (query.dim() == key.dim() == value.dim() >= 3):
        return None
    if not (query.dtype == key.dtype == value.dtype and query.dtype.is_floating_point):
        return None
    batch = query.shape[:-2]
    if not all(_same(q, k) and _same(q, v) for q, k, v in zip(batch, key.shape[:-2], value.shape[:-2])):
        return None
    if not (_same(query.shape[-1], key.shape[-1]) and _same(key.shape[-2], value.shape[-2])):
        return None
    if attn_mask is not None:
        full = (*batch, query.shape[-2], key.shape[-2])
        if attn_mask.dim() > len(full) or not (attn_mask.dtype == torch.bool or attn_mask.dtype == query.dtype):
            return None
        for m, f in zip(reversed(attn_mask.shape), reversed(full)):
            if not (_same(m, f) or (isinstance(m, int) and m == 1)):
                return None
    return query, (*query.shape[:-1], value.shape[-1])


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """aten.layer_norm: the input's shape, contiguous (native_layer_norm makes the input
    contiguous and works element-wise), when normalized_shape, weight and bias are the input's
    trailing sizes and dtype."""
    n = len(normalized_shape)
    if n < 1 or input.dim() < n or not input.dtype.is_floating_point:
        return None
    trailing = input.shape[input.dim() - n:]
    if not all(_same(a, b) for a, b in zip(trailing, normalized_shape)):
        return None
    for t in (weight, bias):
        if t is not None and (t.dtype != input.dtype or t.dim() != n
                              or not all(_same(a, b) for a, b in zip(t.shape, trailing))):
            return None
    return input, tuple(input.shape)


def _kept_rules() -> dict:
    aten = torch.ops.aten
    return {aten.linear.default: _linear, aten.scaled_dot_product_attention.default: _attention,
            aten.layer_norm.default: _layer_norm}


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
