"""ORTTrainer options: a nested dict validated against the keys ONNX Runtime Training offered.
Keys that work are checked and defaulted; keys for what does not exist yet are refused with
"not supported yet" when set to anything but their neutral value; unknown keys list the valid ones."""
from __future__ import annotations

from ortrain.errors import UnsupportedError

# section -> key -> (default, check) ; check(value) returns an error string or None
_BOOL = lambda v: None if isinstance(v, bool) else "must be True or False"  # noqa: E731
_FP16_ELSEWHERE = ("fp16 with the dynamic loss scaler runs on CUDA, through "
                   "ortrain.accelerate(model, optimizer, device='cuda', precision='fp16'); ORTTrainer runs on the CPU")

SUPPORTED = {
    "batch": {"gradient_accumulation_steps": (1, lambda v: None if isinstance(v, int) and v >= 1 else "must be an int ≥ 1")},
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
}

# what ORT offered and ortrain does not have yet: the value that means "off"
NOT_YET = {
    "distributed": {"world_rank": 0, "world_size": 1, "local_rank": 0, "data_parallel_size": 1,
                    "horizontal_parallel_size": 1, "pipeline_parallel": {}, "allreduce_post_accumulation": False,
                    "deepspeed_zero_optimization": {}, "enable_adasum": False},
    "graph_transformer": {"attn_dropout_recompute": False, "gelu_recompute": False,
                          "transformer_layer_recompute": False, "number_recompute_layers": 0},
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
        if section in NOT_YET:
            for key, v in (value or {}).items():
                if key not in NOT_YET[section]:
                    raise ValueError(f"options['{section}']: unknown key '{key}' (valid: {', '.join(sorted(NOT_YET[section]))})")
                if v not in (NOT_YET[section][key], None) and v != {}:
                    raise UnsupportedError(f"options['{section}']['{key}'] = {v!r}: not supported yet")
            continue
        if section == "debug" and isinstance(value, dict):
            for key in ("check_model_export", "graph_save_paths"):
                if value.get(key):
                    raise UnsupportedError(f"options['debug']['{key}']: not supported yet")
            value = {k: v for k, v in value.items() if k not in ("check_model_export", "graph_save_paths")}
        if section == "device" and isinstance(value, dict) and value.get("mem_limit"):
            raise UnsupportedError("options['device']['mem_limit']: not supported yet")
        if section == "device" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k != "mem_limit"}
        if section not in SUPPORTED:
            raise ValueError(f"options: unknown section '{section}' (valid: {', '.join(valid_sections)})")
        if not isinstance(value, dict):
            raise ValueError(f"options['{section}'] must be a dict")
        for key, v in value.items():
            if key not in SUPPORTED[section]:
                raise ValueError(f"options['{section}']: unknown key '{key}' (valid: {', '.join(sorted(SUPPORTED[section]))})")
            err = SUPPORTED[section][key][1](v)
            if err:
                raise ValueError(f"options['{section}']['{key}'] = {v!r}: {err}")
            out[section][key] = v
    return out
