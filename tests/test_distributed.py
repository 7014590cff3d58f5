"""Data-parallel training: ortrain under DistributedDataParallel, two ranks started by torchrun
(gloo on the CPU, as Spark's TorchDistributor starts them on a CPU cluster), against plain
PyTorch DDP from the same initial weights on the same batches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ortrain
from ortrain.errors import OrtrainError, UnsupportedError

WORKER = Path(__file__).with_name("distributed_worker.py")
FUSED = {"accelerate_then_wrap", "wrap_then_accelerate", "bucket_views_sgd", "no_sync_accumulation_clip"}


def _torchrun(out: Path, ranks: int, device: str) -> list:
    """Runs the worker's scenarios on `ranks` processes; each rank's results."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ORTRAIN_TEST_DEVICE=device)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(WORKER),
           str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(ranks)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("ddp"), 2, "cpu")


def _worker():
    sys.path.insert(0, str(WORKER.parent))
    try:
        import distributed_worker
    finally:
        sys.path.pop(0)
    return distributed_worker


def _scenarios(kind: str = "SCENARIOS") -> list:
    return list(getattr(_worker(), kind))


def _as_pytorch(ranks: list, name: str, rel: float) -> list:
    """(eager, ortrain) results of each rank for scenario `name`, after checking what holds for
    every scenario: no error, the same whole weights on every rank (gradients averaged) after
    training on its own batches, losses and weights within `rel` of PyTorch's, and every call in
    the engine."""
    errors = [r["results"][name].get("error") for r in ranks]
    assert not any(errors), "\n".join(e for e in errors if e)
    eager = [r["results"][name]["eager"] for r in ranks]
    ours = [r["results"][name]["ortrain"] for r in ranks]
    if len(ranks) > 1:
        assert ours[0]["params"] == ours[1]["params"] and ours[0]["param_abs"] == ours[1]["param_abs"]
        assert ours[0]["losses"] != ours[1]["losses"]
    for e, o in zip(eager, ours):
        assert o["losses"] == pytest.approx(e["losses"], rel=rel)
        assert o["params"] == pytest.approx(e["params"], rel=rel, abs=rel)
        assert o["param_abs"] == pytest.approx(e["param_abs"], rel=rel)
        assert o["calls"] > 0 and o["engine_calls"] == o["calls"]
    return list(zip(eager, ours))


def _check_scenario(ranks: list, name: str, rel: float) -> None:
    for _, o in _as_pytorch(ranks, name, rel):
        # the wrapper is seen as accelerated
        assert o["is_accelerated"] and not o["after_deaccelerate"]
        assert o["explain"].startswith("TinyLM")
        # the loss joins the engine graph unless DDP needs the output's autograd graph
        assert (o["fused_loss_calls"] > 0) == (name in FUSED)


@pytest.mark.parametrize("name", _scenarios())
def test_ddp_ranks_train_as_pytorch_ddp(ranks, name):
    assert [r["world_size"] for r in ranks] == [2, 2]
    _check_scenario(ranks, name, 1e-5)


@pytest.mark.gpu
def test_ddp_on_cuda_trains_as_pytorch_ddp(tmp_path):
    """Every scenario on the GPU (NCCL): one rank per GPU, at most two."""
    from conftest import require_cuda

    require_cuda()
    ranks = _torchrun(tmp_path, min(2, torch.cuda.device_count()), "cuda")
    for name in _scenarios():
        _check_scenario(ranks, name, 1e-4)
    for name in _scenarios("FSDP_SCENARIOS"):
        _check_fsdp(ranks, name, 1e-4)


def _check_fsdp(ranks: list, name: str, rel: float) -> None:
    for e, o in _as_pytorch(ranks, name, rel):  # the weights there: gathered from the shards
        # sums of logits of either sign: within `rel` of the sum of their sizes
        assert o["inference_abs"] == pytest.approx(e["inference_abs"], rel=rel)
        assert o["inference"] == pytest.approx(e["inference"], abs=rel * e["inference_abs"])
        assert o["logits_abs"] == pytest.approx(e["logits_abs"], rel=rel)
        for got, want, size in zip(o["logits_read"], e["logits_read"], e["logits_abs"]):
            assert got == pytest.approx(want, abs=rel * size)
        # every training loss fused into the engine (FSDP's backward hook on the lazy output ran
        # at the loss; the last call is under no_grad), and the layers were resharded after the
        # inference call as FSDP's own post-forward does
        if name.endswith("_labels"):
            # the model's own loss ran alone once; reading its logits then switched the call to
            # the whole graph (engine/model_loss.py)
            assert o["model_loss_calls"] == 1 and o["fused_loss_calls"] == 0
        else:
            assert o["fused_loss_calls"] == o["calls"] - 1
        assert e["layers_sharded"] and o["layers_sharded"]
        # explain's training memory counts each rank's shards, not the whole model (before, every
        # DTensor's address 0 made them one tensor), plus the gathered parameters and gradients
        estimate, held = o["memory"]
        assert estimate == held
        assert o["is_accelerated"] and not o["after_deaccelerate"]
        first, *rest = o["explain"].splitlines()
        assert first.startswith("FSDPTinyLM:") and first.endswith("optimizer in the engine")
        layers = len(_worker().FSDP_SCENARIOS[name][0])
        assert f"FSDP2 (fully_shard on {1 + layers} module" in rest[0] and "the engine steps each rank's shards" in rest[0]


@pytest.mark.parametrize("name", _scenarios("FSDP_SCENARIOS"))
def test_fsdp2_model_trains_in_the_engine_as_pytorch_fsdp2(ranks, name):
    """fully_shard on the model (and on its layers): the engine gathers the shards, runs the
    step, FSDP reduce-scatters the gradients; losses, weights and an inference call as PyTorch
    FSDP2's. Before, the engine's optimizer read the DTensor shards at address 0 (a segfault)
    and the export failed on the DTensors (every call in PyTorch). With bf16 parameters
    (MixedPrecisionPolicy) the engine runs the bf16 graph: its matmuls sum in another order than
    torch's, and bf16 rounds those differences up to a few parts in a thousand a step."""
    bf16 = _worker().FSDP_SCENARIOS[name][5] is not None
    _check_fsdp(ranks, name, 3e-2 if bf16 else 1e-5)


def test_shards_nothing_gathers_are_refused_by_name(ranks):
    for r in ranks:
        out = r["results"]["refusals"]
        assert "error" not in out, out.get("error")
        assert "fully_shard was applied to 'hidden' but not to TinyLM itself; apply it to the model too" in out["layer_only"]
        assert "parameter 'head.weight' is a DTensor, a shard (tensor parallelism" in out["tensor_parallel"]
        # without strict, the call runs in PyTorch
        assert out["layer_only_calls"] == [1, 0] and out["tensor_parallel_calls"] == [1, 0]


@pytest.mark.parametrize("name", _scenarios("TRAINER_SCENARIOS"))
def test_ort_trainer_data_parallel_averages_the_ranks_gradients(ranks, name):
    """ORTTrainer's options['distributed'] on two ranks trains as one process on both ranks'
    batches side by side (mean loss: the gradient is the ranks' average)."""
    errors = [r["results"][name].get("error") for r in ranks]
    assert not any(errors), "\n".join(e for e in errors if e)
    world = [r["results"][name]["ranks"] for r in ranks]
    alone = ranks[0]["results"][name]["alone"]
    assert world[0]["params"] == world[1]["params"] and world[0]["param_abs"] == world[1]["param_abs"]
    assert world[0]["steps"] == alone["steps"] == 4
    assert world[0]["losses"] != world[1]["losses"]
    for k, loss in enumerate(alone["losses"]):  # the joint batch's loss is the ranks' mean loss
        assert loss == pytest.approx((world[0]["losses"][k] + world[1]["losses"][k]) / 2, rel=1e-4)
    assert world[0]["params"] == pytest.approx(alone["params"], rel=1e-4, abs=1e-4)
    assert world[0]["param_abs"] == pytest.approx(alone["param_abs"], rel=1e-4)
    kept = [set(w["state_kept"]) for w in world]
    if _worker().TRAINER_SCENARIOS[name][2] == 1:
        # ZeRO stage 1: each rank keeps the optimizer state of its part of the parameters only
        assert kept[0] and kept[1] and not kept[0] & kept[1] and kept[0] | kept[1] == set(alone["parameters"])
    else:
        assert kept[0] == kept[1] == set(alone["parameters"])


def test_ort_trainer_distributed_options_name_what_is_wrong():
    model = torch.nn.Linear(4, 2)
    desc = {"inputs": [("x", ["b", 4])], "outputs": [("loss", [], True)]}
    make = lambda d: ortrain.ORTTrainer(model, desc, ortrain.optim.SGDConfig(lr=0.1),  # noqa: E731
                                        loss_fn=lambda out: out.sum(), options={"distributed": d})
    env = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    try:
        with pytest.raises(OrtrainError, match=r"world_rank 1, world_size 2.*MASTER_ADDR and MASTER_PORT are not set.*torchrun"):
            make({"world_rank": 1, "world_size": 2})
    finally:
        os.environ.update(env)
    with pytest.raises(ValueError, match=r"world_rank'\] = 2: must be below world_size \(2\)"):
        make({"world_rank": 2, "world_size": 2})
    with pytest.raises(UnsupportedError, match=r"data_parallel_size'\] = 2 with world_size 4.*horizontal or pipeline"):
        make({"world_size": 4, "data_parallel_size": 2})
    with pytest.raises(UnsupportedError, match=r"horizontal_parallel_size'\] = 2: not supported yet"):
        make({"horizontal_parallel_size": 2})
    with pytest.raises(UnsupportedError, match=r"deepspeed_zero_optimization'\] = \{'stage': 2\}: stage 2 is not "
                                               r"supported yet.*fully_shard"):
        make({"deepspeed_zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match=r"deepspeed_zero_optimization'\] = \{'stage': 5\}: 'stage' must be"):
        make({"deepspeed_zero_optimization": {"stage": 5}})


def test_a_ddp_left_unsynchronised_is_not_what_accelerate_returns(ranks):
    """Before, accelerate(DDP(m)) took over the wrapper's forward: the ranks' weights drifted
    apart silently. Now the weights of both ranks are equal after wrap_then_accelerate."""
    a, b = (r["results"]["wrap_then_accelerate"]["ortrain"]["params"] for r in ranks)
    assert a == b


def test_data_parallel_without_gpus_calls_its_module_in_the_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    wrapped = torch.nn.DataParallel(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    assert ortrain.accelerate(wrapped, opt, strict=True) is wrapped
    assert ortrain.is_accelerated(wrapped) and ortrain.is_accelerated(model)
    for step in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        for m, o in ((wrapped, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert model.__dict__["_ortrain_state"].engine_calls == 3
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    ortrain.deaccelerate(wrapped)
    assert not ortrain.is_accelerated(model)


def test_data_parallel_over_several_gpus_is_refused_with_what_to_use():
    model = torch.nn.Linear(3, 3)
    wrapped = torch.nn.DataParallel.__new__(torch.nn.DataParallel)  # no GPUs here to build one over two
    torch.nn.Module.__init__(wrapped)
    wrapped.module, wrapped.device_ids = model, [0, 1]
    with pytest.raises(OrtrainError, match=r"DataParallel over 2 GPUs.*use DistributedDataParallel, one process per GPU"):
        ortrain.accelerate(wrapped)
    assert not ortrain.is_accelerated(model)
