"""%ort / %%ort in a real IPython shell against a real MLflow server: argument errors, a baseline
run's metrics/params/tags, a cell that raises (traceback at the user's line, run FAILED), Ctrl-C
(KILLED), a cell with no optimizer step (clear message, no run), NaN loss (logged, warned), and
compare without the engine (a clear error before anything runs)."""
from __future__ import annotations

import math
import re

import pytest

from conftest import runs_of

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 4, 40))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = torch.nn.CrossEntropyLoss()
def batches(n):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield torch.randint(0, 40, (6, 4), generator=g), torch.randint(0, 40, (6,), generator=g)
"""

LOOP = """
for i, (x, y) in enumerate(batches({n})):
    loss = crit(model(x), y){extra}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def setup(shell):
    assert shell.run_cell(SETUP).success


@pytest.mark.parametrize("line, message", [
    ("turbo", "unknown mode 'turbo'"),
    ("baseline --max-steps 0", "--max-steps must be at least 1"),
    ("baseline --log-every 0", "--log-every must be at least 1"),
    ("baseline --max-steps many", "invalid int value"),
    ("baseline --bogus", "unrecognized arguments"),
])
def test_argument_errors(shell, capsys, line, message):
    setup(shell)
    res = shell.run_cell(f"%%ort {line}\nopt.step()")
    out = capsys.readouterr()
    assert message in out.out + out.err
    assert not runs_of(shell_client(), "ortrain-args")


def shell_client():
    import os

    from ortrain._ortrain import MlflowClient

    return MlflowClient(os.environ["ORTRAIN_TRACKING_URI"])


def test_line_magic_errors(shell, capsys):
    setup(shell)
    shell.run_cell("%ort frobnicate")
    assert "unknown command 'frobnicate'" in "".join(capsys.readouterr())
    shell.run_cell("%ort accelerate --device tpu")
    assert "invalid choice" in "".join(capsys.readouterr())
    shell.run_cell("%ort status")
    out = capsys.readouterr().out
    assert "metrics go to: http://127.0.0.1" in out


def test_baseline_run_is_logged(shell, capsys):
    setup(shell)
    res = shell.run_cell("%%ort baseline --experiment m-baseline --max-steps 7 --log-every 3 --no-progress\n"
                         + LOOP.format(n=50, extra=""))
    assert res.success, res.error_in_exec
    out = capsys.readouterr().out
    assert "[pytorch] step 3:" in out and "[pytorch] step 7:" in out
    c = shell_client()
    (run,) = runs_of(c, "m-baseline")
    assert run["status"] == "FINISHED"
    for key in ("batch_time_ms", "loss", "ppl", "learning_rate", "samples_per_sec", "tokens_per_sec"):
        assert [s for s, _, _ in c.get_metric_history(run["run_id"], key)] == list(range(7)), key
    p = run["params"]
    assert p["model_class"] == "Sequential" and p["optimizer"] == "SGD" and p["optimizer.lr"] == "0.1"
    assert p["parameter_count"] == str(40 * 8 + 8 * 4 * 40 + 40) and p["batch_shape"] == "6x4"
    assert p["batch_size"] == "6" and "torch_version" in p and p["mode"] == "baseline"
    assert run["tags"]["ortrain.mode"] == "baseline" and run["tags"]["ortrain.compare_group"]
    assert run["tags"]["mlflow.runName"] == "pytorch"
    # the same loss as a plain loop would have computed: the magic does not change training
    losses = [v for _, v, _ in c.get_metric_history(run["run_id"], "loss")]
    assert all(math.isfinite(v) for v in losses)


KWARGS_MODEL_SETUP = """
import torch
torch.manual_seed(0)
class ByName(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 40)
    def forward(self, input_ids=None):
        return self.head(self.emb(input_ids))
model = ByName()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
micro_losses = []
"""

ACCUMULATING_LOOP = """
g = torch.Generator().manual_seed(1)
for step in range(3):
    for micro in range(2):
        ids = torch.randint(0, 40, (6, 4), generator=g)
        logits = model(input_ids=ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 40), ids.view(-1)) / 2
        loss.backward()
        micro_losses.append(loss.item())
    opt.step()
    opt.zero_grad()
"""


def test_accumulated_micro_batches_and_keyword_inputs_are_one_logged_step(shell):
    """Gradient accumulation (two micro-batches a step, each loss halved) logs one step whose
    loss is the step's mean loss, not the last micro-batch's half; a model called by keyword
    (`model(input_ids=ids)`, as Hugging Face's) still gives the batch size and tokens."""
    assert shell.run_cell(KWARGS_MODEL_SETUP).success
    res = shell.run_cell("%%ort baseline --experiment m-accumulate --no-progress\n" + ACCUMULATING_LOOP)
    assert res.success, res.error_in_exec
    c = shell_client()
    (run,) = runs_of(c, "m-accumulate")
    micro = shell.user_ns["micro_losses"]
    logged = [v for _, v, _ in c.get_metric_history(run["run_id"], "loss")]
    assert logged == pytest.approx([micro[2 * k] + micro[2 * k + 1] for k in range(3)], rel=1e-6)
    # each half a cross-entropy divided by a number: the step's loss is still the mean
    # cross-entropy, and its perplexity is logged
    ppl = [v for _, v, _ in c.get_metric_history(run["run_id"], "ppl")]
    assert ppl == pytest.approx([math.exp(v) for v in logged], rel=1e-6)
    for key in ("samples_per_sec", "tokens_per_sec"):
        assert [s for s, _, _ in c.get_metric_history(run["run_id"], key)] == [0, 1, 2], key
    assert run["params"]["batch_shape"] == "6x4" and run["params"]["batch_size"] == "6"


@pytest.mark.parametrize("extra, logs_ppl", [
    (" / torch.tensor(2.0)", True),  # DivBackward0 by a tensor without a gradient
    (".double() * 3", True),  # a cast, then MulBackward1
    (".reshape(1)", True),  # a one-element view
    (" * temperature", False),  # times a trainable parameter: no longer a per-token loss
    (" / crit(model(x), y).detach() + crit(model(x), y)", False),  # a sum of two losses
])
def test_perplexity_is_logged_for_a_scaled_cross_entropy(shell, extra, logs_ppl):
    """A cross-entropy seen through casts, views and scalings by what has no gradient (HF's
    sum / num_items_in_batch, a loop's loss / accumulation_steps) logs perplexity; a loss that
    a trainable parameter scales, or a sum of losses, logs none."""
    setup(shell)
    assert shell.run_cell("temperature = torch.nn.Parameter(torch.tensor(1.5))\n"
                          "opt.add_param_group({'params': [temperature]})").success
    name = "m-ppl-" + re.sub(r"\W+", "-", extra).strip("-")
    res = shell.run_cell(f"%%ort baseline --experiment {name} --no-progress\n" + LOOP.format(n=3, extra=extra))
    assert res.success, res.error_in_exec
    c = shell_client()
    (run,) = runs_of(c, name)
    losses = [v for _, v, _ in c.get_metric_history(run["run_id"], "loss")]
    ppl = [v for _, v, _ in c.get_metric_history(run["run_id"], "ppl")]
    assert len(losses) == 3
    assert ppl == (pytest.approx([math.exp(v) for v in losses], rel=1e-6) if logs_ppl else [])


def test_cell_error_surfaces_and_run_fails(shell, capsys):
    setup(shell)
    body = LOOP.format(n=5, extra="\n    if i == 2:\n        raise ValueError('boom in user code')")
    res = shell.run_cell("%%ort baseline --experiment m-error --no-progress\n" + body)
    assert isinstance(res.error_in_exec, ValueError) and str(res.error_in_exec) == "boom in user code"
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "ValueError: boom in user code" in out
    # the cell's own numbering: line 1 is `%%ort`, 2 is blank, the raise is on line 6
    assert "----> 6     raise ValueError('boom in user code')" in out, out
    (run,) = runs_of(shell_client(), "m-error")
    assert run["status"] == "FAILED"


def test_keyboard_interrupt_kills_the_run(shell):
    setup(shell)
    body = LOOP.format(n=5, extra="\n    if i == 2:\n        raise KeyboardInterrupt")
    res = shell.run_cell("%%ort baseline --experiment m-kill --no-progress\n" + body)
    assert isinstance(res.error_in_exec, KeyboardInterrupt)
    (run,) = runs_of(shell_client(), "m-kill")
    assert run["status"] == "KILLED"


def test_cell_without_optimizer_step_leaves_no_run(shell, capsys):
    setup(shell)
    res = shell.run_cell("%%ort baseline --experiment m-nostep\ny = model(torch.zeros(2, 4, dtype=torch.long))")
    assert res.success
    assert "without calling optimizer.step()" in capsys.readouterr().err
    assert runs_of(shell_client(), "m-nostep") == []


def test_nan_loss_is_logged_and_warned(shell, capsys):
    setup(shell)
    body = LOOP.format(n=6, extra="\n    loss = loss * float('nan') if i > 0 else loss")
    res = shell.run_cell("%%ort baseline --experiment m-nan --no-progress\n" + body)
    assert res.success, res.error_in_exec
    assert "ortrain warning: loss is nan at step 1" in capsys.readouterr().err
    c = shell_client()
    (run,) = runs_of(c, "m-nan")
    hist = c.get_metric_history(run["run_id"], "loss")
    assert len(hist) == 6 and math.isfinite(hist[0][1]) and all(math.isnan(v) for _, v, _ in hist[1:])
    assert run["status"] == "FINISHED"


def test_optimizer_step_replaced_on_the_instance_counts_once(shell):
    setup(shell)
    # what an engine may do: replace step() on the optimizer object; with and without calling
    # torch's own step (and so its hooks) underneath
    shell.run_cell("import types\n"
                   "opt.step = types.MethodType(lambda self, closure=None: type(self).step(self, closure), opt)")
    assert shell.run_cell("%%ort baseline --experiment m-wrapped --no-progress\n" + LOOP.format(n=5, extra="")).success
    shell.run_cell("opt2 = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                   "opt.step = lambda closure=None: None\ndel opt2")
    assert shell.run_cell("%%ort baseline --experiment m-bypass --no-progress\n" + LOOP.format(n=4, extra="")).success
    c = shell_client()
    for exp, n in (("m-wrapped", 5), ("m-bypass", 4)):
        (run,) = runs_of(c, exp)
        assert [s for s, _, _ in c.get_metric_history(run["run_id"], "loss")] == list(range(n)), exp
