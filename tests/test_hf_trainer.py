"""Hugging Face's Trainer around an accelerated model (brief: "works inside other loops"): the
Trainer inspects `model.forward` to choose the dataset columns it passes, calls the model with
`labels=` and `num_items_in_batch`, clips through `clip_grad_norm_` and steps its own AdamW
(made inside `train()`: the engine takes it at its first step).
Losses and gradient norms as the same Trainer's on the plain model; `%%ort compare` around
`trainer.train()` logs both runs."""
from __future__ import annotations

import inspect
import math
import os
import re
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import runs_of  # noqa: E402
from test_magics import shell_client  # noqa: E402

import ortrain  # noqa: E402

pytest.importorskip("accelerate", reason="Hugging Face's Trainer needs the accelerate package (requirements.txt)")

SETUP = """
import tempfile
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

V = 200

def make_model():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_layer=2, n_embd=64, n_head=4, n_positions=64, bos_token_id=V - 1,
                     eos_token_id=V - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)

class Texts(torch.utils.data.Dataset):
    # a column the model does not take: the Trainer drops it after reading model.forward's signature
    def __init__(self, n=48):
        self.ids = torch.randint(0, V, (n, 32), generator=torch.Generator().manual_seed(1))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source": "corpus"}

def trainer_for(model, accumulation=1):
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_train_epochs=1,
                             logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3, use_cpu=True,
                             seed=0, max_grad_norm=1.0, disable_tqdm=True, gradient_accumulation_steps=accumulation)
    return Trainer(model=model, args=args, train_dataset=Texts())
"""


def _namespace() -> dict:
    ns: dict = {}
    exec(SETUP, ns)  # noqa: S102 - the test's own code, shared with the notebook cell below
    return ns


def _train(ns, accelerated: bool):
    model = ns["make_model"]()
    if accelerated:
        ortrain.accelerate(model, strict=True)
    trainer = ns["trainer_for"](model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return model, [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def test_trainer_trains_an_accelerated_model_as_it_trains_the_plain_one():
    ns = _namespace()
    plain, losses, norms = _train(ns, accelerated=False)
    model, our_losses, our_norms = _train(ns, accelerated=True)
    assert len(losses) == 6
    assert our_losses == pytest.approx(losses, rel=1e-5)
    assert our_norms == pytest.approx(norms, rel=1e-4)
    # the Trainer reads the model's own parameters off the accelerated forward
    assert list(inspect.signature(model.forward).parameters) == list(inspect.signature(plain.forward).parameters)
    state = model._ortrain_state
    assert state.model_loss_calls == 6  # every step's loss fused with the LM head in the engine
    text = ortrain.explain(model)
    assert "] runs in PyTorch" not in text, text
    # (the clip line's counts are the process's: other tests' models clip too)
    assert re.search(r"clip_grad_norm_ of its gradients: \d+ call\(s\) in the engine", text), text
    # the Trainer's own AdamW, made inside train(): stepped by the engine from its second step on
    assert "optimizer in the engine (AdamW made after accelerate()" in text.splitlines()[0], text
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)


def test_evaluation_during_training_gives_the_plain_models_metrics():
    """eval_strategy="steps" with compute_metrics: the Trainer's evaluation (no_grad, eval mode:
    the engine's inference graph with the loss and the logits) between training steps."""
    ns = _namespace()

    def accuracy(p):
        return {"acc": float((p.predictions.argmax(-1)[:, :-1] == p.label_ids[:, 1:]).mean())}

    evals = []
    for accelerated in (False, True):
        model = ns["make_model"]()
        if accelerated:
            ortrain.accelerate(model, strict=True)
        trainer = ns["trainer_for"](model)
        trainer.args.eval_strategy, trainer.args.eval_steps = "steps", 3
        trainer.eval_dataset, trainer.compute_metrics = ns["Texts"](16), accuracy
        trainer.train()
        evals.append([(h["eval_loss"], h["eval_acc"]) for h in trainer.state.log_history if "eval_loss" in h])
    assert len(evals[0]) == 2
    for (loss, acc), (our_loss, our_acc) in zip(*evals):
        assert our_loss == pytest.approx(loss, rel=1e-5) and our_acc == acc


def test_ort_compare_around_trainer_train_logs_both_runs(shell, engine_api, capsys):
    """Two micro-batches a step (gradient_accumulation_steps=2): each step logged once, its loss
    the one the Trainer itself reports (the sum of the micro-batch losses it divided by the
    step's token count), its batch read from the keyword inputs (`model(**batch)`)."""
    assert shell.run_cell(SETUP + "\nmodel = make_model()\n").success
    res = shell.run_cell("%%ort compare --experiment hf-trainer --no-progress\n"
                         "trainer = trainer_for(model, accumulation=2)\ntrainer.train()\n")
    assert res.success, res.error_in_exec
    c = shell_client()
    runs = {r["tags"].get("ortrain.role"): r for r in runs_of(c, "hf-trainer")}
    assert runs["accelerated"]["tags"]["ortrain.mode"] == "accelerated"
    curves, ppl = {}, {}
    for role in ("baseline", "accelerated"):
        for key in ("loss", "batch_time_ms", "learning_rate", "samples_per_sec", "tokens_per_sec"):
            assert [s for s, _, _ in c.get_metric_history(runs[role]["run_id"], key)] == list(range(3)), (role, key)
        curves[role] = [v for _, v, _ in c.get_metric_history(runs[role]["run_id"], "loss")]
        ppl[role] = c.get_metric_history(runs[role]["run_id"], "ppl")
    assert curves["accelerated"] == pytest.approx(curves["baseline"], rel=1e-4)
    reported = [h["loss"] for h in shell.user_ns["trainer"].state.log_history if "loss" in h]
    assert curves["accelerated"] == pytest.approx(reported, rel=1e-5)
    # the Trainer's loss is the model's cross-entropy sum / num_items_in_batch times the process
    # count: the step's mean cross-entropy, whose perplexity both runs log
    for role in ("baseline", "accelerated"):
        assert [v for _, v, _ in ppl[role]] == pytest.approx([math.exp(v) for v in curves[role]], rel=1e-6), role
    assert "runs in PyTorch" not in capsys.readouterr().out
