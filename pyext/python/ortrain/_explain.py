"""`ortrain.explain(model)`: what runs where for an accelerated model (exporter, engine graphs,
matmul path, planned memory, fallbacks, optional per-op profile), and `reset_profile`."""
from __future__ import annotations

import torch

from ortrain._warn import first_line
from ortrain import fully_sharded


def explain(model, *example_args, profile: bool = False, **example_kwargs) -> str:
    """What runs where: exporter, engine graph size, planned peak memory, fallbacks.

    With example inputs, the model is exported and planned for them first (nothing runs), so the
    memory plan is known before the first step. `profile=True` adds the engine's time per op type
    and the slowest nodes, averaged over the steps run so far (`ortrain.reset_profile(model)`
    starts a new measurement).
    """
    from ortrain.data_parallel import unwrap

    model = unwrap(model)  # a DistributedDataParallel's module is the one accelerated
    state = getattr(model, "__dict__", {}).get("_ortrain_state")
    if state is None:
        return f"{type(model).__name__}: not accelerated"
    from ortrain._memory import peak_summary
    from ortrain.engine.cuda_graphs import describe_graphs
    from ortrain.engine.optimizer import describe_last_step
    from ortrain.engine.runner import Runner

    if (example_args or example_kwargs) and not _holds_tensor((example_args, example_kwargs)):
        given = ", ".join([repr(a) for a in example_args] + [f"{k}={v!r}" for k, v in example_kwargs.items()])
        raise TypeError(f"explain(model, *example_args, profile=False, **example_kwargs): the example inputs ({given}) "
                        "hold no tensor; pass the model's inputs (ortrain.explain(model, x)) or none")
    if example_args or example_kwargs:
        from ortrain.export import flatten_call

        state.runner_for(example_args, example_kwargs)
        state.last_inputs = flatten_call(model, example_args, example_kwargs)[1]

    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = f" ({n_trainable:,} trainable)" if n_trainable != n_params else ""
    lines = [f"{type(model).__name__}: {n_params:,} parameters{frozen}, device {state.device}, "
             f"optimizer {'in the engine' if state.optimizer_in_engine else 'in PyTorch' if state.optimizer else 'none given'}"
             + (describe_last_step(state.optimizer) if state.optimizer_in_engine else "")
             + (f" ({type(state.optimizer).__name__.removeprefix('Ortrain')} made after accelerate(): its first step "
                "ran in PyTorch, the later ones in the engine)" if state.optimizer_taken_at_step else "")]
    sharded = fully_sharded.describe(model, state.optimizer_in_engine)
    if sharded:
        lines.append("  " + sharded)
    if state.loss_scaler is not None:
        ls = state.loss_scaler.state()
        lines.append(f"  dynamic loss scale {ls['scale']:g}: {ls['skipped_steps']} of {ls['steps']} optimizer steps "
                     "skipped for inf/NaN gradients")
    from ortrain.engine import clip

    clipped = clip.describe(model)
    if clipped and state.device == "cpu":
        lines.append("  " + clipped)
    if not state.runners:
        lines.append("  not called yet: the model is exported on its first call")
    where_step = "in the engine" if state.optimizer_in_engine else "in PyTorch"
    for key, r in state.runners.items():
        mode = "train" if key[1] else "eval"
        if key[0][1] is not None:  # exported under a torch.autocast the session does not cover
            mode += f", under autocast {str(key[0][1]).replace('torch.', '')}"
        if isinstance(r, Runner):
            e = r.exported
            fwd, bwd = r.session.node_count
            took = "reused from an earlier export in this process" if e.from_cache else f"{e.seconds:.2f} s"
            took += ", in a child process" if e.in_child and not e.from_cache else ""
            sizes = ("input sizes fixed to " + ", ".join(str(list(x)) for x in key[3])) if len(key) == 4 \
                else "any input sizes"
            passes = ", ".join(f"{name} ×{n}" for name, n in r.session.passes if n)
            lines.append(f"  [{mode}] exporter {e.exporter} (opset {e.opset}, {took}), "
                         f"{fwd} forward + {bwd} gradient nodes, {sizes}" + (f"; passes {passes}" if passes else ""))
            if getattr(r, "on_cuda", False) and r.session.matmul_precision in ("bf16", "fp16"):
                lines.append(f"    on {r.device}: matmuls {r.session.matmul_path}; optimizer step {where_step}")
            elif getattr(r, "on_cuda", False):
                tf32 = "TF32 allowed" if torch.backends.cuda.matmul.allow_tf32 else "TF32 off"
                lines.append(f"    on {r.device}: matmuls fp32 on cuBLAS ({tf32}); optimizer step {where_step}")
            else:
                lines.append(f"    matmuls: {r.session.matmul_path}; {_threads()}")
            if getattr(r, "on_cuda", False):
                lines.append("    " + describe_graphs(r, state.cuda_graphs))
                lines += _attention_lines(r)
            if e.dropout_fixes:
                lines.append(f"    attention dropout set to training mode: {len(e.dropout_fixes)} node(s)")
            if key[1]:
                lines += _checkpoint_lines(e, dict(r.session.passes).get("recompute_segments", 0))
            if getattr(e, "dropped_outputs", None):
                lines.append(f"    returned as None: {', '.join(sorted(set(e.dropped_outputs)))} (a key/value cache: the "
                             "engine keeps none; call the model with use_cache=False to have none asked for)")
            if key == state.last_key and state.last_inputs is not None:
                info = r.plan_info(state.last_inputs, bool(key[1]) and bool(r.trainable_params))
                shapes = ", ".join(str(list(x.shape)) for x in state.last_inputs)
                lines.append(f"    plan for inputs {shapes}: peak arena {info['arena_bytes'] / 2**20:.1f} MiB, "
                             f"{info['forward_steps']} forward + {info['backward_steps']} backward steps, "
                             f"{info['folded_nodes']} nodes folded")
                lines.append("    " + peak_summary(info))
                if key[1] and r.trainable_params:
                    lines += _training_memory(state, r, info)
        else:
            lines.append(f"  [{mode}] runs in PyTorch: {first_line(r)}")
    if state.fused_loss_calls:
        lines.append(f"  loss fused into the engine graph (cross-entropy): {state.fused_loss_calls} call(s)")
    if state.model_loss_calls:
        lines.append(f"  the model's own loss computed alone, its LM head fused into the loss: {state.model_loss_calls} "
                     "call(s) (the logits returned lazily)")
        if state.logits_read:
            lines.append("    the logits were read: from then on that call runs the whole graph (logits and loss), "
                         "which costs less than a replay of the forward pass per read")
    if state.fused_loss_calls or state.model_loss_calls:
        for r in state.loss_runners.values():
            last = getattr(r, "last_inputs", None)
            if last is None:
                continue
            try:
                info = r.plan_info(last, True)
            except Exception:  # noqa: BLE001 - explain() never fails on a plan it only describes
                continue
            fused = [f"{name} ×{n}" for name, n in r.session.passes if n]
            lines.append(f"    loss graph (logits computed only when read): "
                         f"passes {', '.join(fused) or 'none'}; peak arena {info['arena_bytes'] / 2**20:.1f} MiB, "
                         f"{info['forward_steps']} forward + {info['backward_steps']} backward steps\n      " + peak_summary(info))
            if getattr(r, "on_cuda", False):
                lines.append("    " + describe_graphs(r, state.cuda_graphs))
                lines += _attention_lines(r)
    if profile:
        from ortrain._profile import format_profile

        lines += format_profile(state)
    return "\n".join(lines)


def _checkpoint_lines(exported, recomputed: int) -> list:
    """explain()'s line on torch.utils.checkpoint: which checkpointed modules the engine
    recomputes in the backward pass, and what it could not."""
    seen, marked = getattr(exported, "checkpointed", []), getattr(exported, "recomputed", [])
    unmatched = getattr(exported, "checkpoints_unmatched", 0)
    if not seen and not unmatched:
        return []
    shown = ", ".join(marked[:4]) + (f", ... ({len(marked)} in all)" if len(marked) > 4 else "")
    line = (f"    torch.utils.checkpoint: {recomputed} of {len(marked)} checkpointed module(s) recomputed in the "
            f"backward pass ({shown}), their intermediate values not kept" if marked else
            "    torch.utils.checkpoint: no checkpointed module's nodes found in the graph")
    from ortrain.export.checkpoints import part_name

    names = [part_name(p) for p in seen]
    missed = [p for p in names if p not in marked and not any(p.startswith(q + ".") for q in marked)]
    if missed:
        line += f"; not found in the graph, kept: {', '.join(missed[:4])}"
    if unmatched:
        line += ("; checkpointed calls of functions that hold no module of the model (or the whole model): "
                 "their values are kept; checkpoint a module to have it recomputed")
    return [line]


def _attention_lines(runner) -> list:
    """explain()'s line on a CUDA graph's fused attentions: which kernels each one's last launch
    chose, counted; a mask read from memory is named, as it keeps the flash kernels out."""
    from collections import Counter

    from ortrain import _ortrain

    paths = _ortrain.cuda_attention_paths(runner.session)
    if not paths:
        return []
    counts = Counter(p or "not launched yet" for _, p in paths)
    line = f"    fused attention ×{len(paths)}: " + ", ".join(f"{p} ×{n}" for p, n in counts.items())
    if any(p and "mask read" in p for _, p in paths):
        line += ("\n      (the mask is computed at run time, e.g. from an attention_mask input, or is not causal: "
                 "the flash kernels take no mask, one of zeros or a constant causal one)")
    if any(p and "key padding and read" in p for _, p in paths):
        line += ("\n      (the flash kernels take an attention_mask's padding with no mask, one of zeros, or a causal "
                 "mask hiding keys with the padding's value, on 16-bit Q, K, V with heads of 32, 64, 80, 96 or 128)")
    return [line]


def _training_memory(state, runner, info) -> list:
    """explain()'s estimate of the training peak: with the model + cross-entropy graph's arena
    where the usual loss would be fused (the arena of the graph that will run), else with this
    plan's arena and the loss in PyTorch."""
    from ortrain._memory import gpu_training_estimate, training_estimate

    def estimate(arena: int) -> str:
        if runner.on_cuda:
            return gpu_training_estimate(state.module, state.optimizer, arena)
        return training_estimate(state.module, state.optimizer, arena, state.setup_bytes)

    fused = state.likely_loss_runner(runner, state.last_inputs)
    if fused is not None:
        loss_runner, inputs = fused
        try:
            arena = loss_runner.plan_info(inputs, True)["arena_bytes"]
        except Exception:  # noqa: BLE001 - explain() never fails on a plan it only describes
            fused = None
    if fused is not None:
        how = ("the model's own loss alone" if runner.n_user_outputs != 1 else "F.cross_entropy on the output")
        return [f"    with the loss fused ({how}), " + estimate(arena)]
    in_graph = "loss" in getattr(runner.exported, "output_names", [])  # model(..., labels=...): its own loss
    return ["    " + estimate(info["arena_bytes"]) + ("" if in_graph else ", plus the loss in PyTorch")]


def reset_profile(model) -> None:
    """Starts a new profile measurement for `explain(model, profile=True)`."""
    from ortrain.data_parallel import unwrap

    state = getattr(unwrap(model), "__dict__", {}).get("_ortrain_state")
    if state is not None:
        from ortrain._profile import reset

        reset(state)


def _threads() -> str:
    from ortrain import _ortrain
    from ortrain.engine import runner

    cores = _ortrain.pinned_cores()
    n = runner._THREADS  # the pool's size, set when the first engine graph was built
    where = f"pinned to cores {', '.join(map(str, cores))}" if cores else "not pinned"
    return f"{n} engine threads, {where} (ORTRAIN_PIN_THREADS)"


def _holds_tensor(value) -> bool:
    """Whether a tensor is somewhere in nested tuples, lists and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False
