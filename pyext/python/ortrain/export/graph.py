"""Post-processing of an exported ONNX ModelProto, the same for every exporter.

Owns: renaming values (strip the export wrapper's prefix, name graph outputs), the map from
initializer names to the module's state_dict keys with each one's kind (param / frozen / buffer)
and the tied-weight aliases, the BatchNorm running-statistics updates, the training-mode Dropout
repair, and the list of input dimensions that came out fixed instead of symbolic.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

TRAINING_TRUE = "ortrain_training_mode_true"


def _graphs(graph):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def rename_values(model: onnx.ModelProto, mapping: dict) -> None:
    """Rename values everywhere (initializers, inputs, outputs, node in/outputs, subgraphs)."""
    if not mapping:
        return
    for g in _graphs(model.graph):
        for coll in (g.initializer,):
            for t in coll:
                t.name = mapping.get(t.name, t.name)
        for coll in (g.input, g.output, g.value_info):
            for v in coll:
                v.name = mapping.get(v.name, v.name)
        for node in g.node:
            for i, n in enumerate(node.input):
                if n in mapping:
                    node.input[i] = mapping[n]
            for i, n in enumerate(node.output):
                if n in mapping:
                    node.output[i] = mapping[n]


def strip_prefix(model: onnx.ModelProto, prefix: str) -> None:
    scope = "/" + prefix.rstrip(".") + "/"  # node and value names carry the module scope
    names = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    names |= {o for n in model.graph.node for o in n.output}
    mapping = {n: n[len(prefix):] for n in names if n.startswith(prefix)}
    mapping.update({n: n.replace(scope, "/", 1) for n in names if n.startswith(scope)})
    rename_values(model, mapping)
    for g in _graphs(model.graph):
        for node in g.node:
            if node.name.startswith(scope):
                node.name = "/" + node.name[len(scope):]


def name_outputs(model: onnx.ModelProto, names: list) -> None:
    outs = [o.name for o in model.graph.output]
    if len(outs) != len(names):
        return
    taken = set()
    mapping = {}
    for old, new in zip(outs, names):
        if new in taken:
            new = f"{new}_{len(taken)}"
        taken.add(new)
        if old != new:
            mapping[old] = new
    # an output that is directly a graph input or initializer keeps its name (renaming it
    # would rename the input too): insert an Identity instead
    direct = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for old, new in list(mapping.items()):
        if old in direct:
            model.graph.node.append(helper.make_node("Identity", [old], [new], name=f"out_{new}"))
            for o in model.graph.output:
                if o.name == old:
                    o.name = new
            del mapping[old]
    rename_values(model, mapping)


def map_parameters(model: onnx.ModelProto, module: torch.nn.Module):
    """Returns (param_map, param_kinds, aliases, unused) for the module's state.

    param_map: initializer name -> state_dict key (by name, else by identical value).
    param_kinds: initializer name -> "param" | "frozen" | "buffer".
    aliases: initializer name -> every state_dict key sharing its storage (only when > 1:
        tied weights such as GPT-2 wte/lm_head).
    unused: trainable parameter names the graph does not read (they get no gradient).
    """
    state = module.state_dict(keep_vars=True)
    for k, b in module.named_buffers():  # non-persistent buffers are not in state_dict
        state.setdefault(k, b)
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    storage_of = {k: (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape),
                      tuple(v.stride())) for k, v in state.items() if isinstance(v, torch.Tensor)}
    by_storage = defaultdict(list)
    for k, s in storage_of.items():
        by_storage[s].append(k)

    param_map, kinds = {}, {}
    unmatched = []
    for init in model.graph.initializer:
        if init.name in state:
            param_map[init.name] = init.name
        else:
            unmatched.append(init)
    if unmatched:  # legacy exporter may name a parameter onnx::Op_N: match by value
        by_shape = defaultdict(list)
        for k, v in state.items():
            by_shape[tuple(v.shape)].append(k)
        for init in unmatched:
            cands = by_shape.get(tuple(init.dims), [])
            if not cands or np.prod(init.dims or [1]) < 2:
                continue
            arr = numpy_helper.to_array(init)
            for k in cands:
                v = state[k].detach()
                if v.dtype.is_floating_point and np.array_equal(v.cpu().numpy(), arr):
                    param_map[init.name] = k
                    break
    for name, key in param_map.items():
        if key in params:
            kinds[name] = "param" if params[key].requires_grad else "frozen"
        elif key in buffers:
            kinds[name] = "buffer"
    aliases = {}
    for name, key in param_map.items():
        group = by_storage.get(storage_of.get(key), [])
        if len(group) > 1:
            aliases[name] = sorted(group)
    used_keys = set()
    for name, key in param_map.items():
        used_keys.update(aliases.get(name, [key]))
    unused = sorted(k for k, p in module.named_parameters() if p.requires_grad and k not in used_keys)
    return param_map, kinds, aliases, unused


def buffer_updates(model: onnx.ModelProto, param_map: dict, kinds: dict) -> dict:
    """Training-mode BatchNormalization: buffer key -> the value holding its updated statistic."""
    updates = {}
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        training = any(a.name == "training_mode" and a.i == 1 for a in node.attribute)
        if not training:
            continue
        for in_idx, out_idx in ((3, 1), (4, 2)):  # input_mean -> running_mean, input_var -> ...
            if len(node.input) > in_idx and len(node.output) > out_idx and node.output[out_idx]:
                src = node.input[in_idx]
                if kinds.get(src) == "buffer":
                    updates[param_map[src]] = node.output[out_idx]
    return updates


def _is_false_constant(name, consts) -> bool:
    """Whether `name` is a constant (Constant node or initializer) whose value is false; only
    that value is converted (not every initializer: they hold the model's weights)."""
    source = consts.get(name)
    if source is None:
        return False
    value = numpy_helper.to_array(source)
    return not bool(np.asarray(value).reshape(-1)[0])


def fix_dropouts(model: onnx.ModelProto) -> list:
    """In a training export, make every Dropout a training-mode Dropout.

    The legacy exporter writes scaled_dot_product_attention's dropout (nn.MultiheadAttention,
    nn.TransformerEncoderLayer) as Dropout(x, ratio) without the training_mode input, i.e. an
    identity: silently wrong for training. Sets training_mode to a true constant; returns the
    names of the nodes it fixed.
    """
    consts = {}  # value name -> its TensorProto (converted only when a Dropout reads it)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = node.attribute[0].t
    for t in model.graph.initializer:
        consts[t.name] = t
    fixed = []
    for i, node in enumerate(model.graph.node):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        tm = node.input[2] if len(node.input) > 2 else ""
        if tm and not _is_false_constant(tm, consts):
            continue
        if not node.name:
            node.name = f"Dropout_{i}"
        while len(node.input) < 2:
            node.input.append("")  # ratio absent: the spec's default 0.5 applies
        if len(node.input) == 2:
            node.input.append(TRAINING_TRUE)
        else:
            node.input[2] = TRAINING_TRUE
        fixed.append(node.name)
    if fixed and TRAINING_TRUE not in consts:
        model.graph.node.insert(0, helper.make_node(
            "Constant", [], [TRAINING_TRUE], name=TRAINING_TRUE,
            value=numpy_helper.from_array(np.array(True))))
    return fixed


def fix_batchnorms(model: onnx.ModelProto) -> list:
    """In a training export, make every BatchNormalization use batch statistics.

    The dynamo exporter writes a train()-mode BatchNorm as an inference BatchNormalization
    (running statistics, no training_mode, no updated-statistics outputs): silently wrong for
    training. Sets training_mode=1 and adds the running_mean/running_var outputs (opset >= 14).
    Returns the names of the nodes it fixed.
    """
    fixed = []
    for i, node in enumerate(model.graph.node):
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: a for a in node.attribute}
        if "training_mode" in attrs and attrs["training_mode"].i == 1:
            continue
        if not node.name:
            node.name = f"BatchNormalization_{i}"
        if "training_mode" in attrs:
            attrs["training_mode"].i = 1
        else:
            node.attribute.append(helper.make_attribute("training_mode", 1))
        while len(node.output) < 3:
            node.output.append(f"{node.output[0]}_{('running_mean', 'running_var')[len(node.output) - 1]}")
        fixed.append(node.name)
    return fixed


def static_input_dims(model: onnx.ModelProto, input_names: list) -> dict:
    """Input name -> axes whose size is fixed (dim_value) rather than symbolic (dim_param)."""
    out = {}
    for vi in model.graph.input:
        if vi.name in input_names:
            fixed = [i for i, d in enumerate(vi.type.tensor_type.shape.dim) if not d.dim_param]
            if fixed:
                out[vi.name] = fixed
    return out


def opset_of(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    return 0


BOUND_LOCATION = "ortrain:bound"


def mark_bound(model: onnx.ModelProto, names) -> None:
    """In place: the initializers named in `names` lose their data and are marked as external at
    the location `ortrain:bound` (the engine binds them to the module's live tensors); each keeps
    its name, type and shape. Others (constants the exporter lifted) keep their data."""
    names = set(names)
    for init in model.graph.initializer:
        if init.name not in names or is_bound(init):
            continue
        for fld in ("raw_data", "float_data", "double_data", "int32_data", "int64_data", "uint64_data"):
            init.ClearField(fld)
        del init.external_data[:]
        init.data_location = onnx.TensorProto.EXTERNAL
        entry = init.external_data.add()
        entry.key, entry.value = "location", BOUND_LOCATION


def is_bound(init: onnx.TensorProto) -> bool:
    return init.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == BOUND_LOCATION for e in init.external_data)


def check(model: onnx.ModelProto) -> None:
    """onnx.checker on the model; bound initializers (no data here: the checker would look for a
    file named `ortrain:bound`) are checked as graph inputs of the same type and shape."""
    bound = [t for t in model.graph.initializer if is_bound(t)]
    if not bound:
        onnx.checker.check_model(model)
        return
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = [t for t in copy.graph.initializer if not is_bound(t)]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    copy.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in bound)
    onnx.checker.check_model(copy)


def strip_bound_weights(onnx_bytes: bytes, param_map: dict) -> bytes:
    """Drops the data of the initializers the engine binds to the module's live tensors (every
    call reads those), see mark_bound. The graph then weighs kilobytes, not the model's size, in
    memory and in every session built from it. (Not a valid standalone model any more: the
    runner keeps this form; export_module(weights=True) results stay complete.)"""
    model = onnx.load_from_string(onnx_bytes)
    mark_bound(model, param_map)
    return model.SerializeToString()
