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
    assert "ortrain --check: 2 steps agree" in capsys.readouterr().out
