"""torch.optim.Adam / AdamW / SGD whose step() runs in the engine over the same parameter,
gradient and state memory. The optimizer object keeps its class hierarchy, param_groups and
state (so state_dict() loads into plain PyTorch and back), step hooks keep working. CPU
parameters: Adam/AdamW and SGD in one parallel pass; GPU parameters: Adam/AdamW as one
multi-tensor kernel launch per group (kernels/optim.cu), SGD in PyTorch."""
from __future__ import annotations

import functools
import weakref

import torch

from ortrain import _ortrain
from ortrain._warn import warn
from ortrain.engine import adam_plan
from ortrain.engine.cuda_device import engine_device, stream as device_stream
from ortrain.engine.gpu_tables import device_tables
from ortrain.engine.tensors import addressable, local_part

_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

#: (parameter, copy, owner) whose copy the next engine Adam/AdamW step writes with the
#: parameter's values before it changes them, in the same pass (engine/lazy.py keeps the
#: parameters of a fused call's unread logits so: a copy pass of its own would read them again)
_DEFERRED: list = []


def step_keeps_copies(opt) -> bool:
    """Whether `opt.step()` can write parameter copies in its own pass (the engine's Adam/AdamW)."""
    return getattr(opt, "_ortrain_base", None) is not None and isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


def defer_copies(params, copies, owner) -> None:
    """copies[i] receives params[i]'s values in the next engine Adam/AdamW step, before the update.
    `owner` (an object with a `snapshot` attribute) loses its snapshot if that step never comes."""
    _DEFERRED.extend((p, c, owner) for p, c in zip(params, copies))


def drop_stale_copies() -> None:
    """Deferred copies no step took (a step that never ran): their owners lose the snapshot, so that
    reading it raises instead of returning parameters from the wrong moment."""
    for _, _, owner in _DEFERRED:
        owner.snapshot = None
    _DEFERRED.clear()


def _parts(p: torch.Tensor) -> tuple:
    """(p, its gradient) as the plain tensors the update reads and writes (a DTensor's local
    shards, engine/tensors.py `local_part`), or (None, None) where they are not such a pair."""
    g = p.grad
    if g is None:
        return None, None
    if addressable(p) and addressable(g):
        return p, g
    if addressable(p) or addressable(g) or getattr(p, "placements", None) != getattr(g, "placements", None):
        return None, None
    lp, lg = local_part(p), local_part(g)
    if lp is None or lg is None or lp.shape != lg.shape:
        return None, None
    return lp, lg


def _engine_ok(p: torch.Tensor) -> bool:
    p, g = _parts(p)
    return (g is not None and p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and not g.is_sparse and g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu")


#: Adam options whose update only PyTorch has: amsgrad (a third state the engine lacks),
#: fused and capturable (torch's own kernels, which expect their step counts on the device)
_TORCH_ONLY_OPTIONS = ("amsgrad", "fused", "capturable")


def _torch_only_option(group: dict) -> str | None:
    """The option of a param group whose update only PyTorch has, or None. `fused` over CPU
    parameters is only torch's choice of kernel for the same update, its step counts on the CPU
    as the engine keeps them: the engine steps such a group (Hugging Face's Trainer makes
    AdamW(fused=True))."""
    for option in _TORCH_ONLY_OPTIONS:
        if group.get(option) and not (option == "fused" and all(p.device.type == "cpu" for p in group["params"])):
            return option
    return None


def _state_ok(opt, p: torch.Tensor, state: dict, moments: tuple) -> bool:
    """Whether existing optimizer state is what the engine writes through addresses: each of
    `moments` a contiguous float32 tensor of p's shape on p's device, and the step (if any) a
    one-element float32 CPU tensor. State from load_state_dict, edited by hand or left on
    another device goes to PyTorch's step instead (which checks it and says what is wrong),
    never to a kernel that would read the wrong memory. The tensors found good are remembered
    per parameter (`opt._ortrain_checked`), so a step checks each parameter's state once, not
    every time (2.6 µs a parameter)."""
    held = tuple(state.get(k) for k in (*moments, "step"))
    checked = opt.__dict__.setdefault("_ortrain_checked", {})
    seen = checked.get(id(p))
    if seen is not None and len(seen) == len(held) and all(a is b for a, b in zip(seen, held)):
        return True
    if not _state_tensors_ok(p, state, moments):
        return False
    checked[id(p)] = held
    return True


def _state_tensors_ok(p: torch.Tensor, state: dict, moments: tuple) -> bool:
    for k in moments:
        t = state.get(k)
        if not (isinstance(t, torch.Tensor) and t.device == p.device and t.dtype == torch.float32
                and t.shape == p.shape and t.is_contiguous() and not t.is_sparse):
            return False
        # a DTensor parameter's state: shards laid out as the parameter's (FSDP2), whole otherwise
        if getattr(t, "placements", None) != getattr(p, "placements", None):
            return False
        part = local_part(t)
        if part is None or part.shape != local_part(p).shape or not part.is_contiguous():
            return False
    step = state.get("step")
    return step is None or (isinstance(step, torch.Tensor) and step.device.type == "cpu"
                            and step.dtype == torch.float32 and step.numel() == 1)


def _gpu_ok(p: torch.Tensor) -> bool:
    """An f32 parameter with a dense f32 gradient on its GPU, while the engine's GPU update works
    in this process and the engine's CUDA runtime works on that GPU."""
    p, g = _parts(p)
    if not (_GPU_UPDATE_WORKS[0] and g is not None and p.is_cuda and p.dtype == torch.float32 and p.is_contiguous()
            and not g.is_sparse and g.dtype == torch.float32 and g.is_contiguous() and g.device == p.device):
        return False
    from ortrain.cuda import cuda_available

    return cuda_available(p.device.index)[0]


#: False once a launch of the engine's GPU update failed: PyTorch's step takes those parameters
_GPU_UPDATE_WORKS = [True]


def gpu_adam_rows(opt, rows: list, steps: list, hyper: tuple, device: torch.device) -> list:
    """One engine launch per step count updates the parameters on GPU `device` given as `rows`
    ((param, grad, exp_avg, exp_avg_sq addresses, numel) each, at step count `steps[i]`, with
    `hyper` (lr, beta1, beta2, eps, weight_decay, decoupled, maximize)): kernels/optim.cu's
    multi-tensor Adam, queued on the device's current stream, instead of torch's foreach kernels,
    over the descriptor table and chunk lists gpu_tables.py keeps per set of rows. Returns the
    indices of the rows it did not update: none, or (a launch failed: warned once, and the
    engine's GPU update is off for the process) those of that launch and the ones after it."""
    stream = device_stream(device)
    cache = opt.__dict__.setdefault("_ortrain_gpu_chunks", {})  # rows -> gpu_tables.device_tables
    by_step: dict = {}
    for i, t in enumerate(steps):
        by_step.setdefault(t, []).append(i)
    groups = list(by_step.items())
    for k, (step, idx) in enumerate(groups):
        table, chunk_tensor, chunk_start = device_tables(cache, tuple(rows[i] for i in idx), device)
        try:
            with engine_device(device):
                _ortrain.cuda_adam_step(table.data_ptr(), chunk_tensor.data_ptr(), chunk_start.data_ptr(), chunk_tensor.numel(),
                                        *hyper, step, stream, device=device.index)
        except _ortrain.EngineError as exc:
            _GPU_UPDATE_WORKS[0] = False
            warn(f"ortrain: the engine's GPU Adam update failed ({str(exc).splitlines()[0]}); PyTorch's step updates "
                 "the GPU parameters from now on")
            return [i for _, later in groups[k:] for i in later]
    return []


def adam_hyper(group: dict, decoupled: bool) -> tuple:
    """A group's (lr, beta1, beta2, eps, weight_decay, decoupled, maximize) as the engine's Adam
    calls take them; `decoupled`: AdamW (the group's decoupled_weight_decay also makes it so)."""
    b1, b2 = group["betas"]
    return (float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
            decoupled or bool(group.get("decoupled_weight_decay", False)), bool(group.get("maximize", False)))


def _gpu_adam(opt, todo: list, hyper: tuple) -> list:
    """gpu_adam_rows over `todo` ((param, grad, exp_avg, exp_avg_sq, step) each), per GPU. Returns
    the parameters it did not update, their step counts taken back for PyTorch's step to count
    them."""
    by_device: dict = {}
    for t in todo:
        by_device.setdefault(t[0].device, []).append(t)
    left = []
    for device, part in by_device.items():
        rows = [(lp.data_ptr(), lg.data_ptr(), local_part(m).data_ptr(), local_part(v).data_ptr(), lp.numel())
                for lp, lg, m, v in ((*_parts(p), m, v) for p, _, m, v, _ in part)]
        left += [part[i][0] for i in gpu_adam_rows(opt, rows, [t[4] for t in part], hyper, device)]
    if left:
        torch._foreach_sub_([opt.state[p]["step"] for p in left], 1)
    return left


def _adam_group(opt, group, created: list, keep: dict) -> tuple:
    """Engine-updatable params of an Adam group, a flag per param (its moments were created here,
    uninitialised: the engine writes them as if they were zeros, bitwise as from torch.zeros;
    they are also appended to `created`), per param the address of its deferred copy (0: none;
    `keep`: id(param) -> (param, copy)), the ids of those, the params left for PyTorch, and the
    GPU params ((param, grad, exp_avg, exp_avg_sq, step) each). Skipping the zero fill saves
    writing and then reading 2 x the parameters' bytes in the first step (~0.1 s on the tutorial
    model). The step counts (0-dim CPU tensors, as torch keeps them) are counted in one foreach
    add (~3x cheaper than one in-place add per parameter)."""
    cpu, gpu, fresh, rest, keeps, kept, gpu_copies = [], [], [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        on_cpu = not torch.is_complex(p) and _engine_ok(p)
        if not on_cpu and (torch.is_complex(p) or not _gpu_ok(p)):
            rest.append(p)
            continue
        state = opt.state[p]
        new = len(state) == 0
        if not new and not _state_ok(opt, p, state, ("exp_avg", "exp_avg_sq")):
            rest.append(p)
            continue
        if new:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if on_cpu:
                state["exp_avg"] = torch.empty_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.empty_like(p, memory_format=torch.preserve_format)
                created += [state["exp_avg"], state["exp_avg_sq"]]
            else:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        k = keep.get(id(p))
        if k is not None:
            kept.append(id(p))
        if on_cpu:
            cpu.append(p)
            fresh.append(new)
            keeps.append(0 if k is None else k[1].data_ptr())
        else:
            gpu.append(p)
            if k is not None:
                gpu_copies.append(k)
    if gpu_copies:  # the GPU update has no copy pass: queued now, before it
        torch._foreach_copy_([c for _, c in gpu_copies], [p for p, _ in gpu_copies])
    states = [opt.state[p] for p in cpu + gpu]
    counts = [st["step"] for st in states]
    if counts:
        torch._foreach_add_(counts, 1)
    steps = [int(c.item()) for c in counts]
    todo = [(lp.data_ptr(), lg.data_ptr(), local_part(st["exp_avg"]).data_ptr(), local_part(st["exp_avg_sq"]).data_ptr(),
             lp.numel(), t) for (lp, lg), st, t in zip(map(_parts, cpu), states, steps)]
    gpu_todo = [(p, p.grad, st["exp_avg"], st["exp_avg_sq"], t)
                for p, st, t in zip(gpu, states[len(cpu):], steps[len(cpu):])]
    return todo, fresh, keeps, kept, rest, gpu_todo


def _engine_step(self, closure=None):
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    leftovers = []
    keep: dict = {}
    try:
        with torch.no_grad():
            for p, c, _ in _DEFERRED:
                if id(p) in keep:  # a second copy of the same parameter: now, it is unchanged yet
                    c.copy_(p)
                else:
                    keep[id(p)] = (p, c)
            _DEFERRED.clear()
            decoupled = isinstance(self, torch.optim.AdamW)
            for index, group in enumerate(self.param_groups):
                if _torch_only_option(group) is not None:
                    # a group added (or changed) after accelerate_optimizer with an option the
                    # engine lacks: PyTorch steps it
                    leftovers += [p for p in group["params"] if p.grad is not None]
                    continue
                if isinstance(self, torch.optim.SGD):
                    leftovers += _sgd_group(self, group)
                    continue
                hyper = adam_hyper(group, decoupled)
                left = adam_plan.step_group(self, index, keep, hyper)
                if left is not None:
                    leftovers += left
                    continue
                created: list = []
                try:
                    todo, fresh, keeps, kept, rest, gpu = _adam_group(self, group, created, keep)
                    leftovers += rest
                    if todo:
                        _ortrain.adam_step(todo, *hyper, fresh=fresh, keep=keeps)
                    left = _gpu_adam(self, gpu, hyper) if gpu else []
                    leftovers += left
                    for i in kept:
                        del keep[i]
                    # every parameter updated, all on one device
                    gpus = {t[0].device for t in gpu}
                    if (not left and not (todo and gpu) and len(gpus) <= 1
                            and len(todo) + len(gpu) == len(group["params"])
                            and all(addressable(p) for p in group["params"])):
                        adam_plan.remember(self, index, -1 if todo else gpus.pop().index)
                except BaseException:
                    for moment in created:  # never leave uninitialised moments behind
                        moment.zero_()
                    raise
    finally:
        # deferred copies the engine pass did not write (parameters it does not update, a step
        # that failed before updating anything): their parameters are unchanged so far
        with torch.no_grad():
            for p, c in keep.values():
                c.copy_(p)
    # the engine wrote the parameters through their addresses: bump their autograd versions as an
    # in-place torch update would, so that stale saved tensors are detected like in PyTorch
    stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
    torch.autograd.graph.increment_version(stepped)
    # (parameters the engine updated, parameters updated) in this step, for explain()
    self.__dict__["_ortrain_last_step"] = (len(stepped) - len(leftovers), len(stepped))
    if leftovers:
        _torch_step_for(self, leftovers)
    return loss


def describe_last_step(opt) -> str:
    """Empty where the engine updated every parameter of the optimizer's last step, else how many."""
    done, total = getattr(opt, "__dict__", {}).get("_ortrain_last_step", (0, 0))
    if done == total:
        return ""
    return f" ({done} of {total} parameters in its last step, the others in PyTorch)"


def _sgd_group(opt, group) -> list:
    todo, rest = [], []
    momentum = float(group["momentum"])
    for p in group["params"]:
        if p.grad is None:
            continue
        if not _engine_ok(p):
            rest.append(p)
            continue
        buf_addr, first = 0, False
        if momentum != 0.0:
            state = opt.state[p]
            buf = state.get("momentum_buffer")
            if buf is not None and not _state_ok(opt, p, state, ("momentum_buffer",)):
                rest.append(p)
                continue
            if buf is None:
                buf = torch.empty_like(p)
                state["momentum_buffer"] = buf
                first = True
            buf_addr = local_part(buf).data_ptr()
        lp, lg = _parts(p)
        todo.append((lp.data_ptr(), lg.data_ptr(), buf_addr, lp.numel(), first))
    _ortrain.sgd_step(todo, float(group["lr"]), momentum, float(group["dampening"]),
                      float(group["weight_decay"]), bool(group["nesterov"]), bool(group.get("maximize", False)))
    return rest


def _torch_step_for(opt, params: list) -> None:
    """Runs PyTorch's own update for parameters the engine cannot take (e.g. sparse grads)."""
    keep = {id(p) for p in params}
    saved = [g["params"] for g in opt.param_groups]
    try:
        for g in opt.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        opt._ortrain_base.step(opt)
    finally:
        for g, ps in zip(opt.param_groups, saved):
            g["params"] = ps


def _stays_in_pytorch(msg: str, strict: bool) -> bool:
    """accelerate_optimizer's refusal: an UnsupportedError under `strict`, else a warning and False."""
    if strict:
        from ortrain.errors import UnsupportedError
        raise UnsupportedError(msg)
    warn(msg)
    return False


def engine_type(opt) -> bool:
    """Whether `opt` is a torch Adam, AdamW or SGD itself (not a subclass): what the engine steps."""
    return type(opt) in _SUPPORTED


def accelerate_optimizer(opt, strict: bool = False) -> bool:
    """Makes `opt.step()` run in the engine. Returns False (with a warning) where it cannot."""
    if getattr(opt, "_ortrain_base", None) is not None:
        return True
    if not isinstance(opt, _SUPPORTED) or type(opt) not in _SUPPORTED:
        return _stays_in_pytorch(f"ortrain: {type(opt).__name__}.step() keeps running in PyTorch (the engine has "
                                 "Adam, AdamW and SGD); gradients still land in each parameter's .grad", strict)
    shard = next((p for g in opt.param_groups for p in g["params"] if local_part(p) is None), None)
    if shard is not None:
        return _stays_in_pytorch(f"ortrain: {type(opt).__name__}.step() keeps running in PyTorch: its parameters are "
                                 f"{type(shard).__name__}s, a tensor subclass whose elements the engine's update "
                                 "cannot reach", strict)
    for g in opt.param_groups:
        # amsgrad: a third state the engine lacks; fused/capturable: torch's own kernels, which
        # expect their step counts on the device (the engine keeps them on the CPU, as torch's
        # default Adam does), so a later fallback step could not take over the state
        option = _torch_only_option(g)
        if option is not None:
            return _stays_in_pytorch(f"ortrain: {type(opt).__name__}({option}=True) is not supported by the engine; "
                                     "step() stays in PyTorch", strict)
    base = type(opt)
    cls = type(f"Ortrain{base.__name__}", (base,), {"step": _engine_step, "__module__": __name__,
                                                     "__qualname__": f"Ortrain{base.__name__}"})
    opt._ortrain_base = base
    opt.__class__ = cls
    opt._patch_step_function()  # torch wraps step() with its pre/post hook machinery
    _follow_class_step(opt)
    return True


def _follow_class_step(opt) -> None:
    """An LR scheduler made before the optimizer was accelerated wrapped `opt.step` on the
    instance around the class's step function of then (torch's `patch_track_step_called`): every
    `opt.step()` kept running PyTorch's update. That wrapper becomes one that calls the step of
    the optimizer's class at call time (the engine's now, PyTorch's again after
    restore_optimizer), still marking the call for the scheduler's order check."""
    wrapped = vars(opt).get("step")
    if wrapped is None or not getattr(wrapped, "_wrapped_by_lr_sched", False):
        return
    opt_ref = weakref.ref(opt)

    @functools.wraps(type(opt).step)
    def step(*args, **kwargs):
        owner = opt_ref()
        owner._opt_called = True
        return type(owner).step(owner, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    opt.step = step


def restore_optimizer(opt) -> None:
    base = getattr(opt, "_ortrain_base", None)
    if base is not None:
        opt.__class__ = base
        del opt._ortrain_base
