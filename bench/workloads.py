"""The benchmark workloads: for each name, the model, its optimizer, the batch of every step and
the user's own forward + criterion. Owns the sizes and the data; knows nothing of the systems
(eager, torch.compile, ortrain) nor of processes.

Every batch is a function of the step index only (fixed seeds), so every system trains on the
same batches in the same order from the same initial weights.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))  # the model zoo, tests/models.py

SEED = 0
N_BATCHES = 8  # distinct batches of gpt2/bert, cycled (the tutorial walks its text)

TUTORIAL_VOCAB = 28782  # WikiText-2's vocabulary
GPT2_VOCAB = 50257
BERT_VOCAB = 30522
BERT_MASK_ID = 103  # [MASK] in bert-base-uncased


@dataclass
class Job:
    """What one worker trains: `loss = forward_loss(model, batch(step))`, then backward,
    optional clip_grad_norm_(clip), optimizer.step()."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], tuple]
    forward_loss: Callable[[nn.Module, tuple], torch.Tensor]
    clip: float | None


@dataclass(frozen=True)
class Workload:
    name: str
    title: str  # one line under the table's heading
    precision: str  # "fp32" | "bf16" (bf16: autocast in PyTorch, precision="bf16" in ortrain)
    needs_transformers: bool
    build: Callable[..., Job]  # build(batch=None): None is the workload's own batch size
    default_batch: int


# ------------------------------------------------------------------------------------ tutorial
def _tutorial_text(vocab: int, bsz: int) -> torch.Tensor:
    """The tutorial's batchified token stream [rows, 20]: real prose (bench/text_data.py), its
    word ids spread over the full vocabulary by a fixed permutation."""
    from bench import text_data

    text, _ = text_data.load_text()
    ids, _ = text_data.tokenize(text)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(SEED))
    ids = perm[ids % vocab]
    need = bsz * (2 * 35 + 2)  # at least two bptt windows per batch column, for large --batch probes
    if ids.numel() < need:
        ids = ids.repeat(-(-need // ids.numel()))
    return text_data.batchify(ids, bsz)


def _build_tutorial(batch: int | None = None) -> Job:
    import models

    from bench import text_data

    model, _, _ = models.tutorial_transformer(TUTORIAL_VOCAB, dropout=0.2, seed=SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = _tutorial_text(TUTORIAL_VOCAB, batch or 20)
    bptt = 35
    starts = (data.size(0) - 1 - bptt) // bptt
    criterion = nn.CrossEntropyLoss()

    def batch(step):
        return text_data.get_batch(data, (step % starts) * bptt, bptt)

    def forward_loss(m, b):
        x, targets = b
        output = m(x)
        return criterion(output.view(-1, TUTORIAL_VOCAB), targets)

    return Job(model, optimizer, batch, forward_loss, clip=0.5)


# ---------------------------------------------------------------------------------------- gpt2
def _build_gpt2(batch: int | None = None, labels: bool = False) -> Job:
    """`labels`: the loss from `model(input_ids, labels=ids).loss` (how Hugging Face's Trainer
    and most HF loops train: the model computes it), else F.cross_entropy on the logits."""
    import models

    seq, bsz = 128, batch or 4
    model, _, _ = models.gpt2_small(vocab=GPT2_VOCAB, n_layer=2, n_embd=256, n_head=4, n_positions=seq,
                                    dropout=0.1, batch=bsz, seq=seq, seed=SEED, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(SEED + 1)
    batches = [torch.randint(0, GPT2_VOCAB, (bsz, seq), generator=g) for _ in range(N_BATCHES)]
    criterion = nn.CrossEntropyLoss()

    def forward_loss(m, b):
        (ids,) = b
        if labels:
            return m(input_ids=ids, labels=ids).loss
        logits = m(ids).logits
        return criterion(logits[:, :-1].reshape(-1, GPT2_VOCAB), ids[:, 1:].reshape(-1))

    return Job(model, optimizer, lambda step: (batches[step % N_BATCHES],), forward_loss, clip=None)


def _build_gpt2_labels(batch: int | None = None) -> Job:
    return _build_gpt2(batch, labels=True)


def _build_gpt2_checkpointed(batch: int | None = None) -> Job:
    """GPT-2 as a memory-bound Hugging Face user trains it: gradient checkpointing on every block
    (`gradient_checkpointing_enable()`), the loss from `labels=`; 4 blocks, seq 256."""
    import models

    seq, bsz = 256, batch or 8
    model, _, _ = models.gpt2_small(vocab=GPT2_VOCAB, n_layer=4, n_embd=256, n_head=4, n_positions=seq,
                                    dropout=0.1, batch=bsz, seq=seq, seed=SEED, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(SEED + 1)
    batches = [torch.randint(0, GPT2_VOCAB, (bsz, seq), generator=g) for _ in range(N_BATCHES)]

    def forward_loss(m, b):
        (ids,) = b
        return m(input_ids=ids, labels=ids).loss

    return Job(model, optimizer, lambda step: (batches[step % N_BATCHES],), forward_loss, clip=None)


# ----------------------------------------------------------------------------------- llama-lora
LLAMA_VOCAB = 32000


def _build_llama_lora(batch: int | None = None) -> Job:
    """LoRA fine-tuning (peft) as notebooks do it: a Llama-style model's weights frozen, rank-16
    adapters on the attention projections, the loss from `labels=`."""
    import peft
    import transformers

    seq, bsz = 256, batch or 4
    torch.manual_seed(SEED)
    cfg = transformers.LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=seq, attn_implementation="sdpa")
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           lora_dropout=0.05, task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(SEED + 1)
    batches = [torch.randint(0, LLAMA_VOCAB, (bsz, seq), generator=g) for _ in range(N_BATCHES)]

    def forward_loss(m, b):
        (ids,) = b
        return m(input_ids=ids, labels=ids).loss

    return Job(model, optimizer, lambda step: (batches[step % N_BATCHES],), forward_loss, clip=1.0)


# ---------------------------------------------------------------------------------------- bert
def _build_bert(batch: int | None = None) -> Job:
    import models

    seq, bsz = 128, batch or 4
    model, _, _ = models.bert_small(vocab=BERT_VOCAB, layers=2, hidden=256, heads=4, intermediate=1024,
                                    dropout=0.1, batch=bsz, seq=seq, seed=SEED, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(SEED + 1)
    batches = []
    for _ in range(N_BATCHES):
        ids = torch.randint(1000, BERT_VOCAB, (bsz, seq), generator=g)
        chosen = torch.rand(bsz, seq, generator=g) < 0.15
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        batches.append((torch.where(chosen, torch.full_like(ids, BERT_MASK_ID), ids),
                        torch.ones(bsz, seq, dtype=torch.long), labels))
    criterion = nn.CrossEntropyLoss()  # ignore_index -100: only masked positions count

    def forward_loss(m, b):
        ids, attention_mask, labels = b
        logits = m(ids, attention_mask=attention_mask).logits
        return criterion(logits.view(-1, BERT_VOCAB), labels.view(-1))

    return Job(model, optimizer, lambda step: batches[step % N_BATCHES], forward_loss, clip=None)


_TUTORIAL_TITLE = ("nn.Transformer tutorial model (emsize 200, nhid 200, 2 layers, 2 heads, dropout 0.2), "
                   f"vocab {TUTORIAL_VOCAB}, seq 35 x batch 20, Adam lr 1e-3, clip_grad_norm_ 0.5")
WORKLOADS = {
    w.name: w
    for w in (
        Workload("tutorial", _TUTORIAL_TITLE + ", fp32", "fp32", False, _build_tutorial, 20),
        Workload("tutorial-bf16", _TUTORIAL_TITLE + ", bf16 (fp32 master weights)", "bf16", False,
                 _build_tutorial, 20),
        Workload("gpt2", "GPT2LMHeadModel (2 layers, n_embd 256, 4 heads, dropout 0.1, sdpa attention), "
                 f"vocab {GPT2_VOCAB}, seq 128 x batch 4, AdamW lr 1e-3, fp32", "fp32", True, _build_gpt2, 4),
        Workload("gpt2-labels", "the gpt2 workload with the loss from labels= (as Hugging Face's Trainer computes it)",
                 "fp32", True, _build_gpt2_labels, 4),
        Workload("gpt2-checkpointed", "GPT2LMHeadModel (4 layers, n_embd 256, 4 heads, dropout 0.1, sdpa attention) "
                 "with gradient checkpointing on every block, loss from labels=, "
                 f"vocab {GPT2_VOCAB}, seq 256 x batch 8, AdamW lr 1e-3, fp32", "fp32", True,
                 _build_gpt2_checkpointed, 8),
        Workload("llama-lora", "LlamaForCausalLM (4 layers, hidden 512, 8 heads, 4 key/value heads, sdpa attention) "
                 f"frozen, LoRA r=16 on q/k/v/o (peft, dropout 0.05), vocab {LLAMA_VOCAB}, seq 256 x batch 4, "
                 "labels= loss, AdamW lr 1e-4 on the adapters, clip 1.0, fp32", "fp32", True, _build_llama_lora, 4),
        Workload("bert", "BertForMaskedLM (2 layers, hidden 256, 4 heads, dropout 0.1, sdpa attention), "
                 f"vocab {BERT_VOCAB}, seq 128 x batch 4, 15% masked, AdamW lr 1e-3, fp32", "fp32", True,
                 _build_bert, 4),
    )
}


def preload(workload: Workload) -> None:
    """Imports what building the workload imports, so the worker's RSS after imports covers them
    (constructing any torch.optim optimizer imports torch._dynamo: ~150 MiB in every system)."""
    import torch._dynamo  # noqa: F401
    if workload.needs_transformers:
        import transformers  # noqa: F401
        from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401
    if workload.name == "llama-lora":
        import peft  # noqa: F401
