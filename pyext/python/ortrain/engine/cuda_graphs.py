"""CUDA graphs of the engine's GPU steps (`accelerate(..., cuda_graphs=True)`, the default on
CUDA; `ORTRAIN_CUDA_GRAPHS=0` turns them off for the process).

A small model's step is a few hundred kernels of a few microseconds each: the GPU waits for the
host to launch them. Recorded once as a graph per phase (forward, backward), the step is one
launch each. A graph keeps every address it was recorded with, so each step key (input types
and sizes, training or not, the weights' addresses, the TF32 flag, the stream) gets an entry
holding the memory the graphs use for their whole life: the arena, a seed slot (Dropout reads
the step's seed there, so replays draw fresh masks, the same masks as without a graph) and the
gradient seeds' memory; the gradients' memory is one per runner, shared by its entries. A new sequence length is a new key: planned, warmed and
recorded for itself (the old key's graphs stay, least recently used first out).

A step runs without a graph, and stays correct, when:
- its key is seen for the first time: launched kernel by kernel, which sizes the runtime's
  scratch buffers and cuBLAS (nothing may be allocated while recording); recorded the next time;
- the entry's arena is still held by a forward pass whose backward pass has not run (two
  forward passes before one backward);
- the gradient memory is still referenced (gradient accumulation without
  `zero_grad(set_to_none=True)`): that backward pass writes fresh tensors instead;
- a recording failed (an operation that cannot be part of a graph): that key runs without
  graphs from then on, after one warning;
- the arena alone is over the graph budget (a quarter of the GPU's memory: such a step is long
  enough that launches do not matter); entries together (and the gradients' memory) stay within
  it, least recently used out; memory for an entry that is not there (out of memory) is the
  same as a failed recording.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from ortrain import _ortrain

MAX_ENTRIES = 8
BUDGET_FRACTION = 0.25
_ENV = "ORTRAIN_CUDA_GRAPHS"


def enabled_by_environment() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


_use_count = getattr(torch._C, "_storage_Use_Count", None)


class GraphEntry:
    """The memory and graphs of one step key."""

    def __init__(self, device: torch.device, arena_bytes: int):
        self.arena = torch.empty(max(arena_bytes, 1), dtype=torch.uint8, device=device)
        self.seed_slot = torch.zeros(1, dtype=torch.int64, device=device)
        self.forward = _ortrain.CudaGraph()
        self.backward = _ortrain.CudaGraph()
        self.bytes = arena_bytes
        self.seeds: list | None = None  # gradient seeds' memory: a tensor (or None) per output
        self.busy = False  # a forward pass holds the arena until its backward pass is queued

    def static_seeds(self, seeds: list) -> list | None:
        """The seeds copied into the entry's seed memory (made on first use); None when their
        pattern (which outputs have one, their types and sizes) differs from the recorded one."""
        if self.seeds is None:
            self.seeds = [None if s is None else torch.empty_like(s) for s in seeds]
        if len(seeds) != len(self.seeds):
            return None
        for mine, s in zip(self.seeds, seeds):
            if (mine is None) != (s is None) or (s is not None and (s.shape != mine.shape or s.dtype != mine.dtype)):
                return None
        for mine, s in zip(self.seeds, seeds):
            if s is not None:
                mine.copy_(s)
        return self.seeds

class GraphCache:
    """The graph entries of one runner, with the policy of when a step may use one."""

    def __init__(self, device: torch.device, budget: int | None = None):
        """`budget`: bytes the entries' arenas may hold together (None: BUDGET_FRACTION of the
        device's memory)."""
        self.device = device
        self.entries: OrderedDict = OrderedDict()
        self.warm: dict = {}  # key -> phases run without a graph at least once ({"forward", "backward"})
        self.failed: dict = {}  # key -> why it runs without graphs
        if budget is None:
            budget = int(torch.cuda.get_device_properties(device).total_memory * BUDGET_FRACTION)
        self.budget = budget
        self.grads: list | None = None  # gradients' memory: (tensor, its storage) (or None) per weight
        self.grad_bytes = 0
        self.replays = 0  # phases run through a graph
        self.grads_held = 0  # backward passes run without their graph: the gradient memory was referenced
        self.unwarned = True

    def entry(self, key, arena_bytes: int) -> GraphEntry | None:
        """The entry a forward pass of `key` runs in, or None (run it without a graph)."""
        e = self.entries.get(key)
        if e is not None:
            if e.busy:
                return None
            self.entries.move_to_end(key)
            return e
        if key in self.failed or "forward" not in self.warm.get(key, ()):
            return None
        if arena_bytes > self.budget:
            self.failed[key] = (f"an arena of {arena_bytes / 2**20:.1f} MiB is over the graph budget "
                                f"({self.budget / 2**20:.1f} MiB)")
            return None
        while self.entries and (len(self.entries) >= MAX_ENTRIES
                                or self.held() + arena_bytes > self.budget):
            idle = next((k for k, x in self.entries.items() if not x.busy), None)
            if idle is None:
                return None
            del self.entries[idle]  # its memory returns to PyTorch's allocator in stream order
        try:
            e = self.entries[key] = GraphEntry(self.device, arena_bytes)
        except torch.OutOfMemoryError:
            self.failed[key] = f"out of GPU memory for its graph's arena ({arena_bytes / 2**20:.1f} MiB)"
            return None
        return e

    def held(self) -> int:
        """Bytes the entries' arenas and the gradients' memory hold."""
        return sum(x.bytes for x in self.entries.values()) + self.grad_bytes

    def static_grads(self, weights: list, wanted: list) -> list | None:
        """Tensors over the gradients' memory, one per weight (None where `wanted` is False), or
        None while any of it is still referenced elsewhere (a `.grad` kept from the last step),
        references cannot be counted, or there is no memory for it."""
        if _use_count is None:
            return None
        if self.grads is None:
            try:
                bases = [torch.empty(w.shape, dtype=w.dtype, device=w.device) if want else None
                         for w, want in zip(weights, wanted)]
            except torch.OutOfMemoryError:
                return None
            self.grads = [None if b is None else (b, b.untyped_storage()) for b in bases]
            self.grad_bytes = sum(g[1].nbytes() for g in self.grads if g is not None)
        # the cache's two references (the tensor and its storage) and no other
        if any(g is not None and _use_count(g[1]._cdata) != 2 for g in self.grads):
            self.grads_held += 1
            return None
        # new tensors over the memory (detach: no copy, 1 µs each): autograd may make them `.grad`
        # without a copy, nothing else referencing them
        return [None if g is None else g[0].detach() for g in self.grads]

    def ran_without_graph(self, key, phase: str) -> None:
        if key is None:
            return
        if len(self.warm) > 256:
            self.warm.clear()
        self.warm.setdefault(key, set()).add(phase)

    def backward_ready(self, key) -> bool:
        return "backward" in self.warm.get(key, ())

    def fail(self, key, exc: BaseException) -> None:
        """A recording or replay of `key` failed: that key runs without graphs from now on."""
        self.entries.pop(key, None)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.failed[key] = reason
        if self.unwarned:
            self.unwarned = False
            from ortrain._warn import warn

            warn(f"ortrain: a step runs without a CUDA graph (the kernels are launched one by one): {reason}")

    def describe(self) -> str:
        recorded = sum(1 for e in self.entries.values() if e.forward.nodes is not None)
        nodes = [e.forward.nodes + (e.backward.nodes or 0) for e in self.entries.values() if e.forward.nodes is not None]
        text = (f"CUDA graphs on: {recorded} step shape(s) recorded"
                + (f" ({', '.join(str(n) for n in nodes)} nodes)" if nodes else "")
                + f", {self.replays} phase(s) replayed")
        if self.grads_held:
            text += (f"; {self.grads_held} backward pass(es) without their graph: the gradients' memory was "
                     "still referenced (gradient accumulation, or zero_grad(set_to_none=False))")
        if self.failed:
            text += "; without a graph: " + "; ".join(sorted(set(self.failed.values())))
        return text


def describe_graphs(runner, option_on: bool) -> str:
    """explain()'s line on a CUDA runner's graphs (`option_on`: accelerate's `cuda_graphs`)."""
    if runner.graphs is not None:
        return runner.graphs.describe()
    if not option_on:
        return "CUDA graphs off (accelerate(..., cuda_graphs=False))"
    return f"CUDA graphs off ({_ENV}=0)"
