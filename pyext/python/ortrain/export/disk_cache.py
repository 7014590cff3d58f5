"""The on-disk cache of dynamo ONNX translations, keyed by the traced program itself.

torch.onnx.export(dynamo=True) is capture (torch.export: runs the module's Python code) then
translation (torchlib registry, decompositions, aten -> ONNX: about 60% of the time). The capture
always runs, so a changed forward, a changed attribute or another input signature gives another
program; only the translation of a program already translated is read back. The key is a digest
of everything the translation reads:
- every node of every graph of the ExportedProgram: op, target, arguments (values such as a
  dropout p or a scale are arguments), and the type, shape (symbolic expressions) and device
  of its value, its module stack (node names come from it); get_attr tensors by content;
- the graph signature (which placeholder is a parameter, buffer, constant or user input; which
  outputs update buffers), the range constraints of the symbolic dims, every lifted constant by
  content, every parameter/buffer by name, shape and dtype (by content where it is not bound,
  i.e. where its data would be in the graph);
- the options (opset, input and output names, the bound initializer names), the versions of
  torch, onnxscript, onnx_ir and onnx, TORCH_ONNX_* environment flags, and the source of the two
  files that produce the cached bytes (export/dynamo.py and this one).
Only graphs without weight data are stored (kilobytes; `export_module(weights=False)`).
Directory: `$ORTRAIN_EXPORT_CACHE_DIR`, else `$ORTRAIN_CACHE_DIR/export`, else
`~/.cache/ortrain/export`; the 64 most recently written entries are kept; files are written
atomically and parsed before use (an unreadable one is a miss). `ORTRAIN_EXPORT_DISK_CACHE=0`
turns it off.
"""
from __future__ import annotations

import hashlib
import os
import tempfile

import onnx
import torch

FORMAT = "ortrain-export-disk-cache-1"
KEEP = 64


def enabled() -> bool:
    return os.environ.get("ORTRAIN_EXPORT_DISK_CACHE", "1") != "0"


def directory() -> str:
    explicit = os.environ.get("ORTRAIN_EXPORT_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("ORTRAIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ortrain")
    return os.path.join(base, "export")


def key(program, options: dict, bound) -> str:
    """The digest of an ExportedProgram plus the translation's options (module docstring)."""
    h = hashlib.blake2b(digest_size=24)

    def put(*items):
        h.update(repr(items).encode())
        h.update(b"\x00")

    put(FORMAT, _versions(), sorted(options.items()), sorted(bound),
        sorted((k, v) for k, v in os.environ.items() if k.startswith("TORCH_ONNX")))
    for name, gm in program.graph_module.named_modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        put("graph", name)
        for node in gm.graph.nodes:
            put(node.op, node.name, _target(node.target), _arg(node.args), _arg(node.kwargs),
                _value(node.meta.get("val")), _stack(node.meta.get("nn_module_stack")))
            if node.op == "get_attr":
                attr = gm
                for part in str(node.target).split("."):
                    attr = getattr(attr, part, None)
                put("attr", _content(attr, h) if isinstance(attr, torch.Tensor) else type(attr).__name__)
    put("signature", str(program.graph_signature))
    put("ranges", sorted((str(k), str(v)) for k, v in program.range_constraints.items()))
    for name, value in sorted(program.constants.items()):
        put("constant", name, _content(value, h) if isinstance(value, torch.Tensor) else type(value).__name__)
    for name, value in sorted(program.state_dict.items()):
        put("state", name, (tuple(value.shape), str(value.dtype)) if name in bound else _content(value, h))
    return h.hexdigest()


def load(digest: str) -> onnx.ModelProto | None:
    path = os.path.join(directory(), digest + ".onnx")
    try:
        with open(path, "rb") as f:
            data = f.read()
        model = onnx.load_from_string(data)
    except Exception:  # noqa: BLE001 - missing, unreadable or truncated: a miss
        return None
    if not model.graph.node:
        return None
    return model


def store(digest: str, model: onnx.ModelProto) -> None:
    """Writes the entry atomically; a cache that cannot be written is skipped silently (the
    export itself succeeded)."""
    folder = directory()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".onnx")
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        os.replace(tmp, os.path.join(folder, digest + ".onnx"))
        _prune(folder)
    except OSError:
        return


def _prune(folder: str) -> None:
    entries = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".onnx") and not n.startswith(".")]
    if len(entries) <= KEEP:
        return
    entries.sort(key=os.path.getmtime)
    for path in entries[:-KEEP]:
        try:
            os.remove(path)
        except OSError:
            pass


_VERSIONS = None


def _versions() -> tuple:
    global _VERSIONS
    if _VERSIONS is None:
        from importlib import metadata

        installed = []
        for dist in ("onnxscript", "onnx-ir"):  # read without importing them (onnxscript: ~1 s)
            try:
                installed.append(metadata.version(dist))
            except metadata.PackageNotFoundError:
                installed.append(None)
        here = os.path.dirname(os.path.abspath(__file__))
        sources = []
        for name in ("dynamo.py", "disk_cache.py"):
            with open(os.path.join(here, name), "rb") as f:
                sources.append(hashlib.blake2b(f.read(), digest_size=16).hexdigest())
        _VERSIONS = (torch.__version__, *installed, onnx.__version__, tuple(sources))
    return _VERSIONS


def _target(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "")
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', None) or str(target)}"


def _arg(a):
    if isinstance(a, torch.fx.Node):
        return ("%", a.name)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_arg(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((str(k), _arg(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _arg(a.start), _arg(a.stop), _arg(a.step))
    if isinstance(a, (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format)):
        return (type(a).__name__, repr(a))
    return (type(a).__module__, type(a).__qualname__, repr(a))


def _value(v):
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return ("T", tuple(str(d) for d in v.shape), str(v.dtype), v.device.type, tuple(str(s) for s in v.stride())
                if v.layout == torch.strided else None)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", type(v).__name__, str(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value(x) for x in v))
    return (type(v).__name__, repr(v))


def _stack(stack):
    if not stack:
        return None
    return tuple((str(k), str(v)) for k, v in stack.items())


def _content(t: torch.Tensor, h) -> tuple:
    """Hashes the tensor's bytes into `h`; returns its type and shape."""
    c = t.detach().cpu().contiguous()
    if c.numel():
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return ("tensor", tuple(c.shape), str(c.dtype))
