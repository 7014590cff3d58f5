"""ortrain: a training accelerator for PyTorch.

The train step (forward, backward, optimizer) of an exported PyTorch model runs in a Rust engine;
notebook magics (`%load_ext ortrain`) log the PyTorch baseline and the accelerated run to MLflow
side by side. Heavy modules (torch, mlflow) are imported lazily so that `import ortrain` is fast.
"""
from importlib import import_module as _import_module

try:
    from importlib.metadata import version as _version

    __version__ = _version("ortrain")
except Exception:  # running from a source tree without an installed wheel
    __version__ = "0.0.0+source"

# public name -> (module, attribute); resolved on first access (PEP 562). Code inside the package
# uses these names through `import ortrain` rather than `from ortrain.accelerate import ...`: a
# first import of the submodule would bind `ortrain.accelerate` to the module, not the function.
_LAZY = {
    "accelerate": ("ortrain.accelerate", "accelerate"),
    "deaccelerate": ("ortrain.accelerate", "deaccelerate"),
    "is_accelerated": ("ortrain.accelerate", "is_accelerated"),
    "explain": ("ortrain._explain", "explain"),
    "reset_profile": ("ortrain._explain", "reset_profile"),
    "loss_scale": ("ortrain.accelerate", "loss_scale"),
    "ORTTrainer": ("ortrain.trainer", "ORTTrainer"),
    "optim": ("ortrain.optim", None),
    "load_onnx": ("ortrain.onnx_model", "load_onnx"),
    "OrtrainError": ("ortrain.errors", "OrtrainError"),
    "cuda_available": ("ortrain.cuda", "cuda_available"),
    "check_parity": ("ortrain.parity", "check_parity"),
}

__all__ = sorted(_LAZY) + ["load_ipython_extension", "__version__"]


def __getattr__(name):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'ortrain' has no attribute {name!r}") from None
    mod = _import_module(module)
    # every public name from that module at once: importing `ortrain.accelerate` has just bound
    # the package attribute `accelerate` to the submodule, and the function must win
    for public, (source, source_attr) in _LAZY.items():
        if source == module:
            globals()[public] = mod if source_attr is None else getattr(mod, source_attr)
    return globals()[name]


def load_ipython_extension(ipython):
    """`%load_ext ortrain`: registers the %ort / %%ort magics."""
    from ortrain.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from ortrain.magics import unload_ipython_extension as _unload

    _unload(ipython)
