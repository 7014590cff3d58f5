"""The aten -> ONNX function registry for the dynamo exporter, built without reading every
function's source: `build(opset) -> ONNXRegistry | None`.

torch.onnx's `ONNXRegistry.from_torchlib` registers ~560 onnxscript torchlib functions and, for
each, parses its Python source twice (onnxscript's list computes every function's IR for its
domain, the registry entry infers its ONNX signature): 0.6-0.9 s on 2 cores, where a graph uses
~40 of them. The registry built here holds the same entries (same targets, same order, same
opset clean-up) but infers an entry's signature only when the translation asks for it
(`get_decomps(target)`), with torch's own inference (`OnnxDecompMeta.__post_init__`).
The decomposition table needs only the registered targets, which cost nothing.
Importing torchlib's functions also infers an onnxscript signature for each of its ~420 traced
functions (`TracedOnnxFunction.__init__`, ~0.05 s); that import defers each one to the first
read of the function's `op_signature` (export/registry.py `_traced_signatures_deferred`). It
also compiles each of its ~50 scripted functions from their Python source (`onnxscript.script`:
parse, convert to ONNX IR, infer a signature; ~0.1 s, most of what is left of `build`); that
import defers each compilation to the first read of what it makes (`_scripts_deferred`).

Private torch/onnxscript classes are used; where any of them is missing or behaves otherwise,
`build` returns None and the caller uses torch's own `from_torchlib`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys

_BUILT: dict = {}  # opset -> registry (nothing mutates it: no custom translation table is passed)


def build(opset: int):
    """A lazily-signed registry equal to `ONNXRegistry.from_torchlib(opset)`, or None."""
    if not isinstance(opset, int):
        return None
    if opset in _BUILT:
        return _BUILT[opset]
    try:
        registry = _build(opset)
    except Exception:  # a torch/onnxscript without these internals: torch's own path
        registry = None
    _BUILT[opset] = registry
    return registry


def _build(opset: int):
    with _traced_signatures_deferred(), _scripts_deferred():
        from onnxscript.function_libs.torch_lib import ops  # noqa: F401  (registers the functions)
    from onnxscript.function_libs.torch_lib import registration
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    class LazyRegistry(_registration.ONNXRegistry):
        """`get_decomps` infers the signatures of the entries it returns, once each."""

        def get_decomps(self, target):
            decomps = super().get_decomps(target)
            for meta in decomps:
                if getattr(meta, "_ortrain_unsigned", False):
                    meta._ortrain_unsigned = False
                    meta.skip_signature_inference = False
                    meta.__post_init__()  # torch's inference; raises as from_torchlib would
            return decomps

    registry = LazyRegistry()
    registry._opset_version = opset
    for meta in _torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, overloaded in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue  # as onnxscript's get_torchlib_ops
        functions = [(f, False) for f in overloaded.overloads] + [(f, True) for f in overloaded.complex]
        for function, is_complex in functions:
            target = _registration._get_overload(qualified_name)
            if target is None:
                continue
            meta = _registration.OnnxDecompMeta(
                onnx_function=function, fx_target=target, signature=None, is_custom=False,
                is_complex=is_complex, skip_signature_inference=True)
            meta._ortrain_unsigned = True
            registry._register(target, meta)
    registry._cleanup_registry_based_on_opset_version()
    if not registry.functions:
        return None
    return registry


class _Deferred:
    """A traced function's onnxscript signature, inferred when first read."""

    __slots__ = ("infer", "args", "kwargs")

    def __init__(self, infer, args, kwargs):
        self.infer, self.args, self.kwargs = infer, args, kwargs


@contextlib.contextmanager
def _traced_signatures_deferred():
    """Within (the first import of torchlib's functions): `TracedOnnxFunction`s are created with
    their signature deferred; `TracedOnnxFunction.op_signature` infers a deferred one when read
    (the same call onnxscript made at creation) and keeps it. Signatures of other onnxscript
    functions are inferred as before. Where onnxscript's classes differ from what this expects,
    or the functions are already imported, nothing is changed."""
    try:
        if "onnxscript.function_libs.torch_lib.ops" in sys.modules:
            raise LookupError("already imported")
        from onnxscript._internal import values

        cls = values.TracedOnnxFunction
        schemas = values._schemas
        infer = schemas.op_signature_from_function
        prop = cls.__dict__["op_signature"]
        if not isinstance(prop, property) or prop.fget is None:
            raise LookupError("op_signature is not a property")
    except (ImportError, AttributeError, KeyError, LookupError):
        yield
        return
    if not getattr(prop.fget, "_ortrain_resolves_deferred", False):
        getter = prop.fget

        def op_signature(self):
            value = getter(self)
            if isinstance(value, _Deferred):
                value = value.infer(*value.args, **value.kwargs)
                self._signature = value
            return value

        op_signature._ortrain_resolves_deferred = True
        cls.op_signature = property(op_signature, prop.fset, prop.fdel, prop.__doc__)

    class Schemas:
        """`values._schemas` while the functions are created: traced signatures deferred."""

        def __getattr__(self, name):
            return getattr(schemas, name)

        @staticmethod
        def op_signature_from_function(*args, **kwargs):
            if kwargs.get("domain") == "_traced":
                return _Deferred(infer, args, kwargs)
            return infer(*args, **kwargs)

    values._schemas = Schemas()
    try:
        yield
    finally:
        values._schemas = schemas


def _deferred_script_class(values, compile_script):
    """A subclass of onnxscript's OnnxFunction made from the Python function alone: the
    compiled function (`compile_script(opset, kwargs)(pyfun)`, what onnxscript.script returns)
    is made when its IR, source, options or signature are first read, and those are then its."""

    class DeferredOnnxFunction(values.OnnxFunction):
        def __init__(self, opset, pyfun, kwargs):  # pylint: disable=super-init-not-called
            # OnnxFunction.__init__ needs the compiled IR; Op's part is set as it sets it (the
            # compiled IR's name is the Python function's)
            values.Op.__init__(self, opset, pyfun.__name__)
            self.function = pyfun
            self._script_kwargs = kwargs
            self._compiled = None
            functools.update_wrapper(self, pyfun)
            self.traceable = False

        def _compiled_function(self):
            if self._compiled is None:
                compiled = compile_script(self._opset, self._script_kwargs)(self.function)
                if compiled.name != self.name:
                    raise ValueError(f"onnxscript compiled {self.name} as {compiled.name}")
                self._compiled = compiled
                if self._signature is None:
                    self._signature = compiled.op_signature
            return self._compiled

        @property
        def function_ir(self):
            return self._compiled_function().function_ir

        @property
        def source(self):
            return self._compiled_function().source

        @property
        def kwargs(self):
            return self._compiled_function().kwargs

        @property
        def op_signature(self):
            if self._signature is None:
                self._compiled_function()
            return self._signature

        @op_signature.setter
        def op_signature(self, value):
            self._signature = value

    return DeferredOnnxFunction


@contextlib.contextmanager
def _scripts_deferred():
    """Within (the first import of torchlib's functions): `onnxscript.script(opset, **kwargs)`
    with an opset returns, for each function, a DeferredOnnxFunction (compiled when first read)
    instead of compiling it. Where onnxscript differs from what this expects, or the functions
    are already imported, nothing is changed."""
    try:
        if "onnxscript.function_libs.torch_lib.ops" in sys.modules:
            raise LookupError("already imported")
        import onnxscript
        from onnxscript._internal import values

        script = onnxscript.script
        for name in ("function_ir", "source", "kwargs", "function", "traceable"):
            if name in ("function_ir", "source", "kwargs") and name in values.OnnxFunction.__dict__:
                raise LookupError(f"OnnxFunction.{name} is not a plain attribute")
        if not isinstance(values.OnnxFunction.__dict__.get("op_signature"), property):
            raise LookupError("OnnxFunction.op_signature is not a property")
    except (ImportError, AttributeError, LookupError):
        yield
        return

    def compile_script(opset, kwargs):
        return script(opset=opset, **kwargs)

    deferred = _deferred_script_class(values, compile_script)

    def deferring_script(opset=None, default_opset=None, **kwargs):
        if not isinstance(opset, values.Opset) or default_opset is not None:
            return script(opset=opset, default_opset=default_opset, **kwargs)

        def transform(f):
            if not inspect.isfunction(f):
                return script(opset=opset, **kwargs)(f)
            return deferred(opset, f, kwargs)

        return transform

    onnxscript.script = deferring_script
    try:
        yield
    finally:
        onnxscript.script = script
