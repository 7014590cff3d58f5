"""Running a `%%ort` cell: baseline, accelerated and compare modes, `--check`, progress output.

The cell body is compiled with IPython's caching compiler under the current cell number (one
blank line prepended so that line numbers match the cell as the user sees it) and executed in the
user namespace; exceptions propagate unchanged after the MLflow run is ended FAILED (KILLED on
Ctrl-C). Frames of ortrain carry `__tracebackhide__` so tracebacks show the user's code.
"""
from __future__ import annotations

import importlib.util
import math
import sys

from IPython.core.error import UsageError

from ortrain._trainer_hooks import pytorch_baseline
from ortrain._runlog import Experiment, RunLog, new_group_id, notebook_name, warn
from ortrain._steps import StepRecorder, StopCell, find_modules, find_optimizers, find_trainers


def _compile(shell, cell: str):
    # IPython strips leading blank lines in transform_cell: put them and the `%%ort` line back so
    # that line numbers in tracebacks are those of the cell as the user sees it
    lines = cell.split("\n")
    blank = next((i for i, ln in enumerate(lines) if ln.strip()), len(lines))
    source = "\n" * (1 + blank) + shell.transform_cell(cell)
    filename = shell.compile.cache(source, shell.execution_count, raw_code="\n" + cell)
    tree = shell.compile.ast_parse(source, filename=filename)
    tree = shell.transform_ast(tree)
    return shell.compile(tree, filename, "exec")


def _exec_cell(shell, code) -> None:
    """Runs the compiled cell in the user namespace; `--max-steps` ends it through StopCell."""
    __tracebackhide__ = True
    try:
        exec(code, shell.user_ns)
    except StopCell:
        pass


class Progress:
    """tqdm.auto bar where it renders (terminal, or a kernel with ipywidgets), else plain lines."""

    def __init__(self, label: str, total, log_every: int, no_progress: bool):
        self.label, self.log_every, self.bar = label, log_every, None
        self.last = None
        in_kernel = "ipykernel" in sys.modules
        widgets = importlib.util.find_spec("ipywidgets") is not None
        if not no_progress and ((in_kernel and widgets) or (not in_kernel and sys.stdout.isatty())):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=label, unit="step")

    def update(self, i: int, m: dict) -> None:
        self.last = (i, m)
        loss = m.get("loss")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({"ms": f"{m['batch_time_ms']:.1f}", "loss": f"{loss:.4f}" if loss is not None else "-"}, refresh=False)
        elif i == 0 or (i + 1) % self.log_every == 0:
            print(self._line(i, m), flush=True)

    def _line(self, i, m):
        loss = m.get("loss")
        ppl = f", ppl {m['ppl']:.1f}" if "ppl" in m else ""
        return (f"[{self.label}] step {i + 1}: {m['batch_time_ms']:.1f} ms/batch"
                + (f", loss {loss:.4f}" if loss is not None else "") + ppl)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.last is not None and not (self.last[0] == 0 or (self.last[0] + 1) % self.log_every == 0):
            print(self._line(*self.last), flush=True)


def _params(model, optimizer, step, mode: str, args, device: str) -> dict:
    import torch

    import ortrain

    p = {"mode": mode, "ortrain_version": ortrain.__version__, "torch_version": torch.__version__,
         "engine_device": device, "max_steps": args.max_steps}
    if model is not None:
        first = next(model.parameters(), None)
        p.update(model_class=type(model).__name__, parameter_count=sum(x.numel() for x in model.parameters()),
                 device=str(first.device) if first is not None else "cpu",
                 precision=str(first.dtype).replace("torch.", "") if first is not None else "-")
    from ortrain.trainer import ORTTrainer

    if isinstance(optimizer, ORTTrainer):  # the step boundary was ORTTrainer.train_step
        cfg = optimizer.optim_config
        p["optimizer"] = type(cfg).__name__
        p["trainer"] = "ORTTrainer"
        for k, v in vars(cfg).items():
            if k != "params" and isinstance(v, (int, float, str, bool, type(None))):
                p[f"optimizer.{k}"] = v
    elif optimizer is not None:
        p["optimizer"] = getattr(optimizer, "_ortrain_base", type(optimizer)).__name__  # the user's class, also when its step runs in the engine
        for k, v in optimizer.param_groups[0].items():
            if k != "params" and isinstance(v, (int, float, str, bool, tuple, type(None))):
                p[f"optimizer.{k}"] = v
    if step.samples:
        p["batch_size"] = step.samples
    return p


def execute(shell, code, run: RunLog, models: list, args, label: str, mode: str, device: str):
    """Runs the compiled cell once with step hooks, logging to `run`. Re-raises user errors."""
    __tracebackhide__ = True
    progress = Progress(label, args.max_steps, args.log_every, args.no_progress)
    model = models[0] if len(models) == 1 else None

    def on_step(step):
        if not run.started:
            try:
                owner = rec.optimizer  # a torch optimizer, or the ORTTrainer whose train_step was the boundary
                run.start(_params(getattr(owner, "model", model) if _is_trainer(owner) else model, owner, step, mode, args, device))
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise RuntimeError(f"ortrain: cannot create the MLflow run at {run.exp.uri}: {e}") from None
            if rec._input is not None:
                run.logger.log_param("batch_shape", "x".join(map(str, rec._input[0])))
            rec.restart_clock()
        progress.update(step.index, run.log_step(step))

    rec = StepRecorder(models, on_step, args.max_steps, list(find_optimizers(shell.user_ns).values()))
    status = "FINISHED"
    try:
        with rec:
            _exec_cell(shell, code)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        progress.close()
        if run.started:
            run.end(status)
        elif status == "FINISHED":
            warn("the cell finished without calling optimizer.step() or ORTTrainer.train_step(): there was no training step to "
                 "measure, so no MLflow run was created. %%ort measures training loops; run other "
                 "cells without it.")
    return rec


def _is_trainer(obj) -> bool:
    from ortrain.trainer import ORTTrainer

    return isinstance(obj, ORTTrainer)


def _summary(eng, model, rec) -> str:
    """The one-line engine summary after an accelerated run: the ORTTrainer's when its
    train_step was the step boundary, else the accelerated module's."""
    if _is_trainer(rec.optimizer):
        return "ortrain engine: " + rec.optimizer.summary()
    return engine_summary(eng, model)


def _tags(mode: str, group: str, ns: dict, role: str | None = None) -> dict:
    t = {"ortrain.mode": mode, "ortrain.compare_group": group}
    if role:
        t["ortrain.role"] = role
    nb = notebook_name(ns)
    if nb:
        t["ortrain.notebook"] = nb
        t["mlflow.source.name"] = nb
    return t


def engine_summary(eng, model) -> str:
    """One line: what ran in the engine (exporter, graph, planned arena) or why it did not."""
    lines = [ln.strip() for ln in eng["explain"](model).splitlines()[1:]]
    plan = next((ln.split(": ", 1)[1] for ln in lines if ln.startswith("plan for inputs")), "")
    head = next((ln for ln in lines if ln.startswith("[train]")), lines[0] if lines else "not called")
    return "ortrain engine: " + head + (f"; {plan}" if plan else "")


def run_cell_magic(mg, args, cell: str):
    __tracebackhide__ = True
    from IPython.display import display

    from ortrain.magics import _pick, _restore, _snapshot, engine

    shell, ns = mg.shell, mg.shell.user_ns
    eng = engine()
    code = _compile(shell, cell)
    import torch  # noqa: F401  (the cell trains with torch; the hooks need it)

    modules = find_modules(ns)
    models = list(modules.values())
    device = next((d for _, _, d in mg.accelerated.values()), "cpu")
    if args.check:
        return _check(shell, code, args, eng, modules, ns, device)
    exp = Experiment(args.tracking_uri, args.experiment or "ortrain")
    mg.last_tracking_uri = exp.uri
    group = new_group_id()

    if args.mode == "baseline":
        restore = [(n, m) for n, m in modules.items() if eng is not None and eng["is_accelerated"](m)]
        for _, m in restore:
            eng["deaccelerate"](m)
        run = RunLog(exp, run_name=args.run_name or "pytorch", tags=_tags("baseline", group, ns, "baseline"), params={})
        try:
            with pytorch_baseline():
                execute(shell, code, run, models, args, "pytorch", "baseline", device)
        finally:
            for n, m in restore:
                _, opt, dev = mg.accelerated.get(n, (m, None, device))
                eng["accelerate"](m, opt, device=dev)
        return None

    trainers = find_trainers(ns)
    name, model = _pick("model (nn.Module with parameters)", modules, None, ns)
    optimizers = find_optimizers(ns)
    opt = _pick("optimizer", optimizers, None, ns)[1] if optimizers else None
    # a model an ORTTrainer already trains runs in the engine through that trainer, not accelerate()
    own_engine = any(t.model is model for t in trainers.values())

    if args.mode == "accelerated":
        if not own_engine and not eng["is_accelerated"](model):
            eng["accelerate"](model, opt, device=device)
            mg.accelerated[name] = (model, opt, device)
        run = RunLog(exp, run_name=args.run_name or "ortrain", tags=_tags("accelerated", group, ns, "accelerated"), params={})
        rec = execute(shell, code, run, [model], args, "ortrain", "accelerated", device)
        print(_summary(eng, model, rec))
        return None

    # compare: PyTorch first, then ortrain, from the same state, as two children of one parent
    snap = _snapshot(model, opt)
    trainer_states = {n: t.state_dict() for n, t in trainers.items()}
    if eng["is_accelerated"](model):
        eng["deaccelerate"](model)
    parent = RunLog(exp, run_name=args.run_name or "compare", tags=_tags("compare", group, ns), params={"mode": "compare"})
    base = RunLog(exp, run_name="pytorch", tags=_tags("baseline", group, ns, "baseline"), params={}, parent=parent)
    acc = RunLog(exp, run_name="ortrain", tags=_tags("accelerated", group, ns, "accelerated"), params={}, parent=parent)
    status = "FINISHED"
    try:
        with pytorch_baseline():
            execute(shell, code, base, [model], args, "pytorch", "baseline", device)
        _restore(snap, model, opt)
        for n, t in trainers.items():
            t.load_state_dict(trainer_states[n])
        if not own_engine:
            eng["accelerate"](model, opt, device=device)
            mg.accelerated[name] = (model, opt, device)
        rec = execute(shell, code, acc, [model], args, "ortrain", "accelerated", device)
        print(_summary(eng, model, rec))
        if base.started and acc.started:
            summary = report_compare(parent, base, acc, display)
            if summary.get("speedup"):
                parent.logger.log_metric("speedup", float(summary["speedup"]), 0)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        parent.end(status)
    return None


def report_compare(parent, base, acc, display) -> dict:
    from ortrain._compare import report

    return report(parent, [("pytorch", base), ("ortrain", acc)], display)


def _check(shell, code, args, eng, modules, ns, device):
    """--check: both implementations on the same batches for a few steps, then the first batch
    op by op (ortrain.check_parity): the first step whose loss differs beyond tolerance and the
    first operator whose output does. Nothing is logged to MLflow; afterwards the model and its
    optimizer are as they were before the cell."""
    __tracebackhide__ = True
    import torch

    from ortrain.magics import _pick, _restore, _snapshot
    from ortrain.parity import check_parity

    name, model = _pick("model (nn.Module with parameters)", modules, None, ns)
    optimizers = find_optimizers(ns)
    opt = _pick("optimizer", optimizers, None, ns)[1] if optimizers else None
    steps = min(args.max_steps or 3, 10)
    losses = {}
    first_batch = []
    snap = _snapshot(model, opt)

    def keep_first_batch(module, call_args, call_kwargs):
        if not first_batch and not (torch.compiler.is_compiling() or torch.jit.is_tracing()):
            copy = torch.utils._pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                                                (call_args, call_kwargs))
            first_batch.append(copy)

    for label in ("pytorch", "ortrain"):
        if label == "ortrain":
            _restore(snap, model, opt)
            eng["accelerate"](model, opt, device=device)
        elif eng["is_accelerated"](model):
            eng["deaccelerate"](model)
        got = []
        rec = StepRecorder([model], lambda s: got.append(s.loss), steps, [opt] if opt is not None else [])
        hook = model.register_forward_pre_hook(keep_first_batch, with_kwargs=True) if label == "pytorch" else None
        try:
            with rec:
                _exec_cell(shell, code)
        finally:
            if hook is not None:
                hook.remove()
        losses[label] = got
    _restore(snap, model, opt)
    diverged = None
    for i, (a, b) in enumerate(zip(losses["pytorch"], losses["ortrain"])):
        if a is None or b is None or not math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5):
            diverged = i
            print(f"ortrain --check: step {i + 1} diverges: PyTorch loss {a}, ortrain loss {b}")
            break
    if diverged is None:
        print(f"ortrain --check: {len(losses['ortrain'])} steps agree (losses within rtol 1e-3)")
    if first_batch:
        (call_args, call_kwargs), = first_batch
        try:
            print(check_parity(model, *call_args, **call_kwargs))
        except Exception as e:  # the op-by-op check is a diagnosis; its failure must not hide the result above
            print(f"ortrain --check: the op-by-op comparison could not run: {type(e).__name__}: {e}")
    if diverged is not None:
        print(eng["explain"](model))
    return None
