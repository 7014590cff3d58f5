"""accelerate's `dynamic` option: which input sizes an exported graph takes. "auto" (the default)
exports the first call with its sizes fixed and, the first time the sizes change, once more for
any sizes; True exports for any sizes at once; False exports once per set of sizes. Every call,
whatever graph runs it, trains like PyTorch."""
import copy

import pytest

import models
import ortrain
import ortrain.export as export_pkg
from parity import grads_match_at_sizes

NTOK = 500
SIZES = [(35, 20), (35, 20), (17, 20), (35, 7), (17, 20)]


@pytest.fixture
def exports(monkeypatch):
    """The `dynamic` flag of every export accelerate asks for (export_cached is looked up from
    ortrain.export at each call); the export cache is off so each request really exports."""
    monkeypatch.setenv("ORTRAIN_EXPORT_CACHE", "0")
    seen = []
    real = export_pkg.export_cached

    def counting(module, args=(), kwargs=None, **options):
        seen.append(options.get("dynamic", True))
        return real(module, args, kwargs, **options)

    monkeypatch.setattr(export_pkg, "export_cached", counting)
    return seen


def _train_both(acc, ref, sizes):
    grads_match_at_sizes(acc, ref, sizes, NTOK)


def _model():
    ref, _, _ = models.tutorial_transformer(NTOK, dropout=0.0)
    return ref, copy.deepcopy(ref)


def test_auto_exports_fixed_sizes_first_then_once_for_any_sizes(exports):
    ref, acc = _model()
    ortrain.accelerate(acc)
    _train_both(acc, ref, SIZES[:2])
    assert exports == [False]
    assert "input sizes fixed to [35, 20]" in ortrain.explain(acc)
    _train_both(acc, ref, SIZES[2:])
    assert exports == [False, True]  # the second set of sizes: one more export, for all sizes
    text = ortrain.explain(acc)
    assert "any input sizes" in text and "fixed to" not in text, text
    assert acc._ortrain_state.engine_calls == acc._ortrain_state.calls == len(SIZES)


def test_dynamic_true_exports_once_and_false_once_per_set_of_sizes(exports):
    ref, acc = _model()
    ortrain.accelerate(acc, dynamic=True)
    _train_both(acc, ref, SIZES)
    assert exports == [True]
    ref, acc = _model()
    ortrain.accelerate(acc, dynamic=False)
    _train_both(acc, ref, SIZES)
    assert exports == [True, False, False, False]  # (35, 20), (17, 20), (35, 7)
    assert ortrain.explain(acc).count("input sizes fixed to") == 3


def test_auto_keeps_fixed_sizes_when_symbolic_sizes_cannot_be_exported(exports, monkeypatch):
    real = export_pkg.export_cached

    def no_symbolic_sizes(module, args=(), kwargs=None, **options):
        if options.get("dynamic", True):
            raise RuntimeError("this model cannot be exported with symbolic sizes")
        return real(module, args, kwargs, **options)

    monkeypatch.setattr(export_pkg, "export_cached", no_symbolic_sizes)
    ref, acc = _model()
    ortrain.accelerate(acc)
    with _no_warning():
        _train_both(acc, ref, SIZES)
    state = acc._ortrain_state
    assert state.engine_calls == state.calls == len(SIZES)  # no call fell back to PyTorch
    assert ortrain.explain(acc).count("input sizes fixed to") == 3


def test_changing_dynamic_re_exports_and_bad_values_name_the_option(exports):
    ref, acc = _model()
    ortrain.accelerate(acc)
    _train_both(acc, ref, SIZES[:1])
    ortrain.accelerate(acc, dynamic=True)
    _train_both(acc, ref, SIZES[:1])
    assert exports == [False, True]
    ortrain.accelerate(acc)  # None keeps what was set: no new export
    _train_both(acc, ref, SIZES[2:3])
    assert exports == [False, True]
    for bad in ("yes", 1, None.__class__):
        with pytest.raises(ValueError, match=r"dynamic=.* is not one of 'auto', True, False"):
            ortrain.accelerate(acc, dynamic=bad)


class _no_warning:
    """Fails the test if a warning (a fallback to PyTorch) is raised inside."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self._caught = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        ortrain_warnings = [str(w.message) for w in self._caught if "ortrain" in str(w.message)]
        assert not ortrain_warnings, ortrain_warnings
