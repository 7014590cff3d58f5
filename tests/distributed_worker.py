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

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.emb(x))))


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


#: ORTTrainer scenarios: name -> (gradient_accumulation_steps, allreduce_post_accumulation)
TRAINER_SCENARIOS = {
    "trainer_every_micro_batch": (2, False),
    "trainer_post_accumulation": (2, True),
    "trainer_no_accumulation": (1, False),
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

    accum, post = TRAINER_SCENARIOS[name]
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(200 + rank if world else 200)  # the group broadcasts rank 0's weights
    model = TinyLM(unused_layer=False)
    desc = {"inputs": [("x", ["batch", "seq"]), ("target", ["n"])], "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}
    options = {"batch": {"gradient_accumulation_steps": accum}, "utils": {"grad_norm_clip": 0.5}}
    if world:
        options["distributed"] = {"world_rank": rank, "world_size": size, "allreduce_post_accumulation": post}
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
    return {"losses": losses, "steps": trainer.step,
            "params": [p.detach().double().sum().item() for p in model.parameters()],
            "param_abs": [p.detach().double().abs().sum().item() for p in model.parameters()]}


def main() -> None:
    out_dir = sys.argv[1]
    names = sys.argv[2:] or list(SCENARIOS)
    if DEVICE != "cpu":
        torch.cuda.set_device(torch.device(DEVICE))
    dist.init_process_group("gloo" if DEVICE == "cpu" else "nccl")
    results = {}
    for name in names:
        try:
            results[name] = {"eager": _train(name, False), "ortrain": _train(name, True)}
        except Exception:  # noqa: BLE001 - reported by the test, scenario by scenario
            import traceback

            results[name] = {"error": traceback.format_exc()}
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
