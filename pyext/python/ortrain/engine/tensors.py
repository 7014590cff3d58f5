"""torch.Tensor <-> the engine's (address, dtype, shape) triples."""
from __future__ import annotations

import torch

from ortrain.errors import UnsupportedError

_TO_ENGINE = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
_TO_TORCH = {v: k for k, v in _TO_ENGINE.items()}


def engine_dtype(t: torch.Tensor, what: str) -> str:
    try:
        return _TO_ENGINE[t.dtype]
    except KeyError:
        raise UnsupportedError(f"{what}: element type {t.dtype} is not supported by the engine yet") from None


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def addressable(t: torch.Tensor) -> bool:
    """Whether `t.data_ptr()` is where its elements are: not a wrapper tensor subclass (a
    DTensor, the shards FSDP2's fully_shard and tensor parallelism make parameters of), whose
    data_ptr() is 0 and whose elements live in tensors it holds."""
    return type(t).__torch_dispatch__ is _PLAIN_DISPATCH


def local_part(t: torch.Tensor):
    """The plain tensor holding the elements of `t` this process has: `t` itself, or a
    DTensor's local shard (FSDP2 shards a parameter, its gradient and its optimizer state alike,
    so an elementwise update of the whole is the same update of each process's shards); None
    for another wrapper subclass."""
    if addressable(t):
        return t
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return None
    part = to_local()
    return part if addressable(part) else None


def check_addressable(t: torch.Tensor, what: str) -> None:
    if not addressable(t):
        raise UnsupportedError(f"{what} is a {type(t).__name__}, a tensor subclass whose elements are not at its "
                               "address (a DTensor is a shard of a tensor spread over processes); the engine "
                               "reads plain tensors")


def torch_dtype(name: str) -> torch.dtype:
    return _TO_TORCH[name]


def triple(t: torch.Tensor, what: str) -> tuple:
    """(address, dtype, shape) of a contiguous CPU tensor."""
    if t.device.type != "cpu":
        raise UnsupportedError(f"{what}: tensor on {t.device}; the engine's CPU backend needs CPU tensors")
    if not t.is_contiguous():
        raise UnsupportedError(f"{what}: tensor is not contiguous")
    check_addressable(t, what)
    return (t.data_ptr(), engine_dtype(t, what), list(t.shape))


def address(t: torch.Tensor, what: str) -> int:
    return triple(t, what)[0]
