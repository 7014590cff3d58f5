"""ORTTrainer options: a nested dict validated against the keys ONNX Runtime Training offered.
Keys that work are checked and defaulted; keys for what does not exist yet are refused with
"not supported yet" when set to anything but their neutral value; unknown keys list the valid ones."""
from __future__ import annotations

from ortrain.errors import UnsupportedError

# section -> key -> (default, check) ; check(value) returns an error string or None
_BOOL = lambda v: None if isinstance(v, bool) else "must be True or False"  # noqa: E731
_FP16_ELSEWHERE = ("fp16 with the dynamic loss scaler runs on CUDA, through "
                   "ortrain.accelerate(model, optimizer, device='cuda', precision='fp16'); ORTTrainer runs on the CPU")

def _zero_stage(v):
    if not (isinstance(v, dict) and set(v) <= {"stage"}):
        return "must be a dict {'stage': 0 or 1}"
    stage = v.get("stage", 0)
    if stage in (0, 1) and not isinstance(stage, bool):
        return None
    if stage in (2, 3):
        raise UnsupportedError(f"options['distributed']['deepspeed_zero_optimization'] = {v!r}: stage {stage} is not "
                               "supported yet (stage 1 partitions the optimizer state over the ranks; for sharded "
                               "parameters and gradients use FSDP2's fully_shard with ortrain.accelerate)")
    return "'stage' must be 0, 1, 2 or 3"


def _int_at_least(low: int):
    return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= low else f"must be an int ≥ {low}"


SUPPORTED = {
    "batch": {"gradient_accumulation_steps": (1, _int_at_least(1))},
    "device": {"id": ("cpu", lambda v: None if v in ("cpu", "cpu:0") else "only 'cpu' is supported yet")},
    "utils": {"grad_norm_clip": (True, lambda v: None if isinstance(v, (bool, int, float)) else "must be a bool or a max norm"),
              "frozen_weights": ([], lambda v: None if isinstance(v, (list, tuple)) else "must be a list of parameter names")},
    # the CPU engine is deterministic for a fixed thread count either way
    "debug": {"deterministic_compute": (False, _BOOL)},
    "lr_scheduler": None,  # an ortrain.optim.*LRScheduler or None
    # bf16 matmuls with f32 accumulation and f32 master weights: no loss scaling needed. fp16 and
    # its dynamic loss scaler run on CUDA only, through accelerate(); ORTTrainer runs on the CPU
    "mixed_precision": {"enabled": (False, _BOOL),
                        "dtype": ("bf16", lambda v: None if v == "bf16" else _FP16_ELSEWHERE if v == "fp16" else "must be 'bf16'"),
                        "loss_scaler": (None, lambda v: None if v is None else
                                        "bf16 needs no loss scaling; " + _FP16_ELSEWHERE)},
    # data parallel over torch.distributed (data_parallel.py TrainerGroup): every rank one copy
    # of the model, gradients averaged; data_parallel_size 1 means the whole world
    "distributed": {"world_rank": (0, _int_at_least(0)), "world_size": (1, _int_at_least(1)),
                    "local_rank": (0, _int_at_least(0)), "data_parallel_size": (1, _int_at_least(1)),
                    "allreduce_post_accumulation": (False, _BOOL),
                    # ZeRO stage 1: each rank keeps and updates the optimizer state of its part
                    "deepspeed_zero_optimization": ({"stage": 0}, _zero_stage)},
    # each transformer layer (export/checkpoints.py repeated_layers) recomputed in the backward
    # pass, as if run under torch.utils.checkpoint; number_recompute_layers: the first N (0: all)
    "graph_transformer": {"transformer_layer_recompute": (False, _BOOL),
                          "number_recompute_layers": (0, _int_at_least(0))},
}

# what ORT offered and ortrain does not have yet: the value that means "off"
NOT_YET = {
    "distributed": {"horizontal_parallel_size": 1, "pipeline_parallel": {}, "enable_adasum": False},
    "graph_transformer": {"attn_dropout_recompute": False, "gelu_recompute": False},
    "device": {"mem_limit": 0},
    "debug": {"check_model_export": False, "graph_save_paths": {}},
}


_NOT_YET_HINTS = {
    "gelu_recompute": " (transformer_layer_recompute recomputes whole layers, their GELUs included)",
    "attn_dropout_recompute": " (transformer_layer_recompute recomputes whole layers, their attention dropout "
                              "from its mask)",
}


def validate(options: dict | None) -> dict:
    """Returns a complete options dict (defaults filled in) or raises naming the bad key."""
    options = dict(options or {})
    out = {s: {k: d for k, (d, _) in keys.items()} for s, keys in SUPPORTED.items() if keys is not None}
    out["lr_scheduler"] = None
    valid_sections = sorted(set(SUPPORTED) | set(NOT_YET))
    for section, value in options.items():
        if section == "lr_scheduler":
            from ortrain.optim import _LRScheduler

            if value is not None and not isinstance(value, _LRScheduler):
                raise ValueError("options['lr_scheduler'] must be an ortrain.optim.*LRScheduler or None")
            out["lr_scheduler"] = value
            continue
        if section not in valid_sections:
            raise ValueError(f"options: unknown section '{section}' (valid: {', '.join(valid_sections)})")
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"options['{section}'] must be a dict")
        supported, not_yet = SUPPORTED.get(section) or {}, NOT_YET.get(section, {})
        for key, v in value.items():
            if key in not_yet:
                if v not in (not_yet[key], None) and v != {}:
                    hint = _NOT_YET_HINTS.get(key, "")
                    raise UnsupportedError(f"options['{section}']['{key}'] = {v!r}: not supported yet{hint}")
                continue
            if key not in supported:
                valid = sorted(set(supported) | set(not_yet))
                raise ValueError(f"options['{section}']: unknown key '{key}' (valid: {', '.join(valid)})")
            err = supported[key][1](v)
            if err:
                raise ValueError(f"options['{section}']['{key}'] = {v!r}: {err}")
            out[section][key] = v
    _check_distributed(out["distributed"])
    return out


def _check_distributed(d: dict) -> None:
    """The data-parallel keys agree with each other."""
    if d["world_rank"] >= d["world_size"]:
        raise ValueError(f"options['distributed']['world_rank'] = {d['world_rank']}: must be below world_size "
                         f"({d['world_size']})")
    if d["data_parallel_size"] not in (1, d["world_size"]):
        raise UnsupportedError(f"options['distributed']['data_parallel_size'] = {d['data_parallel_size']} with "
                               f"world_size {d['world_size']}: data-parallel groups smaller than the world need "
                               "horizontal or pipeline parallelism, not supported yet (leave it 1 or world_size)")
