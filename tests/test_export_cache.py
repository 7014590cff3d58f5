"""The in-process export cache (ortrain/export/cache.py) as a user sees it: accelerating the same
module again (what `%%ort compare`, `%ort off`/on and `--check` do) does not run the exporter
again and trains exactly as the first time; a module whose structure or attributes changed, a
new module object, another mode, or ORTRAIN_EXPORT_CACHE=0 exports again. And the disk cache
of translations (ortrain/export/disk_cache.py): a program captured before is not translated
again, a changed forward is."""
import sys

import onnx
import torch

import models
import ortrain
from ortrain.export import export_module
from ortrain.magics import _restore, _snapshot


class _Counter:
    """Counts calls of torch.onnx.export (the exporter every ortrain export goes through);
    `disk=False` turns the disk cache off, so that every export not served from memory counts."""

    def __init__(self, monkeypatch, disk=True):
        if not disk:
            monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")
        monkeypatch.setenv("ORTRAIN_EXPORT_IN_CHILD", "0")  # counted in this process
        self.calls = 0
        original = torch.onnx.export

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.onnx, "export", counting)


def _model():
    model, (x,), _ = models.tutorial_transformer(60, dropout=0.1, seq=7, batch=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, x


def _train(model, opt, x, steps=3):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.view(-1, out.shape[-1]), x.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses


def test_second_accelerate_reuses_the_export_and_trains_identically(monkeypatch):
    counter = _Counter(monkeypatch, disk=False)
    model, opt, x = _model()
    snap = _snapshot(model, opt)
    ortrain.accelerate(model, opt)
    first = _train(model, opt, x)
    weights_first = {k: v.clone() for k, v in model.state_dict().items()}
    assert counter.calls == 1
    assert "reused" not in ortrain.explain(model)

    ortrain.deaccelerate(model)
    _restore(snap, model, opt)
    ortrain.accelerate(model, opt)
    second = _train(model, opt, x)
    assert counter.calls == 1  # no second export
    assert "reused from an earlier export in this process" in ortrain.explain(model)
    assert model._ortrain_state.engine_calls == model._ortrain_state.calls == 3
    assert second == first  # same graph, same dropout masks, same updates: bit-identical
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights_first[k]), k


def test_a_changed_module_a_new_module_or_another_mode_exports_again(monkeypatch):
    counter = _Counter(monkeypatch, disk=False)
    model, opt, x = _model()
    ortrain.accelerate(model, opt)
    _train(model, opt, x, steps=1)
    assert counter.calls == 1

    ortrain.deaccelerate(model)
    model.pos_encoder.dropout.p = 0.0  # a plain attribute the graph bakes in
    ortrain.accelerate(model, opt)
    _train(model, opt, x, steps=1)
    assert counter.calls == 2

    model.eval()  # another mode: its own export, then reused after a re-accelerate
    with torch.no_grad():
        model(x)
    assert counter.calls == 3
    ortrain.deaccelerate(model)
    ortrain.accelerate(model, opt)
    with torch.no_grad():
        model(x)
    assert counter.calls == 3

    other, other_opt, _ = _model()  # same structure, another object
    other.load_state_dict(model.state_dict())
    other.pos_encoder.dropout.p = 0.0
    ortrain.accelerate(other, other_opt)
    _train(other, other_opt, x, steps=1)
    assert counter.calls == 4


def test_cache_off_by_environment(monkeypatch):
    counter = _Counter(monkeypatch, disk=False)
    monkeypatch.setenv("ORTRAIN_EXPORT_CACHE", "0")
    model, opt, x = _model()
    for _ in range(2):
        ortrain.accelerate(model, opt)
        _train(model, opt, x, steps=1)
        ortrain.deaccelerate(model)
    assert counter.calls == 2


# ------------------------------------------------------------------ the disk cache of translations
def _activation(x):
    return torch.relu(x)


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _activation(self.lin(x))


def _export_and_run(x):
    torch.manual_seed(0)
    model = _Small()
    expected = model(x)
    exported = export_module(model, (x,), weights=False, dynamic=False)  # as accelerate exports a first call
    ortrain.accelerate(model)
    torch.testing.assert_close(model(x), expected)
    return exported


def test_disk_cache_skips_the_translation_of_a_program_seen_before(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTRAIN_EXPORT_CACHE_DIR", str(tmp_path))
    counter = _Counter(monkeypatch)
    x = torch.randn(3, 4)
    first = _export_and_run(x)
    assert counter.calls == 1 and len(list(tmp_path.glob("*.onnx"))) == 1
    second = _export_and_run(x)  # a new module object: captured again, translation read back
    assert counter.calls == 1
    assert second.onnx_bytes == first.onnx_bytes and second.param_map == first.param_map


def test_disk_cache_follows_the_forward_code(monkeypatch, tmp_path):
    """Same module structure, other forward code (a helper redefined, as in a notebook): the
    captured program differs, so the cached translation is not used."""
    monkeypatch.setenv("ORTRAIN_EXPORT_CACHE_DIR", str(tmp_path))
    counter = _Counter(monkeypatch)
    x = torch.randn(3, 4)
    _export_and_run(x)
    monkeypatch.setattr(sys.modules[__name__], "_activation", torch.tanh)
    tanh = _export_and_run(x)  # asserts the engine computes tanh, as PyTorch does
    assert counter.calls == 2
    assert any(n.op_type == "Tanh" for n in onnx.load_from_string(tanh.onnx_bytes).graph.node)
    monkeypatch.setattr(sys.modules[__name__], "_activation", torch.relu)
    _export_and_run(x)
    assert counter.calls == 2  # relu's translation is still there


def test_unreadable_disk_cache_entry_is_a_miss(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTRAIN_EXPORT_CACHE_DIR", str(tmp_path))
    counter = _Counter(monkeypatch)
    x = torch.randn(3, 4)
    _export_and_run(x)
    (entry,) = tmp_path.glob("*.onnx")
    entry.write_bytes(b"truncated")
    _export_and_run(x)
    assert counter.calls == 2
    monkeypatch.setenv("ORTRAIN_EXPORT_DISK_CACHE", "0")
    _export_and_run(x)
    assert counter.calls == 4  # export_module's and accelerate's own export both translate
