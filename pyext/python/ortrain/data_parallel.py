"""Data-parallel wrappers around an accelerated module.

`DistributedDataParallel` (one process per device, as torchrun and Spark's TorchDistributor
start them) all-reduces gradients from hooks on the parameters' gradient accumulators, which
fire when the engine's backward hands PyTorch the weight gradients. So ortrain takes over the
module *inside* the wrapper, in either order (`DDP(accelerate(m, opt))` or
`accelerate(DDP(m), opt)`), and the wrapper's forward (broadcasts, reducer bookkeeping) still
runs around it. Taking over the wrapper itself would bypass that forward: every rank would
train on its own gradients, silently.

A DDP that looks for the parameters its output was computed from (`find_unused_parameters=True`,
and `static_graph=True` in its first step) walks the output's autograd graph, which a deferred
output (engine/lazy.py) does not have yet; under such a wrapper the module returns computed
outputs, and the loss runs in PyTorch."""
from __future__ import annotations

import torch

from ortrain.errors import OrtrainError


def _ddp_class():
    return getattr(torch.nn.parallel, "DistributedDataParallel", None)


def unwrap(model):
    """The module a data-parallel wrapper holds (`.module`), else `model`."""
    ddp = _ddp_class()
    if (ddp is not None and isinstance(model, ddp)) or isinstance(model, torch.nn.DataParallel):
        return model.module
    return model


def to_accelerate(model):
    """The module ortrain takes over when asked to accelerate `model`: [`unwrap`]'s.

    `nn.DataParallel` over several GPUs copies the module to each GPU in every forward (the
    copies would not be accelerated, and the CUDA engine runs on one GPU): an error that says to
    use DistributedDataParallel. Over one device or none it calls its module directly."""
    if isinstance(model, torch.nn.DataParallel) and len(model.device_ids) > 1:
        raise OrtrainError(f"nn.DataParallel over {len(model.device_ids)} GPUs ({model.device_ids}) copies the "
                           "model to each GPU in every forward, and ortrain's engine runs one copy on one device; "
                           "use DistributedDataParallel, one process per GPU (torchrun, TorchDistributor)")
    return unwrap(model)


def outputs_traced() -> bool:
    """Whether the DistributedDataParallel whose forward is running now looks for the
    parameters its output was computed from in the output's autograd graph (DDP's `_DDPSink`:
    `find_unused_parameters=True`, or `static_graph=True`)."""
    ddp = _ddp_class()
    active = getattr(ddp, "_active_ddp_module", None) if ddp is not None else None
    if active is None:
        return False
    return bool(getattr(active, "find_unused_parameters", False) or getattr(active, "static_graph", False))


#: gradients are all-reduced in flat buckets of about this many bytes (DDP's default bucket size)
_BUCKET_BYTES = 25 << 20


class TrainerGroup:
    """ORTTrainer's data parallelism (`options['distributed']`), as ONNX Runtime Training's was:
    every rank holds the whole model, trains on its own batches, and the gradients are averaged
    over the ranks before each update: after every micro-batch, or once after the accumulated
    ones with `allreduce_post_accumulation` (the same average, fewer all-reduces). The ranks
    talk through torch.distributed: a process group made by the caller (torchrun,
    TorchDistributor) or, when none is, one made here from the options' rank and size and the
    environment's MASTER_ADDR / MASTER_PORT (gloo: ORTTrainer runs on the CPU).

    ZeRO stage 1 (`deepspeed_zero_optimization: {"stage": 1}`): the parameters are split into
    one part per rank (`owners`); each rank keeps the optimizer state of its part only and updates
    only it, then every part is broadcast from its rank (`share_updates`). The averaged
    gradients are on every rank, so clipping is the same everywhere."""

    def __init__(self, options: dict):
        import os

        import torch.distributed as dist

        self.rank, self.size = options["world_rank"], options["world_size"]
        self.post_accumulation = options["allreduce_post_accumulation"]
        self.zero_stage = options["deepspeed_zero_optimization"].get("stage", 0)
        self._owners: dict = {}  # names -> the rank of each (owners())
        where = f"options['distributed'] (world_rank {self.rank}, world_size {self.size})"
        if not dist.is_available():
            raise OrtrainError(f"{where}: this PyTorch build has no torch.distributed")
        if not dist.is_initialized():
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:
                raise OrtrainError(f"{where}: torch.distributed has no process group and {' and '.join(missing)} "
                                   f"{'is' if len(missing) == 1 else 'are'} not set; start the script with torchrun "
                                   "(or TorchDistributor), or call torch.distributed.init_process_group() first")
            dist.init_process_group("gloo", rank=self.rank, world_size=self.size)
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.size):
            raise OrtrainError(f"{where}: the torch.distributed process group has rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}; pass world_rank=dist.get_rank(), "
                               "world_size=dist.get_world_size()")
        self._dist = dist

    @staticmethod
    def from_options(options: dict) -> "TrainerGroup | None":
        """The group of `options['distributed']`, or None for a single process."""
        return TrainerGroup(options) if options["world_size"] > 1 else None

    def broadcast(self, tensors) -> None:
        """Rank 0's values into every rank's `tensors` (the weights every rank starts from)."""
        _in_flat_buckets([t.detach() for t in tensors], lambda flat: self._dist.broadcast(flat, 0))

    def owners(self, named: list) -> list:
        """The rank whose part each of `named` ((name, tensor) pairs, the same order on every rank)
        is in: parameters in order, each to the rank with the fewest elements so far, so the
        parts are about equal and every rank computes the same split."""
        key = tuple(n for n, _ in named)
        if key not in self._owners:
            load = [0] * self.size
            out = []
            for _, t in named:
                r = min(range(self.size), key=lambda k: load[k])
                load[r] += t.numel()
                out.append(r)
            self._owners[key] = out
        return self._owners[key]

    def share_updates(self, named: list) -> None:
        """After each rank updated its part of `named` ((name, parameter) pairs): every rank gets
        every part, broadcast from the rank that updated it."""
        owners = self.owners(named)
        for r in range(self.size):
            part = [t.detach() for (_, t), o in zip(named, owners) if o == r]
            _in_flat_buckets(part, lambda flat, src=r: self._dist.broadcast(flat, src))

    def average(self, grads) -> None:
        """Every rank's `grads` become their mean over the ranks, in place."""
        def mean(flat):
            self._dist.all_reduce(flat)
            flat.div_(self.size)

        _in_flat_buckets([g for g in grads if g is not None], mean)


def _in_flat_buckets(tensors, op) -> None:
    """Applies the in-place collective `op` to `tensors` bucket by bucket: each bucket copied
    into one flat tensor, `op` on it, the result copied back."""
    for bucket in _buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        op(flat)
        _scatter(flat, bucket)


def _buckets(tensors):
    """`tensors` in consecutive groups of one dtype and at most about _BUCKET_BYTES."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > _BUCKET_BYTES or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _scatter(flat, tensors) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
