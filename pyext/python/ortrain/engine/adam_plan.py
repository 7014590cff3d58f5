"""The engine Adam/AdamW step's plan of one parameter group, reused from step to step.

engine/optimizer.py's general path checks every parameter, gradient and state tensor before each
step and counts each parameter's step in its own 0-dim tensor: about 250 µs of Python for the
tutorial model's 27 parameters on a 2-core AMD EPYC, more than the update itself takes on the GPU.
After a step in which every parameter of a group had a gradient the engine took, a plan records
what those checks found: the parameters, their state tensors and addresses. The step counts then
live in one float32 vector, each parameter's `state["step"]` a 0-dim view of its element (still
a float32 CPU tensor, as torch keeps it: state_dict(), load_state_dict() and torch's own step see
no difference), so that counting a step is one add. A later step takes the plan where one pass
finds it still true: the same parameters at the same addresses, a dense contiguous float32
gradient on the plan's device for each, the same state tensors. Anything else (a parameter
without a gradient, state loaded or replaced, a group edited) takes the general path, which
makes a new plan where it can.
"""
from __future__ import annotations

import torch

from ortrain import _ortrain

_F32 = torch.float32
_STRIDED = torch.strided


class AdamPlan:
    """What the general path found true of one group's parameters in its last step."""

    def __init__(self, opt, group: dict, device: int):
        """`device`: the parameters' CUDA device index, or -1 on the CPU."""
        params = group["params"]
        self.group = group
        self.params_list = params
        self.params = tuple(params)
        self.device = device
        states = [opt.state[p] for p in params]
        self.counts = torch.tensor([float(st["step"]) for st in states], dtype=_F32)
        for i, st in enumerate(states):
            st["step"] = self.counts[i]
        self.state = [(st["exp_avg"], st["exp_avg_sq"], st["step"]) for st in states]
        self.param_ptrs = tuple(p.data_ptr() for p in params)
        self.rows = [(p.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel()) for p, (m, v, _) in zip(params, self.state)]

    def grads(self, opt) -> list | None:
        """Each parameter's gradient where the plan still holds for this step, else None."""
        params = self.group["params"]
        if params is not self.params_list or len(params) != len(self.params):
            return None
        grads = []
        state = opt.state
        for p, mine, ptr, (m, v, s) in zip(params, self.params, self.param_ptrs, self.state):
            g = p.grad
            if (p is not mine or g is None or g.dtype is not _F32 or g.layout is not _STRIDED or not g.is_contiguous()
                    or g.get_device() != self.device or p.data_ptr() != ptr):
                return None
            st = state.get(p)
            if st is None or st.get("exp_avg") is not m or st.get("exp_avg_sq") is not v or st.get("step") is not s:
                return None
            grads.append(g)
        return grads


def _plans(opt) -> list:
    """Per parameter group (by its index in opt.param_groups): its AdamPlan, or None."""
    plans = opt.__dict__.setdefault("_ortrain_plans", [])
    if len(plans) != len(opt.param_groups):
        plans[:] = [None] * len(opt.param_groups)
    return plans


def remember(opt, index: int, device: int) -> None:
    """Makes the plan of group `index` after a general step that updated all its parameters on
    `device`."""
    group = opt.param_groups[index]
    if group["params"]:
        _plans(opt)[index] = AdamPlan(opt, group, device)


def forget(opt, index: int) -> None:
    _plans(opt)[index] = None


def step_group(opt, index: int, keep: dict, hyper: tuple) -> list | None:
    """Updates group `index` through its plan with `hyper` (engine/optimizer.py's `adam_hyper`):
    the parameters left for PyTorch's step (none, or those of a failed GPU launch), or None
    (nothing done) where it has no plan or the plan no longer holds. `keep`: id(param) ->
    (param, copy) deferred copies; those this step writes are removed from it."""
    plan = _plans(opt)[index]
    group = opt.param_groups[index]
    if plan is None or plan.group is not group:
        return None
    grads = plan.grads(opt)
    if grads is None:
        forget(opt, index)
        return None
    plan.counts.add_(1)
    steps = [int(c) for c in plan.counts.tolist()]
    copies = [keep.pop(id(p), None) for p in plan.params] if keep else None
    if plan.device < 0:
        todo = [(p, g.data_ptr(), m, v, n, t) for (p, m, v, n), g, t in zip(plan.rows, grads, steps)]
        keeps = None if copies is None else [0 if k is None else k[1].data_ptr() for k in copies]
        _ortrain.adam_step(todo, *hyper, keep=keeps)
        return []
    if copies is not None and any(k is not None for k in copies):
        pairs = [k for k in copies if k is not None]
        torch._foreach_copy_([c for _, c in pairs], [p for p, _ in pairs])  # before the update, in stream order
    from .optimizer import gpu_adam_rows

    left = gpu_adam_rows(opt, [(p, g.data_ptr(), m, v, n) for (p, m, v, n), g in zip(plan.rows, grads)], steps,
                         hyper, torch.device("cuda", plan.device))
    if left:
        forget(opt, index)
        torch._foreach_sub_([plan.state[i][2] for i in left], 1)  # PyTorch's step counts them
    return [plan.params[i] for i in left]
