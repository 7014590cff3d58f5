"""The device memory an engine multi-tensor GPU launch reads its tensors from (kernels/optim.cu:
the optimizer's Adam, clip_grad_norm_'s norm and scale): a table of rows (addresses, then the
tensor's element count) and the chunk lists of those sizes. Uploaded the first time a set of rows
is seen (the table through pinned memory: no host sync) and reused while the same rows come back:
from step to step the parameters', moments' and gradients' addresses repeat."""
from __future__ import annotations

import torch

from ortrain import _ortrain

#: sets of rows a cache keeps (gradients reallocated at new addresses: the latest few)
_KEEP = 8


def device_tables(cache: dict, rows: tuple, device: torch.device) -> tuple:
    """(table, chunk_tensor, chunk_start) on `device` (the GPU of the rows' tensors) for `rows`
    (tuples of int64s, each ending with its tensor's numel), from `cache` or uploaded into it."""
    key = (device.index, rows)
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= _KEEP:
            cache.clear()
        tensor_of, start = _ortrain.cuda_optim_chunks([r[-1] for r in rows])
        hit = cache[key] = (torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True),
                            torch.tensor(tensor_of, dtype=torch.int32, device=device),
                            torch.tensor(start, dtype=torch.int64, device=device))
    return hit
