"""The autograd.Function that runs one forward pass in the engine and, when autograd asks for
it, the matching backward pass: parameter gradients are written straight into fresh tensors
that torch then accumulates into `.grad` as usual (hooks, accumulation and clipping keep working)."""
from __future__ import annotations

import torch

from .tensors import address, torch_dtype, triple


def read_outputs(pending, n: int, bound: dict | None = None) -> list:
    """The outputs as torch tensors: copied out of the engine, except those written straight
    into caller tensors (`bound`: output index -> tensor)."""
    outs = []
    for k in range(n):
        if bound and k in bound:
            outs.append(bound[k])
            continue
        _, dt, shape = pending.output(k)
        t = torch.empty(shape, dtype=torch_dtype(dt))
        if t.numel():
            pending.copy_output(k, t.data_ptr())
        outs.append(t)
    return outs


def new_seed() -> int:
    # drawn from torch's generator, so torch.manual_seed makes engine dropout reproducible
    return int(torch.randint(0, 2**62, (1,)).item())


def run_inference(runner, inputs: list, seed: int | None = None, weights: list | None = None) -> list:
    """Forward only (eval, or no_grad): no activations kept. `seed` fixes dropout masks;
    `weights`: addresses to read the weights from instead of the live tensors."""
    seed = new_seed() if seed is None else seed
    if runner.on_cuda:
        from .cuda_step import CudaStep

        step = CudaStep(runner, inputs, False, seed, None, weights)
        try:
            return step.outputs()
        finally:
            step.release()
    pending = runner.session.forward([triple(x, n) for x, n in zip(inputs, runner.input_names)],
                                     runner.weight_addresses() if weights is None else weights, False, seed)
    try:
        return read_outputs(pending, runner.n_outputs)
    finally:
        pending.release()


def grad_addresses(grads: list) -> list:
    """The engine's gradient pointers: 0 where a weight gets no gradient."""
    return [0 if g is None else g.data_ptr() for g in grads]


class EngineFunction(torch.autograd.Function):
    """apply(runner, n_inputs, seed, bound, *inputs, *trainable_params) -> outputs.

    `seed` (None: drawn from torch's generator) fixes dropout masks; `bound` (output index ->
    tensor, or None) are outputs written straight into those tensors."""

    @staticmethod
    def forward(ctx, runner, n_inputs, seed, bound, *tensors):
        inputs = [t.detach().contiguous() for t in tensors[:n_inputs]]
        seed = new_seed() if seed is None else seed
        if runner.on_cuda:
            from .cuda_step import CudaStep

            pending = CudaStep(runner, inputs, True, seed, bound)
            outs = pending.outputs(bound)
        else:
            addrs = None
            if bound:
                addrs = [bound[k].data_ptr() if k in bound else 0 for k in range(runner.n_outputs)]
            # runners whose graph makes gradients in the forward pass (the fused LM head + loss)
            # get the gradient tensors now: the engine writes those straight into them
            grads = runner.new_grad_buffers() if runner.grads_at_forward else None
            pending = runner.session.forward([triple(x, n) for x, n in zip(inputs, runner.input_names)],
                                             runner.weight_addresses(), True, seed, addrs,
                                             None if grads is None else grad_addresses(grads))
            outs = read_outputs(pending, runner.n_outputs, bound)
            ctx.grads = grads
        ctx.bound = bound  # the engine reads them again in the backward pass
        ctx.pending = pending
        ctx.runner = runner
        ctx.n_inputs = n_inputs
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]
        non_diff = [o for o, sd in zip(outs, runner.seeded) if not o.is_floating_point() or not sd]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        runner, pending = ctx.runner, ctx.pending
        ctx.pending = None
        scaler = runner.loss_scaler
        seeds = []  # per output: its gradient (contiguous, the output's type), or None
        for g, (shape, dtype), sd in zip(grad_outputs, ctx.out_meta, runner.seeded):
            if not dtype.is_floating_point or not sd:
                seeds.append(None)
                continue
            if g is None:
                g = torch.zeros(shape, dtype=dtype, device=runner.device)
            g = g.contiguous()
            if g.dtype != dtype:
                g = g.to(dtype)
            if scaler is not None:
                g = scaler.scale_seed(g)
            seeds.append(g)
        grads = getattr(ctx, "grads", None)
        ctx.grads = None
        if runner.on_cuda:
            grads = pending.backward(seeds)
        else:
            if grads is None:
                grads = runner.new_grad_buffers()
            runner.session.backward(pending, runner.weight_addresses(),
                                    [0 if g is None else address(g, "output gradient") for g in seeds],
                                    grad_addresses(grads))
        ctx.bound = None
        trainable = runner.grads_for_trainable(grads)
        if scaler is not None:
            scaler.unscale_(trainable)
        return (None, None, None, None) + (None,) * ctx.n_inputs + tuple(trainable)
