"""ortrain/export/registry.py: the lazily-signed torchlib registry. Importing torchlib's functions
through it defers each traced function's onnxscript signature to its first read; the signature
read then is the one onnxscript infers at creation (checked in a fresh process, where the
import really happens under the deferral)."""
import os
import subprocess
import sys

_CHECK = r"""
from ortrain.export import registry
assert registry.build(20) is not None
from onnxscript._internal import values
from onnxscript.ir import _schemas
from onnxscript.function_libs.torch_lib import registration
traced = [f for o in registration.default_registry.values() for f in o.overloads + o.complex
          if isinstance(f, values.TracedOnnxFunction)]
assert len(traced) > 300, len(traced)
deferred = sum(isinstance(f._signature, registry._Deferred) for f in traced)
assert deferred == len(traced), (deferred, len(traced))
for f in traced:
    expected = _schemas.op_signature_from_function(f.func, domain="_traced", name=f.name)
    assert repr(f.op_signature) == repr(expected), f.name
    assert f.op_signature is f.op_signature  # inferred once, then kept
assert values._schemas is _schemas  # restored after the import
print("ok", len(traced))
"""


def test_deferred_signatures_are_onnxscripts():
    env = dict(os.environ, PYTHONHASHSEED="0")  # signatures hold frozensets: same repr order
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok"), out.stdout


_CHECK_SCRIPTS = r"""
import onnxscript
from ortrain.export import registry
assert registry.build(20) is not None
from onnxscript._internal import values
from onnxscript.function_libs.torch_lib import registration
scripted = {id(f): f for o in registration.default_registry.values() for f in o.overloads + o.complex
            if isinstance(f, values.OnnxFunction)}
assert len(scripted) > 30, len(scripted)
assert all(type(f).__name__ == "DeferredOnnxFunction" and f._compiled is None for f in scripted.values())
assert onnxscript.script.__module__ != "ortrain.export.registry"  # restored after the import
for f in scripted.values():
    compiled = onnxscript.script(opset=f.opset, **f._script_kwargs)(f.function)
    assert f.name == compiled.name and f.domain == compiled.domain, f.name
    assert f.to_function_proto() == compiled.to_function_proto(), f.name
    assert repr(f.op_signature) == repr(compiled.op_signature), f.name
    assert f.source == compiled.source and f.kwargs == compiled.kwargs, f.name
print("ok", len(scripted))
"""


def test_deferred_scripts_compile_as_onnxscript():
    # torchlib's scripted functions are compiled when first read, to what onnxscript.script makes
    env = dict(os.environ, PYTHONHASHSEED="0")
    out = subprocess.run([sys.executable, "-c", _CHECK_SCRIPTS], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok"), out.stdout
