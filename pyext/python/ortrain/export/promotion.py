"""torch.onnx's type-promotion pass, run only where it would change something:
`promoting_only_where_needed()` (a context manager around torch.onnx.export).

Before translating, torch.onnx.export runs `insert_type_promotion_nodes`: an FX interpreter that
re-runs every node of the decomposed program on fake tensors and, where an op's type-promotion
rule asks for another dtype than an argument has (int + float, a float64 scalar, ...), inserts
a cast and re-runs the node. On the tutorial nothing needs a cast, yet the re-run costs
0.25-0.35 s of the first step. Here the same decision is taken from the values the trace left
on the nodes (`node.meta["val"]`: the fake tensors and symbolic scalars the re-run would
recompute, with the same dtypes): for every node with a rule, the rule's promoted dtypes are
compared with its arguments' the way the pass compares them (tensors by dtype, symbolic and
Python scalars by their equivalent dtype, lists element by element). Only when no argument of
any node needs a cast (the pass would then leave the graph untouched) is the pass skipped;
otherwise, or where a value is missing or a private torch name is not found, torch's pass runs
as before.
"""
from __future__ import annotations

import contextlib

import torch

_TABLE = None  # torch's TypePromotionTable, built once


@contextlib.contextmanager
def promoting_only_where_needed():
    """Within: torch.onnx.export's type-promotion pass runs only on graphs that need a cast."""
    try:
        from torch.onnx._internal.exporter import _fx_passes
        original = _fx_passes.insert_type_promotion_nodes
    except (ImportError, AttributeError):
        yield
        return

    def insert_type_promotion_nodes(graph_module):
        if not needs_promotion(graph_module):
            return None
        return original(graph_module)

    _fx_passes.insert_type_promotion_nodes = insert_type_promotion_nodes
    try:
        yield
    finally:
        _fx_passes.insert_type_promotion_nodes = original


def needs_promotion(graph_module: torch.fx.GraphModule) -> bool:
    """Whether torch's type-promotion pass could insert a cast anywhere in `graph_module` or
    its nested graphs (True whenever that cannot be decided from the recorded values)."""
    try:
        from torch.onnx._internal.fx.passes import type_promotion
        from torch.onnx._internal.fx import type_utils
    except ImportError:
        return True
    global _TABLE
    try:
        if _TABLE is None:
            _TABLE = type_promotion.TypePromotionTable()
        for module in graph_module.modules():
            if not isinstance(module, torch.fx.GraphModule):
                return True  # the pass raises on these: let it
            for node in module.graph.nodes:
                if node.op != "call_function":
                    continue
                rule = type_promotion.get_type_promotion_rule(node, _TABLE)
                if rule is not None and _node_needs_cast(node, rule, type_utils):
                    return True
    except Exception:  # noqa: BLE001 - undecidable here: torch's pass decides
        return True
    return False


class _Unknown(Exception):
    """A value the decision needs is not recorded on the graph."""


def _val(arg):
    """An argument as the pass's interpreter sees it: nodes by their recorded value."""
    if isinstance(arg, torch.fx.Node):
        if "val" not in arg.meta:
            raise _Unknown(arg.name)
        return arg.meta["val"]
    if isinstance(arg, (tuple, list)):
        return type(arg)(_val(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _val(v) for k, v in arg.items()}
    return arg


def _node_needs_cast(node, rule, type_utils) -> bool:
    snapshot = rule.preview_type_promotion(_val(node.args), _val(node.kwargs))
    for i, arg in enumerate(node.args):
        if _arg_needs_cast(arg, snapshot.args_dtypes.get(i), type_utils):
            return True
    for name, arg in node.kwargs.items():
        if _arg_needs_cast(arg, snapshot.kwargs_dtypes.get(name), type_utils):
            return True
    return False


def _arg_needs_cast(arg, dtype, type_utils) -> bool:
    """The pass's `_maybe_promote_arg` decision: would it replace `arg` by a cast to `dtype`?"""
    if dtype is None:
        return False
    if isinstance(arg, torch.fx.Node):
        value = _val(arg)
        if isinstance(value, torch.Tensor):
            return value.dtype != dtype
        if type_utils.is_torch_symbolic_type(value):
            return type_utils.from_scalar_type_to_torch_dtype(type(value)) != dtype
        return True  # the pass would raise or do something else: let it
    equivalent = type_utils.from_scalar_type_to_torch_dtype(type(arg))
    if equivalent is not None:
        return equivalent != dtype
    if isinstance(arg, (tuple, list)):
        return any(_arg_needs_cast(a, dtype, type_utils) for a in arg)
    return True  # the pass raises NotImplementedError on anything else: let it
