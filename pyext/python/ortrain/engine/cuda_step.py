"""The engine step on a CUDA device: the same Runner and autograd.Function as on the CPU, with
every tensor a CUDA tensor on the runner's GPU (inputs, parameters, output-gradient seeds and
gradients, all zero-copy), the work queued on PyTorch's current stream of that GPU (with it
PyTorch's current device for the call: cuda_device.py), and the engine's arena a uint8 CUDA
tensor from PyTorch's caching allocator, kept alive with the step until its backward pass has
been queued (stream order makes its later reuse safe). f32 matmuls follow PyTorch's
`torch.backends.cuda.matmul.allow_tf32` (off by default), read at each step's forward. With the
runner's graph cache (engine/cuda_graphs.py) a step of a known shape runs each phase as one
CUDA graph launch over the cache entry's memory instead."""
from __future__ import annotations

import torch

from ortrain import _ortrain

from .cuda_device import engine_device, stream as _stream
from .tensors import check_addressable, engine_dtype, torch_dtype


def cuda_triple(t: torch.Tensor, what: str, device: torch.device) -> tuple:
    """(device address, dtype, shape) of a contiguous tensor on GPU `device`."""
    if t.device != device:
        from ortrain.errors import UnsupportedError

        raise UnsupportedError(f"{what}: tensor on {t.device}; the model runs on {device}")
    check_addressable(t, what)
    return (t.data_ptr(), engine_dtype(t, what), list(t.shape))


def check_index_errors(session) -> None:
    """Raises IndexError when a recent GPU step of `session` met an index out of range (the
    kernels cannot stop: they wrote 0 there and dropped those gradients), ValueError when a
    Dropout's ratio computed in the step was outside [0, 1) (its output was NaN). Checked at
    each step from a copy that has already landed, so it never waits for the GPU; the report
    comes one step or so after the bad batch, as PyTorch's own device-side asserts do."""
    bad = _ortrain.cuda_index_errors(session)  # read once: the flags are cleared by reading them
    ratios = [b for b in bad if b.startswith("Dropout")]
    indices = [b for b in bad if b not in ratios]
    parts = []
    if indices:
        parts.append(f"ortrain: an index was out of range in a recent step on the GPU, in {', '.join(indices)}: "
                     "those outputs were 0 and those gradients dropped (check the batch's ids or labels "
                     "against the embedding size or the number of classes)")
    if ratios:
        parts.append(f"ortrain: a dropout ratio computed on the GPU was outside [0, 1) in a recent step, in "
                     f"{', '.join(ratios)}: its output was NaN there")
    if parts:
        raise (IndexError if indices else ValueError)("; ".join(parts))


class CudaStep:
    """One forward pass queued on the GPU, and its backward pass."""

    def __init__(self, runner, inputs: list, backward: bool, seed: int, bound: dict | None,
                 weights: list | None = None):
        """`weights`: device addresses to read the weights from instead of the live tensors
        (forward only: a replay from a parameter snapshot)."""
        self.runner = runner
        check_index_errors(runner.session)
        sigs = [(engine_dtype(x, n), list(x.shape)) for x, n in zip(inputs, runner.input_names)]
        out_bound = [k in bound for k in range(runner.n_outputs)] if bound else None
        key = (tuple((d, tuple(s)) for d, s in sigs), backward, tuple(out_bound or ()))
        nbytes = runner.arena_sizes.get(key)
        if nbytes is None:
            nbytes = runner.arena_sizes[key] = _ortrain.cuda_arena_bytes(runner.session, sigs, backward, out_bound)
        device = runner.device
        feed = [cuda_triple(x, n, device) for x, n in zip(inputs, runner.input_names)]
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        stream = _stream(device)
        cache = self.cache = getattr(runner, "graphs", None)
        self.graph_key = self.entry = None
        if cache is not None and weights is None and not bound:
            weights = runner.weight_addresses()
            self.graph_key = (key, tf32, stream, tuple(weights))
            self.entry = cache.entry(self.graph_key, nbytes)
        if self.entry is not None:
            try:
                with engine_device(device):
                    self.pending = _ortrain.cuda_forward(runner.session, feed, weights, backward, seed, stream,
                                                         self.entry.arena.data_ptr(), None, tf32=tf32,
                                                         graph=self.entry.forward,
                                                         seed_slot=self.entry.seed_slot.data_ptr(), device=device.index)
                self.arena = self.entry.arena
                self.entry.busy = True
                cache.replays += 1
                return
            except Exception as exc:  # noqa: BLE001 - the step runs without a graph below
                cache.fail(self.graph_key, exc)
                self.entry = None
        self.arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=runner.device)
        addrs = [bound[k].data_ptr() if k in bound else 0 for k in range(runner.n_outputs)] if bound else None
        with engine_device(device):
            self.pending = _ortrain.cuda_forward(runner.session, feed,
                                                 runner.weight_addresses() if weights is None else weights, backward,
                                                 seed, stream, self.arena.data_ptr(), addrs, tf32=tf32,
                                                 device=device.index)
        if cache is not None:
            cache.ran_without_graph(self.graph_key, "forward")

    def outputs(self, bound: dict | None = None) -> list:
        """The outputs as new CUDA tensors (copies queued on the stream), except bound ones."""
        outs = []
        device = self.runner.device
        with engine_device(device):
            for k in range(self.runner.n_outputs):
                if bound and k in bound:
                    outs.append(bound[k])
                    continue
                addr, dt, shape = self.pending.output(k)
                t = torch.empty(shape, dtype=torch_dtype(dt), device=device)
                _ortrain.cuda_copy(t.data_ptr(), addr, t.numel() * t.element_size(), _stream(device), device=device.index)
                outs.append(t)
        return outs

    def backward(self, seeds: list) -> list:
        """Queues the backward pass from `seeds` (per output a gradient tensor, or None) and
        returns the weights' gradients (None where a weight gets none): through the entry's
        graph when the step has one and its memory is free, else into fresh tensors."""
        runner, entry, cache = self.runner, self.entry, self.cache
        device = runner.device
        try:
            if entry is not None and cache.backward_ready(self.graph_key):
                grads = cache.static_grads(runner.weights, runner.wants_grad())
                try:
                    static = entry.static_seeds(seeds) if grads is not None else None
                except torch.OutOfMemoryError:
                    static = None
                if static is not None:
                    try:
                        with engine_device(device):
                            _ortrain.cuda_backward(runner.session, self.pending, runner.weight_addresses(),
                                                   [0 if s is None else s.data_ptr() for s in static],
                                                   [0 if g is None else g.data_ptr() for g in grads], _stream(device),
                                                   graph=entry.backward, device=device.index)
                        cache.replays += 1
                        return grads
                    except Exception as exc:  # noqa: BLE001 - a failed recording queued nothing: run it below
                        cache.fail(self.graph_key, exc)
            grads = runner.new_grad_buffers()
            with engine_device(device):
                _ortrain.cuda_backward(runner.session, self.pending, runner.weight_addresses(),
                                       [0 if s is None else s.data_ptr() for s in seeds],
                                       [0 if g is None else g.data_ptr() for g in grads], _stream(device),
                                       device=device.index)
            if cache is not None:
                cache.ran_without_graph(self.graph_key, "backward")
            return grads
        finally:
            self.release()

    def release(self) -> None:
        self.pending.release()
        self.arena = None
        if self.entry is not None:
            self.entry.busy = False
            self.entry = None

    def __del__(self):
        # a forward pass dropped without its backward pass (autograd freed the graph) frees its entry
        entry = getattr(self, "entry", None)
        if entry is not None:
            entry.busy = False
