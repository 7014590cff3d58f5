"""IPython magics: `%ort accelerate|off|status` and the cell magic `%%ort [MODE] ...`.

`%load_ext ortrain` registers them. The cell is executed the way %%timeit does it (compiled
with IPython's caching compiler, so tracebacks show the user's cell and line; exceptions
propagate unchanged), with step hooks installed (see ortrain._steps), and logged to MLflow
(see ortrain._runlog). torch is imported only when a magic runs; mlflow is never imported.
"""
from __future__ import annotations

import copy
import random
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

MODES = ("accelerated", "baseline", "compare")


def engine() -> dict:
    """The engine's Python API the magics use (accelerate, deaccelerate, is_accelerated, explain)."""
    import ortrain

    return {n: getattr(ortrain, n) for n in ("accelerate", "deaccelerate", "is_accelerated", "explain")}


def _pick(kind: str, found: dict, name: str | None, ns: dict):
    if name:
        if name not in ns:
            raise UsageError(f"%ort: no variable named {name!r} in the notebook")
        return name, ns[name]
    if len(found) == 1:
        return next(iter(found.items()))
    if not found:
        raise UsageError(f"%ort: no {kind} found in the notebook namespace; name one explicitly")
    raise UsageError(f"%ort: several {kind}s in the namespace ({', '.join(sorted(found))}); name the one to use")


def _snapshot(model, optimizer) -> dict:
    import torch

    snap = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "numpy_rng": None,
    }
    np = sys.modules.get("numpy")
    if np is not None:
        snap["numpy_rng"] = np.random.get_state()
    return snap


def _restore(snap: dict, model, optimizer) -> None:
    import torch

    model.load_state_dict(snap["model"])
    if optimizer is not None and snap["optimizer"] is not None:
        optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
    torch.set_rng_state(snap["torch_rng"])
    random.setstate(snap["python_rng"])
    if snap["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(snap["cuda_rng"])
    if snap["numpy_rng"] is not None:
        sys.modules["numpy"].random.set_state(snap["numpy_rng"])


@magics_class
class OrtMagics(Magics):
    """%ort / %%ort."""

    def __init__(self, shell):
        super().__init__(shell)
        self.accelerated = {}  # name -> (model, optimizer, device)
        self.last_tracking_uri = None

    # ---------------------------------------------------------------- dispatch
    @line_cell_magic
    def ort(self, line, cell=None):
        """%ort accelerate|off|status ...  |  %%ort [accelerated|baseline|compare] ... (see --help)"""
        __tracebackhide__ = True
        if cell is None:
            words = line.split()
            sub = words[0] if words else "status"
            rest = line.strip()[len(sub):]
            if sub == "accelerate":
                return self._accelerate(rest)
            if sub == "off":
                return self._off(rest)
            if sub == "status":
                return self._status(rest)
            raise UsageError(f"%ort: unknown command {sub!r}; use accelerate, off or status (or %%ort for a cell)")
        return self._cell(line, cell)

    # ---------------------------------------------------------------- line magics
    @magic_arguments()
    @argument("model", nargs="?", help="the module to accelerate (default: the one nn.Module with parameters)")
    @argument("--optimizer", default=None, help="its optimizer (default: the one torch.optim.Optimizer)")
    @argument("--device", default=None, choices=["cpu", "cuda"],
              help="default: cpu, or the device the model is already accelerated on")
    @argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
              help="matmul precision: bf16 (CPU with avx512_bf16/AMX, or CUDA), fp16 (CUDA, with the dynamic loss scaler)")
    @argument("--no-cuda-graphs", action="store_true",
              help="CUDA: launch every kernel instead of replaying each step's recorded CUDA graphs")
    @argument("--strict", action="store_true", help="fail instead of falling back to PyTorch")
    def _accelerate(self, line):
        """%ort accelerate [MODEL] [--optimizer OPT] [--device cpu|cuda] [--precision fp32|bf16|fp16]
        [--no-cuda-graphs] [--strict]"""
        args = parse_argstring(self._accelerate, line)
        eng = engine()
        from ortrain._steps import find_modules, find_optimizers

        ns = self.shell.user_ns
        name, model = _pick("model (nn.Module with parameters)", find_modules(ns), args.model, ns)
        optimizers = find_optimizers(ns)
        opt = None
        if args.optimizer or optimizers:
            _, opt = _pick("optimizer", optimizers, args.optimizer, ns)
        try:
            eng["accelerate"](model, opt, device=args.device, strict=args.strict, precision=args.precision,
                              cuda_graphs=False if args.no_cuda_graphs else None)
        except ValueError as exc:
            raise UsageError(f"%ort accelerate: {exc}") from None
        from ortrain.data_parallel import unwrap

        device = unwrap(model).__dict__["_ortrain_state"].device
        self.accelerated[name] = (model, opt, device)
        nparams = sum(p.numel() for p in model.parameters())
        explain = (eng["explain"](model) or "").strip().splitlines()
        print(f"ortrain: {name} ({type(model).__name__}, {nparams:,} parameters) runs in the engine on "
              f"{device}" + (f"; {explain[0]}" if explain else ""))

    def _off(self, line):
        """%ort off: plain PyTorch again (same parameters, same optimizer state)."""
        eng = engine()
        if not self.accelerated:
            print("ortrain: nothing is accelerated")
            return
        for name, (model, _, _) in list(self.accelerated.items()):
            if eng["is_accelerated"](model):
                eng["deaccelerate"](model)
            del self.accelerated[name]
            print(f"ortrain: {name} runs in plain PyTorch again")

    def _status(self, line):
        """%ort status: what is accelerated and where metrics go."""
        from ortrain import tracking

        eng = engine()
        if self.accelerated:
            for name, (model, _, device) in self.accelerated.items():
                on = eng["is_accelerated"](model)
                print(f"  {name}: {type(model).__name__} on {device} ({'accelerated' if on else 'plain PyTorch'})")
        else:
            print("  no model accelerated (use %ort accelerate)")
        uri = self.last_tracking_uri or tracking.resolve_tracking_uri(None, start=False)
        print(f"metrics go to: {uri}")

    # ---------------------------------------------------------------- cell magic
    @magic_arguments()
    @argument("mode", nargs="?", default="accelerated", help="accelerated (default) | baseline | compare")
    @argument("--experiment", default=None, help="MLflow experiment name (default: 'ortrain')")
    @argument("--run-name", default=None)
    @argument("--tracking-uri", default=None, help="http(s)://HOST:PORT, databricks; default: a local server")
    @argument("--max-steps", type=int, default=None, help="stop the cell after N optimizer steps")
    @argument("--log-every", type=int, default=10, help="plain progress line every N steps")
    @argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    @argument("--check", action="store_true", help="parity check: run both for a few steps, then the first batch op by op; names the first diverging step and operator")
    def _cell_args(self, line):
        """%%ort [MODE] [--experiment NAME] [--run-name NAME] [--tracking-uri URI] [--max-steps N]
        [--log-every N] [--no-progress] [--check]"""

    def _cell(self, line, cell):
        __tracebackhide__ = True
        from ortrain._cellrun import run_cell_magic

        args = parse_argstring(self._cell_args, line)
        if args.mode not in MODES:
            raise UsageError(f"%%ort: unknown mode {args.mode!r}; use one of {', '.join(MODES)}")
        if args.max_steps is not None and args.max_steps < 1:
            raise UsageError("%%ort: --max-steps must be at least 1")
        if args.log_every < 1:
            raise UsageError("%%ort: --log-every must be at least 1")
        if not cell.strip():
            raise UsageError("%%ort: the cell is empty")
        return run_cell_magic(self, args, cell)


def load_ipython_extension(ipython):
    ipython.register_magics(OrtMagics)


def unload_ipython_extension(ipython):
    ipython.magics_manager.registry.pop("OrtMagics", None)
