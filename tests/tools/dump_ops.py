"""Prints, per zoo model and exporter, the export result: time, op-type counts, fixes, and
whether the eval-mode graph runs at a second shape (onnx.reference) with PyTorch's numbers.

Usage: PYTHONPATH=pyext/python python tests/tools/dump_ops.py [--full] [model ...]
Models: tutorial gpt2 bert cnn (default all). Training-mode export with dropout 0.1 (so Dropout
nodes show). --full uses the tutorial's full vocabulary (28782). Output is Markdown.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402
from ortrain.export import export_module, unflatten_outputs  # noqa: E402

HF = {"return_dict": False}


def build(name, full=False):
    if name == "tutorial":
        m, x, _ = models.tutorial_transformer(ntokens=28782 if full else 1000, dropout=0.1)
        return m, x, None, models.tutorial_inputs(28782 if full else 1000, seq=9, batch=3)
    if name == "gpt2":
        m, x, _ = models.gpt2_small(dropout=0.1)
        return m, x, HF, models.gpt2_inputs(batch=3, seq=9)
    if name == "bert":
        m, x, _ = models.bert_small(dropout=0.1)
        return m, x, HF, models.bert_inputs(batch=3, seq=9)
    m, x, _ = models.small_cnn()
    return m, x, None, models.cnn_inputs(batch=3)


def other_shape_ok(model, inputs, call_kw, exporter):
    """Eval export at the example shape, run at another shape; max |diff| or the error."""
    from onnx.reference import ReferenceEvaluator
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from test_export import GatherElements

    model.eval()
    try:
        g = export_module(model, model_example[0], call_kw, training=False, exporter=exporter)
        got = ReferenceEvaluator(g.model(), new_ops=[GatherElements]).run(
            None, {n: t.numpy() for n, t in zip(g.input_names, inputs)})
        with torch.no_grad():
            want = model(*inputs, **(call_kw or {}))
        want = want if isinstance(want, torch.Tensor) else want[0]
        got = unflatten_outputs(g.output_structure, [torch.from_numpy(a) for a in got])
        got = got if isinstance(got, torch.Tensor) else got[0]
        return f"max diff {float((got - want).abs().max()):.1e}"
    except Exception as e:  # reported, this is a measurement
        return f"FAILS: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    finally:
        model.train()


model_example = [None]


def main(argv):
    full = "--full" in argv
    names = [a for a in argv if not a.startswith("--")] or ["tutorial", "gpt2", "bert", "cnn"]
    all_ops: dict = {}
    for name in names:
        for exporter in ("dynamo", "legacy"):
            model, example, call_kw, other = build(name, full)
            model_example[0] = example
            t = time.perf_counter()
            try:
                g = export_module(model, example, call_kw, exporter=exporter)
            except Exception as e:
                print(f"### {name} / {exporter}: FAILED ({time.perf_counter() - t:.2f} s)\n{e}\n")
                continue
            ops = g.op_counts()
            for op in ops:
                all_ops.setdefault(op, set()).add(f"{name}({exporter[0]})")
            check = other_shape_ok(model, other, call_kw, exporter) if not full else "-"
            print(f"### {name} / {exporter}: {g.seconds:.2f} s, opset {g.opset}, "
                  f"{sum(ops.values())} nodes, {len(ops)} op types")
            print(f"- eval graph at another shape: {check}")
            print(f"- dropout fixes: {len(g.dropout_fixes)}, batchnorm fixes: "
                  f"{len(g.batchnorm_fixes)}, aliases: {g.aliases or '-'}")
            print("- ops: " + ", ".join(f"{k} {v}" for k, v in ops.items()) + "\n")
    print("| op | models (d = dynamo, l = legacy) |\n|---|---|")
    for op, where in sorted(all_ops.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"| {op} | {', '.join(sorted(where))} |")


if __name__ == "__main__":
    main(sys.argv[1:])
