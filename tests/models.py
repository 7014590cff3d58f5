"""Model zoo for export and parity tests: builders returning (model, example_inputs, loss_fn).

Each builder is deterministic for a given `seed` (weights and example inputs), builds the model
from a config with random weights (no downloads), and returns:
  model          an nn.Module in train() mode
  example_inputs a tuple of positional arguments for model(*example_inputs)
  loss_fn        loss_fn(output, *example_inputs) -> scalar tensor (the loss the user computes
                 outside the model, as in a notebook training loop)
`make_inputs(batch, seq)` variants let tests feed other shapes (dynamic axes).
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


# --------------------------------------------------------------------- tutorial (nn.Transformer)
class PositionalEncoding(nn.Module):
    """Sinusoidal positional encoding of the PyTorch nn.Transformer tutorial, with its own Dropout."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))  # [max_len, 1, d_model]

    def forward(self, x):
        return self.dropout(x + self.pe[: x.size(0), :])


class TransformerModel(nn.Module):
    """The tutorial's word-level LM: Embedding*sqrt(d) + PE -> TransformerEncoder(mask) -> Linear.

    Input [seq, batch] token ids, output [seq, batch, ntoken]. The causal mask is built in
    forward from `src.size(0)` (not `len(src)`, which a tracer would freeze to a constant).
    """

    def __init__(self, ntoken, ninp=200, nhead=2, nhid=200, nlayers=2, dropout=0.2, activation="relu"):
        super().__init__()
        self.ninp = ninp
        self.encoder = nn.Embedding(ntoken, ninp)
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout, activation=activation)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.decoder = nn.Linear(ninp, ntoken)
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, src_mask=None):
        if src_mask is None:
            src_mask = nn.Transformer.generate_square_subsequent_mask(src.size(0), device=src.device)
        x = self.encoder(src) * math.sqrt(self.ninp)
        x = self.pos_encoder(x)
        x = self.transformer_encoder(x, src_mask)
        return self.decoder(x)


def tutorial_transformer(ntokens=1000, dropout=0.0, *, emsize=200, nhid=200, nlayers=2, nhead=2,
                         seq=35, batch=20, seed=0, activation="relu"):
    """The PyTorch nn.Transformer tutorial model (full size: ntokens=28782, dropout=0.2).
    `activation="gelu"` gives tests that compare single steps with PyTorch a model without ReLU
    inputs that rounding can put on either side of zero."""
    torch.manual_seed(seed)
    model = TransformerModel(ntokens, emsize, nhead, nhid, nlayers, dropout, activation).train()
    g = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, ntokens, (seq, batch), generator=g)
    targets = torch.randint(0, ntokens, (seq * batch,), generator=g)
    criterion = nn.CrossEntropyLoss()

    def loss_fn(output, src, _targets=targets):
        t = _targets if _targets.numel() == src.numel() else torch.randint(
            0, ntokens, (src.numel(),), generator=torch.Generator().manual_seed(seed + 2))
        return criterion(output.view(-1, ntokens), t)

    return model, (data,), loss_fn


def tutorial_inputs(ntokens=1000, seq=35, batch=20, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randint(0, ntokens, (seq, batch), generator=g),)


# --------------------------------------------------------------------------------- HF models
def _lm_loss(logits, input_ids):
    """Causal-LM loss of shifted logits, computed outside the model."""
    vocab = logits.size(-1)
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


def _causal_lm_loss(output, input_ids):
    """The LM loss of a Hugging Face causal LM's output (a tuple, a ModelOutput or the logits)."""
    logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    return _lm_loss(logits, input_ids)


def gpt2_small(vocab=1000, n_layer=2, n_embd=256, n_head=4, n_positions=128, dropout=0.0,
               batch=4, seq=32, seed=0, attn_implementation="eager", max_positions=128):
    """GPT2LMHeadModel from a small config (tied wte/lm_head). Output: logits [batch, seq, vocab]."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                     n_positions=n_positions, n_inner=4 * n_embd, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                     attn_implementation=attn_implementation)
    model = GPT2LMHeadModel(cfg).train()
    (ids,) = gpt2_inputs(vocab, batch, seq, seed)
    return model, (ids,), _causal_lm_loss


def llama_small(vocab=200, n_layer=2, hidden=64, batch=2, seq=16, seed=0):
    """LlamaForCausalLM from a small config (RMSNorm, rotary embeddings, grouped-query attention,
    SwiGLU) with every weight trainable. Output: logits [batch, seq, vocab]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layer,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, use_cache=False,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).train()
    (ids,) = gpt2_inputs(vocab, batch, seq, seed)
    return model, (ids,), _causal_lm_loss


def train_gpt2_with_labels(checkpointing: bool, accelerated: bool, steps: int = 3):
    """A small GPT2LMHeadModel trained as Hugging Face users train it, `model(input_ids,
    labels=ids).loss` (its loss pads the labels: an ONNX Pad; use_cache left on: a key/value
    cache in the output), with `gradient_checkpointing_enable()` if `checkpointing`, under
    `ortrain.accelerate(strict=True)` if `accelerated`. Returns (model, losses, last output)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import ortrain

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=200, n_layer=2, n_embd=64, n_head=4, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=199, eos_token_id=199)
    model = GPT2LMHeadModel(cfg).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if accelerated:
        ortrain.accelerate(model, opt, strict=True)
    g = torch.Generator().manual_seed(1)
    losses, out = [], None
    for _ in range(steps):
        ids = torch.randint(0, 200, (4, 32), generator=g)
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return model, losses, out


def gpt2_inputs(vocab=1000, batch=4, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randint(0, vocab, (batch, seq), generator=g),)


def bert_small(vocab=1000, layers=2, hidden=256, heads=4, intermediate=1024, dropout=0.0,
               batch=4, seq=32, seed=0, attn_implementation="eager", max_positions=128):
    """BertForMaskedLM from a small config; inputs (input_ids, attention_mask); MLM loss outside."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=intermediate,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     max_position_embeddings=max_positions, attn_implementation=attn_implementation)
    model = BertForMaskedLM(cfg).train()
    inputs = bert_inputs(vocab, batch, seq, seed)

    def loss_fn(output, input_ids, attention_mask=None):
        logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
        # mask 15% of positions deterministically; labels are the original ids there, -100 elsewhere
        g = torch.Generator().manual_seed(seed + 3)
        chosen = torch.rand(input_ids.shape, generator=g) < 0.15
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=-100)

    return model, inputs, loss_fn


def bert_inputs(vocab=1000, batch=4, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0  # one padded row, so the mask is not all ones
    return (ids, mask)


# ------------------------------------------------------------------------------------- CNN
class SmallCNN(nn.Module):
    """Conv+BatchNorm+ReLU+MaxPool twice, then a Linear classifier, on 3x32x32 images."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 8 * 8, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def small_cnn(num_classes=10, batch=8, seed=0):
    torch.manual_seed(seed)
    model = SmallCNN(num_classes).train()
    (x,) = cnn_inputs(batch, seed)
    g = torch.Generator().manual_seed(seed + 2)
    labels = torch.randint(0, num_classes, (batch,), generator=g)

    def loss_fn(output, images, _labels=labels):
        lab = _labels if _labels.numel() == images.size(0) else _labels.new_zeros(images.size(0))
        return F.cross_entropy(output, lab)

    return model, (x,), loss_fn


def cnn_inputs(batch=8, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(batch, 3, 32, 32, generator=g),)


ZOO = {
    "tutorial": (tutorial_transformer, tutorial_inputs),
    "gpt2": (gpt2_small, gpt2_inputs),
    "bert": (bert_small, bert_inputs),
    "cnn": (small_cnn, cnn_inputs),
}
