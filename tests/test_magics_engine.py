"""The magics' engine-facing paths with the engine contract (accelerate / deaccelerate /
is_accelerated / explain): `%ort accelerate` picking the model and optimizer, `%ort off`,
`%ort status`, the accelerated cell mode, and `--check`, with the real engine."""
from __future__ import annotations

from conftest import runs_of
from test_magics import LOOP, SETUP, shell_client


def test_accelerate_off_status(shell, engine_api, capsys):
    assert shell.run_cell(SETUP).success
    shell.run_cell("%ort accelerate --device cpu")
    out = capsys.readouterr().out
    assert "ortrain: model (Sequential, 1,640 parameters) runs in the engine on cpu" in out
    assert engine_api["is_accelerated"](shell.user_ns["model"])
    shell.run_cell("%ort status")
    assert "model: Sequential on cpu (accelerated)" in capsys.readouterr().out
    shell.run_cell("%ort off")
    assert "model runs in plain PyTorch again" in capsys.readouterr().out
    assert not engine_api["is_accelerated"](shell.user_ns["model"])


def test_accelerate_takes_a_precision(shell, engine_api, capsys):
    assert shell.run_cell(SETUP).success
    shell.run_cell("%ort accelerate --precision fp16")
    out = "".join(capsys.readouterr())
    assert "precision='fp16' needs device='cuda'" in out and "use precision='bf16'" in out
    assert not engine_api["is_accelerated"](shell.user_ns["model"])
    shell.run_cell("%ort accelerate --precision bf16")
    assert "runs in the engine on cpu" in capsys.readouterr().out
    assert shell.user_ns["model"].__dict__["_ortrain_state"].precision == "bf16"
    shell.run_cell("%ort accelerate --precision half")
    assert "invalid choice" in "".join(capsys.readouterr())


def test_accelerate_can_turn_cuda_graphs_off(shell, engine_api, capsys):
    assert shell.run_cell(SETUP).success
    shell.run_cell("%ort accelerate --no-cuda-graphs")
    assert "runs in the engine on cpu" in capsys.readouterr().out
    assert shell.user_ns["model"].__dict__["_ortrain_state"].cuda_graphs is False


def test_accelerate_needs_a_unique_model(shell, engine_api, capsys):
    assert shell.run_cell(SETUP + "\nother = torch.nn.Linear(3, 3)").success
    shell.run_cell("%ort accelerate")
    assert "several model (nn.Module with parameters)s in the namespace (model, other)" in "".join(capsys.readouterr())
    shell.run_cell("%ort accelerate nothere")
    assert "no variable named 'nothere'" in "".join(capsys.readouterr())
    shell.run_cell("%ort accelerate other")
    assert "other (Linear, 12 parameters)" in capsys.readouterr().out


def test_accelerated_mode_and_check(shell, engine_api, capsys):
    assert shell.run_cell(SETUP).success
    res = shell.run_cell("%%ort --experiment m-acc --max-steps 3 --no-progress\n" + LOOP.format(n=10, extra=""))
    assert res.success, res.error_in_exec
    assert engine_api["is_accelerated"](shell.user_ns["model"])
    c = shell_client()
    (run,) = runs_of(c, "m-acc")
    assert run["tags"]["ortrain.mode"] == "accelerated" and run["status"] == "FINISHED"
    assert len(c.get_metric_history(run["run_id"], "loss")) == 3
    res = shell.run_cell("%%ort --check --max-steps 2\n" + LOOP.format(n=10, extra=""))
    assert res.success, res.error_in_exec
    out = capsys.readouterr().out
    assert "ortrain --check: 2 steps agree" in out
    assert "forward: all" in out and "intermediate values agree" in out


TRAINER_SETUP = """
import torch, ortrain
from ortrain.optim import AdamConfig
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 4, 40))
def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out, y)
trainer = ortrain.ORTTrainer(model, {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]},
                             AdamConfig(lr=1e-2), loss_fn=loss_fn)
def batches(n):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield torch.randint(0, 40, (6, 4), generator=g), torch.randint(0, 40, (6,), generator=g)
"""

TRAINER_LOOP = """
for x, y in batches(5):
    loss = trainer.train_step(x, y)
"""


def test_ortrainer_train_step_is_the_step_boundary(shell, engine_api, capsys):
    """An ORTTrainer loop needs no change: each train_step is one logged step (loss, ppl from the
    cross-entropy inside the user's loss_fn, the config's lr); compare runs the same loop with
    PyTorch eager forward/backward first, from the same trainer state: the loss curves agree."""
    assert shell.run_cell(TRAINER_SETUP).success
    res = shell.run_cell("%%ort --experiment m-trainer --no-progress\n" + TRAINER_LOOP)
    assert res.success, res.error_in_exec
    out = capsys.readouterr().out
    assert "ortrain engine: ORTTrainer: forward, loss, backward and the Adam update of Sequential in the engine" in out
    c = shell_client()
    (run,) = runs_of(c, "m-trainer")
    assert run["status"] == "FINISHED" and run["params"]["optimizer"] == "AdamConfig"
    assert run["params"]["trainer"] == "ORTTrainer" and run["params"]["optimizer.lr"] == "0.01"
    assert run["params"]["batch_shape"] == "6x4" and run["params"]["model_class"] == "Sequential"
    for key in ("batch_time_ms", "loss", "ppl", "learning_rate", "samples_per_sec", "tokens_per_sec"):
        assert [s for s, _, _ in c.get_metric_history(run["run_id"], key)] == list(range(5)), key
    assert not engine_api["is_accelerated"](shell.user_ns["model"])  # the trainer owns the engine path

    res = shell.run_cell("%%ort compare --experiment m-trainer-cmp --no-progress\n" + TRAINER_LOOP)
    assert res.success, res.error_in_exec
    runs = {r["tags"].get("ortrain.role"): r for r in runs_of(c, "m-trainer-cmp")}
    base, acc = runs["baseline"], runs["accelerated"]
    lb = [v for _, v, _ in c.get_metric_history(base["run_id"], "loss")]
    la = [v for _, v, _ in c.get_metric_history(acc["run_id"], "loss")]
    assert len(lb) == len(la) == 5
    # same starting state (the trainer's Adam state restored), same batches: the first losses agree
    assert abs(lb[0] - la[0]) <= 1e-5 * abs(lb[0]), (lb, la)
    for i in range(5):
        assert abs(lb[i] - la[i]) <= 1e-3 * abs(lb[i]), (i, lb, la)


def test_accelerate_finds_a_ddp_model_and_accelerates_the_module_inside(shell, engine_api, capsys, tmp_path):
    """`%ort accelerate` in a notebook whose model is wrapped in DistributedDataParallel (a
    one-rank gloo group here): the wrapper is the model it picks (its module is a child), the
    module inside is what runs in the engine, and DDP's forward still runs around it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert shell.run_cell(SETUP).success
        assert shell.run_cell("from torch.nn.parallel import DistributedDataParallel as DDP\nddp = DDP(model)").success
        shell.run_cell("%ort accelerate")
        out = capsys.readouterr().out
        assert "ortrain: ddp (DistributedDataParallel, 1,640 parameters) runs in the engine on cpu" in out, out
        inner = shell.user_ns["model"]
        assert engine_api["is_accelerated"](shell.user_ns["ddp"]) and engine_api["is_accelerated"](inner)
        assert "_ortrain_state" not in shell.user_ns["ddp"].__dict__
        assert shell.run_cell(LOOP.format(n=3, extra="").replace("model(x)", "ddp(x)")).success
        state = inner.__dict__["_ortrain_state"]
        assert state.calls == state.engine_calls == 3
        shell.run_cell("%ort off")
        assert not engine_api["is_accelerated"](inner)
    finally:
        dist.destroy_process_group()


HF_LABELS_SETUP = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=200, n_layer=1, n_embd=32, n_head=2, n_positions=32,
                                   bos_token_id=199, eos_token_id=199)).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def batches(n):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield torch.randint(0, 200, (2, 16), generator=g)
"""

HF_LABELS_LOOP = """
for ids in batches(4):
    out = model(input_ids=ids, labels=ids)
    opt.zero_grad()
    out.loss.backward()
    opt.step(){extra}
"""


def test_hugging_face_labels_loss_logs_perplexity_in_both_runs(shell, engine_api, capsys):
    """`model(ids, labels=ids).loss` is a cross-entropy in PyTorch (NllLossBackward0) and in the
    engine (the loss-only graph, and the whole graph once the loop reads the logits): both runs
    of `%%ort compare` log ppl for every step."""
    assert shell.run_cell(HF_LABELS_SETUP).success
    c = shell_client()
    for name, extra in (("m-hf-ppl", ""), ("m-hf-ppl-read", "\n    acc = (out.logits.argmax(-1) == ids).float().mean()")):
        res = shell.run_cell(f"%%ort compare --experiment {name} --no-progress\n" + HF_LABELS_LOOP.format(extra=extra))
        assert res.success, res.error_in_exec
        runs = {r["tags"].get("ortrain.role"): r for r in runs_of(c, name)}
        assert runs["accelerated"]["tags"]["ortrain.mode"] == "accelerated"
        for role in ("baseline", "accelerated"):
            ppl = c.get_metric_history(runs[role]["run_id"], "ppl")
            assert [s for s, _, _ in ppl] == list(range(4)), (name, role, ppl)
            assert all(150 < v < 260 for _, v, _ in ppl), (name, role, ppl)  # ~exp(ln 200) at the start
        state = shell.user_ns["model"]._ortrain_state
        assert bool(state.logits_read) == bool(extra), name
