"""The export in a forked child process (ortrain/export/isolated.py) as a user sees it: the
exporter's modules never load into the training process, the graph is the one an export in this
process gives, training matches PyTorch, an export that fails there fails here with the same
reasons, and a child that dies, hangs or cannot send its result costs a warning and an export in
this process, never the user's training."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import models
import ortrain
from ortrain.errors import ExportError
from ortrain.export import export_cached, export_module
from ortrain.export import cache as export_cache
from ortrain.export import isolated

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child is forked: Linux only")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")
    export_cache.clear()
    yield
    export_cache.clear()


def _tutorial():
    model, (x,), _ = models.tutorial_transformer(60, dropout=0.0, seq=7, batch=3)
    return model, x


def test_the_exporter_never_loads_into_the_training_process():
    """A fresh process trains the tutorial model through accelerate(): its graph came from a child,
    onnxscript (the dynamo exporter's translator) was never imported here, and the loss matches
    eager PyTorch's."""
    script = textwrap.dedent("""
        import json, sys
        import torch
        sys.path.insert(0, %r)
        import models, ortrain
        torch.manual_seed(0)
        model, (x,), _ = models.tutorial_transformer(60, dropout=0.0, seq=7, batch=3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        eager = model(x)
        eager_loss = torch.nn.functional.cross_entropy(eager.view(-1, 60), x.view(-1)).item()
        ortrain.accelerate(model, opt)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.view(-1, 60), x.view(-1))
        loss.backward()
        opt.step()
        print(json.dumps({"onnxscript": "onnxscript" in sys.modules,
                          "torch_onnx_exporter": "torch.onnx._internal.exporter._core" in sys.modules,
                          "loss": loss.item(), "eager_loss": eager_loss}))
    """ % os.path.dirname(__file__))
    env = dict(os.environ, ORTRAIN_EXPORT_DISK_CACHE="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["onnxscript"] is False and seen["torch_onnx_exporter"] is False, seen
    assert abs(seen["loss"] - seen["eager_loss"]) < 1e-4, seen


def test_the_child_gives_the_graph_an_export_here_gives(monkeypatch):
    model, x = _tutorial()
    child = export_cached(model, (x,), training=True)
    assert child.in_child
    export_cache.clear()
    monkeypatch.setenv("ORTRAIN_EXPORT_IN_CHILD", "0")
    here = export_cached(model, (x,), training=True)
    assert not here.in_child
    assert child.onnx_bytes == here.onnx_bytes
    for field in ("input_names", "output_names", "param_map", "param_kinds", "aliases", "output_structure",
                  "exporter", "dropout_fixes", "buffer_updates", "static_dims", "constants", "signature"):
        assert getattr(child, field) == getattr(here, field), field


def test_the_module_is_left_as_it_was():
    """The child restores nothing here because it changes nothing here: modes, buffers and the RNG."""
    model, (x,), _ = models.small_cnn()
    model.eval()
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    exported = export_cached(model, (x,), training=True)
    assert exported.in_child and exported.batchnorm_fixes
    assert not any(m.training for m in model.modules())
    assert all(torch.equal(b, buffers[k]) for k, b in model.named_buffers())
    assert torch.equal(torch.random.get_rng_state(), rng)


class _Unexportable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * float(x.sum().item() > 0 and torch.randn(()).item())


def test_an_export_that_fails_in_the_child_fails_here_with_its_reasons(monkeypatch):
    calls = []
    monkeypatch.setattr(ortrain.export, "export_module", lambda *a, **k: calls.append(1) or export_module(*a, **k))
    with pytest.raises(ExportError) as caught:
        export_cached(_Unexportable(), (torch.randn(2, 4),), training=True, exporter="dynamo")
    assert "_Unexportable" in str(caught.value) and "dynamo:" in str(caught.value)
    assert calls == []  # raised as the child raised it, not exported again here


class _DiesInChild(torch.nn.Module):
    """Its forward ends the process it runs in unless that is the test's own process."""

    def __init__(self, how):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.how = how
        self.pid = os.getpid()

    def forward(self, x):
        if os.getpid() != self.pid:
            if self.how == "exit":
                os._exit(3)
            if self.how == "hang":
                import time
                time.sleep(30)
        return self.lin(x)


@pytest.mark.parametrize("how, reason", [("exit", "exit code 3"), ("hang", "within 2 s")])
def test_a_child_that_dies_or_hangs_costs_a_warning_and_an_export_here(monkeypatch, how, reason):
    monkeypatch.setenv("ORTRAIN_EXPORT_CHILD_TIMEOUT", "2")
    model = _DiesInChild(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    expected = model(x)
    ortrain.accelerate(model, opt)
    try:
        with pytest.warns(UserWarning, match=f"exporting in this process instead of a child process: .*{reason}"):
            out = model(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        assert model.lin.weight.grad is not None
    finally:
        ortrain.deaccelerate(model)


def test_where_the_child_is_not_used_it_says_why(monkeypatch):
    model, x = _tutorial()
    assert isolated.why_not_isolated(model, (x,), None) is None
    assert isolated.why_not_isolated(model, (x,), None, quiet_logs=False) == "exporter output requested"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert isolated.why_not_isolated(model, (x,), None) == "a torch.distributed process group is initialised in this process"
    monkeypatch.undo()
    monkeypatch.setenv("ORTRAIN_EXPORT_IN_CHILD", "0")
    assert isolated.why_not_isolated(model, (x,), None) == "ORTRAIN_EXPORT_IN_CHILD=0"
    assert not export_cached(model, (x,), training=True).in_child
