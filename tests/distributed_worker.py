"""One rank of tests/test_distributed.py, started by torchrun (gloo, CPU).

Each scenario trains the same small language model twice from the same initial state, each rank
on its own batches: plain PyTorch under DistributedDataParallel, then ortrain under it. The rank
writes what it saw (losses, a checksum of every parameter after training, what the engine ran,
or the error a scenario ended with) to OUT/rank<k>.json; the test compares ranks with each
other and ortrain with PyTorch.

    torchrun --standalone --nproc_per_node=2 tests/distributed_worker.py OUT [SCENARIO ...]

ORTRAIN_TEST_DEVICE=cuda trains on the GPUs (NCCL), rank k on cuda:k as torchrun scripts do
(`torch.cuda.set_device(local_rank)`, `DDP(model, device_ids=[local_rank])`).
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, WIDTH, SEQ, BATCH, STEPS = 64, 24, 8, 4, 4
DEVICE = os.environ.get("ORTRAIN_TEST_DEVICE", "cpu")
if DEVICE == "cuda":
    DEVICE = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"


class TinyLM(torch.nn.Module):
    def __init__(self, unused_layer: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        if unused_layer:
            self.unused = torch.nn.Linear(3, 3)  # never called: find_unused_parameters must cope

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.hidden(self.emb(x))))
        if labels is None:
            return logits
        # the model's own loss, as Hugging Face's `labels=` (engine/model_loss.py)
        return {"loss": F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), "logits": logits}


#: name -> (DDP keywords, accelerate before wrapping, optimizer, micro-batches per step, clip)
SCENARIOS = {
    "accelerate_then_wrap": ({}, True, "adamw", 1, None),
    "wrap_then_accelerate": ({}, False, "adamw", 1, None),
    "find_unused_parameters": ({"find_unused_parameters": True}, False, "adamw", 1, None),
    "static_graph": ({"static_graph": True}, True, "adamw", 1, None),
    "bucket_views_sgd": ({"gradient_as_bucket_view": True}, True, "sgd", 1, None),
    "no_sync_accumulation_clip": ({}, False, "adamw", 2, 0.5),
}


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01)


def _train(name, accelerated: bool) -> dict:
    import ortrain

    ddp_kwargs, accelerate_first, opt_kind, micro, clip = SCENARIOS[name]
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # different on each rank: DDP broadcasts rank 0's weights
    model = TinyLM(unused_layer=name == "find_unused_parameters").to(DEVICE)
    opt = _optimizer(opt_kind, model.parameters())
    engine_device = "cpu"
    if DEVICE != "cpu":
        ddp_kwargs = dict(ddp_kwargs, device_ids=[torch.device(DEVICE).index])
        engine_device = "cuda"
    if accelerated and accelerate_first:
        model = DDP(ortrain.accelerate(model, opt, device=engine_device, strict=True), **ddp_kwargs)
    else:
        model = DDP(model, **ddp_kwargs)
        if accelerated:
            model = ortrain.accelerate(model, opt, device=engine_device, strict=True)
    data = torch.Generator().manual_seed(7 + rank)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
            y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
            x, y = x.to(DEVICE), y.to(DEVICE)
            last = k == micro - 1
            with nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1)) / micro
                loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    out = {"losses": losses, "params": [p.detach().double().sum().item() for p in model.module.parameters()],
           "param_abs": [p.detach().double().abs().sum().item() for p in model.module.parameters()]}
    if accelerated:
        state = model.module.__dict__["_ortrain_state"]
        out.update(engine_calls=state.engine_calls, calls=state.calls, fused_loss_calls=state.fused_loss_calls,
                   is_accelerated=ortrain.is_accelerated(model), explain=ortrain.explain(model).splitlines()[0])
        assert ortrain.deaccelerate(model) is model
        out["after_deaccelerate"] = ortrain.is_accelerated(model)
    return out


#: FSDP2 scenarios: name -> (modules given to fully_shard before the model itself, optimizer,
#: micro-batches per step, clip, gradients reduced after the last micro-batch only, the
#: parameters' dtype in forward and backward: MixedPrecisionPolicy's param_dtype)
FSDP_SCENARIOS = {
    "fsdp_root": ((), "adamw", 1, 0.5, False, None),
    "fsdp_layers": (("emb", "hidden", "head"), "sgd", 2, None, False, None),
    "fsdp_accumulate_unsynced": (("hidden", "head"), "adamw", 2, 0.5, True, None),
    "fsdp_bf16_parameters": (("hidden",), "adamw", 1, None, False, torch.bfloat16),
    # the model returns its own loss (`model(x, labels=y)`): the loss-only graph, logits lazy
    "fsdp_root_labels": ((), "adamw", 1, 0.5, False, None),
}


def _train_fsdp(name, accelerated: bool) -> dict:
    """fully_shard (FSDP2) around the model, then (`accelerated`) ortrain.accelerate on it:
    the shards are gathered into whole parameters for the engine, the gradients reduce-scattered
    back by FSDP. Ends with an inference call under no_grad."""
    import ortrain
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers, opt_kind, micro, clip, unsynced, param_dtype = FSDP_SCENARIOS[name]
    torch.manual_seed(300)  # FSDP2 shards the weights as they are: the same on every rank
    model = TinyLM(unused_layer=False).to(DEVICE)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(getattr(model, layer), mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = _optimizer(opt_kind, model.parameters())
    if accelerated:
        assert ortrain.accelerate(model, opt, device="cpu" if DEVICE == "cpu" else "cuda", strict=True) is model
    data = torch.Generator().manual_seed(9 + dist.get_rank())
    losses, logits_read, logits_abs = [], [], []
    for _ in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(DEVICE)
            y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(DEVICE)
            if unsynced:  # FSDP2's no_sync: the gradients stay whole until the last micro-batch
                model.set_requires_gradient_sync(k == micro - 1)
            if name.endswith("_labels"):
                out = model(x, labels=y)
                logits, loss = out["logits"], out["loss"] / micro
            else:
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1)) / micro
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        # the last call's output read after the step, as accuracy code does: the forward's values
        # (ortrain replays the fused call from the parameters it kept before FSDP freed them)
        read = logits.detach().double()
        logits_read.append(read.sum().item())
        logits_abs.append(read.abs().sum().item())
    memory = _fsdp_memory(model, opt) if accelerated else None
    with torch.no_grad():
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(DEVICE)
        inference = model(x).double()
    from torch.distributed.tensor import DTensor

    # FSDP reshards the layers after an inference call (the root keeps its parameters gathered)
    inner = [p for layer in layers for p in getattr(model, layer).parameters()]
    whole = {k: v.full_tensor().double() for k, v in model.state_dict().items()}  # state_dict reshards
    out = {"losses": losses, "logits_read": logits_read, "logits_abs": logits_abs,
           "inference": inference.sum().item(), "inference_abs": inference.abs().sum().item(), "layers_sharded": all(isinstance(p, DTensor) for p in inner),
           "params": [v.sum().item() for v in whole.values()], "param_abs": [v.abs().sum().item() for v in whole.values()]}
    if accelerated:
        state = model.__dict__["_ortrain_state"]
        out.update(engine_calls=state.engine_calls, calls=state.calls, fused_loss_calls=state.fused_loss_calls,
                   model_loss_calls=state.model_loss_calls, is_accelerated=ortrain.is_accelerated(model),
                   explain=ortrain.explain(model), memory=memory)
        ortrain.deaccelerate(model)
        out["after_deaccelerate"] = ortrain.is_accelerated(model)
    return out


def _fsdp_memory(model, opt) -> list:
    """[explain()'s memory estimate without the arena, in bytes; what this rank holds at the
    backward pass's peak, counted from the tensors]: the shards it keeps, the whole parameters
    and gradients it holds until FSDP reduce-scatters, the optimizer state's shards."""
    from ortrain._memory import _tensor_parts

    params = list(model.parameters())
    held = sum(p.to_local().numel() * p.element_size() for p in params)
    whole = sum(p.numel() * p.element_size() for p in params)
    state = sum(t.to_local().numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if hasattr(t, "to_local"))
    return [_tensor_parts(model, opt, 0, torch.device(DEVICE).type)[1], held + 2 * whole + state]


def _refusals() -> dict:
    """What strict accelerate() says of shards it cannot take: fully_shard on a layer but not on
    the model, and a tensor-parallel layer (DTensor parameters without FSDP); and that without
    strict both train in PyTorch."""
    import ortrain
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh(torch.device(DEVICE).type, (dist.get_world_size(),))
    layer_only = TinyLM(unused_layer=False).to(DEVICE)
    fully_shard(layer_only.hidden)
    parallel = parallelize_module(TinyLM(unused_layer=False).to(DEVICE), mesh, {"head": ColwiseParallel()})
    x = torch.randint(0, VOCAB, (BATCH, SEQ)).to(DEVICE)
    out = {}
    for name, model in (("layer_only", layer_only), ("tensor_parallel", parallel)):
        ortrain.accelerate(model, device="cpu" if DEVICE == "cpu" else "cuda", strict=True)
        try:
            model(x).sum().backward()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            out[name] = str(exc)
        ortrain.deaccelerate(model)
        ortrain.accelerate(model, device="cpu" if DEVICE == "cpu" else "cuda")
        model(x).sum().backward()
        out[name + "_calls"] = [model.__dict__["_ortrain_state"].calls, model.__dict__["_ortrain_state"].engine_calls]
    return out


#: ORTTrainer scenarios: name -> (gradient_accumulation_steps, allreduce_post_accumulation,
#: ZeRO stage)
TRAINER_SCENARIOS = {
    "trainer_every_micro_batch": (2, False, 0),
    "trainer_post_accumulation": (2, True, 0),
    "trainer_no_accumulation": (1, False, 0),
    "trainer_zero_stage1": (2, True, 1),
}


def _trainer_batches(rank: int, count: int) -> list:
    g = torch.Generator().manual_seed(50 + rank)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH * SEQ,), generator=g))
            for _ in range(count)]


def _trainer_loss(out, target):
    return F.cross_entropy(out.view(-1, VOCAB), target)


def _train_trainer(name: str, world: bool) -> dict:
    """ORTTrainer with options['distributed'] on this rank's batches (`world`), or alone on the
    batches of every rank laid side by side: the mean loss over both ranks' batches has the
    gradient the ranks' averaged gradients must equal."""
    import ortrain
    from ortrain import optim

    accum, post, zero = TRAINER_SCENARIOS[name]
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(200 + rank if world else 200)  # the group broadcasts rank 0's weights
    model = TinyLM(unused_layer=False)
    desc = {"inputs": [("x", ["batch", "seq"]), ("target", ["n"])], "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}
    options = {"batch": {"gradient_accumulation_steps": accum}, "utils": {"grad_norm_clip": 0.5}}
    if world:
        options["distributed"] = {"world_rank": rank, "world_size": size, "allreduce_post_accumulation": post,
                                  "deepspeed_zero_optimization": {"stage": zero}}
    trainer = ortrain.ORTTrainer(model, desc, optim.AdamConfig(lr=0.01), loss_fn=_trainer_loss, options=options)
    per_rank = [_trainer_batches(r, STEPS * accum) for r in range(size)]
    losses = []
    for k in range(STEPS * accum):
        if world:
            x, y = per_rank[rank][k]
        else:
            x = torch.cat([b[k][0] for b in per_rank])
            y = torch.cat([b[k][1] for b in per_rank])
        losses.append(trainer.train_step(x, y)[0].item())
    return {"losses": losses, "steps": trainer.step, "state_kept": sorted(trainer.state_dict()["optimizer"]["state"]),
            "parameters": [n for n, _ in model.named_parameters()],
            "params": [p.detach().double().sum().item() for p in model.parameters()],
            "param_abs": [p.detach().double().abs().sum().item() for p in model.parameters()]}


def main() -> None:
    out_dir = sys.argv[1]
    names = sys.argv[2:] or [*SCENARIOS, *FSDP_SCENARIOS]
    if DEVICE != "cpu":
        torch.cuda.set_device(torch.device(DEVICE))
    dist.init_process_group("gloo" if DEVICE == "cpu" else "nccl")
    results = {}
    for name in names:
        train = _train_fsdp if name in FSDP_SCENARIOS else _train
        try:
            results[name] = {"eager": train(name, False), "ortrain": train(name, True)}
        except Exception:  # noqa: BLE001 - reported by the test, scenario by scenario
            import traceback

            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if not sys.argv[2:]:
        try:
            results["refusals"] = _refusals()
        except Exception:  # noqa: BLE001
            import traceback

            results["refusals"] = {"error": traceback.format_exc()}
        dist.barrier()
    if not sys.argv[2:] and DEVICE == "cpu":
        for name in TRAINER_SCENARIOS:
            try:
                results[name] = {"ranks": _train_trainer(name, True), "alone": _train_trainer(name, False)}
            except Exception:  # noqa: BLE001
                import traceback

                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"world_size": dist.get_world_size(), "results": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
