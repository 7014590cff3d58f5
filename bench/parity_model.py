"""Writes a GPT-2 language model with its fused cross-entropy loss (the graph `accelerate()` builds
for `criterion(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))`), or with `--model bert` a
BERT masked-language model with its loss over every position (`criterion(logits.reshape(-1, V),
labels)`), or with `--model llama` a Llama language model (rotary embeddings, grouped-query attention
with half as many key/value heads, RMSNorm) with GPT-2's loss, its weights and one batch to a folder, for the engine's cross-backend step check
(engine/src/backend/cuda/tests/onnx_parity.rs): one training step of that graph on the CPU in
exact f32, on the CPU at bf16 matmul precision and on CUDA at bf16 and fp16 (cuda-emu without a GPU), every
weight gradient compared. It puts a whole exported model through the CUDA-only passes and
kernels (tensor-core attention, the causal mask, the chunked LM head over an odd vocabulary, the
16-bit activations), which the engine's own CUDA tests only see one at a time.

    python -m bench.parity_model OUT_DIR [--model gpt2|bert|llama] [--layers 2] [--width 128] [--heads 2]
                                         [--seq 256] [--batch 2] [--vocab 50257] [--padding]

OUT_DIR gets model.onnx, weights.bin (every bound initializer's f32 data, in meta.txt's order),
inputs.bin (the int64 inputs in the graph's order: the ids, with --padding the attention_mask,
then the targets) and meta.txt (one line per weight: `weight NAME TRAINABLE NUMEL`, one per
input: `input NAME DIMS...`, and `model gpt2`, `model bert` or `model llama`).

--padding: the model is called with Hugging Face's attention_mask (as a tokenizer's batch gives
it), the first row padded on the left (its first 70 positions: those queries see no key and
get equal weights over all keys, as in PyTorch), the others on the right (their last 50); the
loss counts every position, padding too, so those rows' gradients count. BERT's attention is not
causal: there row 0's queries all see its real keys, and a third row (with --batch 3 or more) is
padding only, so its queries see no key (equal weights over all keys, as PyTorch's softmax of
all-finfo.min scores gives them).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def padding_mask(batch: int, seq: int, all_padding_row: bool = False):
    """--padding's attention_mask: row 0 left-padded by 70 (at most seq - 1), the others
    right-padded by 50; with `all_padding_row`, row 2 (if there is one) is padding only."""
    import torch

    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, :min(70, seq - 1)] = 0
    mask[1:, max(seq - 50, 1):] = 0
    if all_padding_row and batch > 2:
        mask[2] = 0
    return mask


def llama(vocab: int, layers: int, width: int, heads: int, seq: int):
    """A LlamaForCausalLM (rotary embeddings, RMSNorm, SwiGLU) with grouped-query attention (half
    as many key/value heads), every weight trainable, in training mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=seq,
                      use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train()


def write(out: str, layers: int, width: int, heads: int, seq: int, batch: int, vocab: int, padding: bool = False,
          kind: str = "gpt2") -> None:
    import numpy as np
    import torch

    import models
    from ortrain.engine.cross_entropy import TARGET, _with_cross_entropy
    from ortrain.export import export_module

    if kind == "llama":
        model = llama(vocab, layers, width, heads, seq)
    elif kind == "bert":
        model, _, _ = models.bert_small(vocab=vocab, layers=layers, hidden=width, heads=heads, intermediate=4 * width,
                                        dropout=0.0, batch=batch, seq=seq, seed=0, attn_implementation="sdpa",
                                        max_positions=seq)
    else:
        model, _, _ = models.gpt2_small(vocab=vocab, n_layer=layers, n_embd=width, n_head=heads, n_positions=seq,
                                        dropout=0.0, batch=batch, seq=seq, seed=0, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    # GPT-2 and Llama predict the next token; BERT's labels here are its own ids at every position
    targets = ids.reshape(-1) if kind == "bert" else ids[:, 1:].reshape(-1)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, attention_mask=None):
            if kind == "bert":  # made here, not read from BERT's int64 buffers (the probe's weights are f32)
                positions = torch.arange(x.shape[1]).unsqueeze(0)
                return self.m(x, attention_mask=attention_mask, token_type_ids=torch.zeros_like(x),
                              position_ids=positions).logits
            return self.m(x, attention_mask=attention_mask).logits

    wrapped = Logits(model)
    mask = padding_mask(batch, seq, all_padding_row=kind == "bert") if padding else None
    exported = export_module(wrapped, (ids,) if mask is None else (ids, mask), dynamic=False)
    # GPT-2's shift on axis -2, as accelerate() slices (axes counted from the end: the LM head and
    # its loss then fuse, which an axis counted from the front would prevent)
    slices = [] if kind == "bert" else [(-2, None, -1)]
    onnx_bytes = _with_cross_entropy(exported.onnx_bytes, slices, vocab, -100, "mean")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.onnx"), "wb") as f:
        f.write(onnx_bytes)
    named = dict(wrapped.named_parameters(remove_duplicate=False))
    named.update(dict(wrapped.named_buffers(remove_duplicate=False)))
    lines = []
    with open(os.path.join(out, "weights.bin"), "wb") as f:
        for onnx_name, key in exported.param_map.items():
            t = named[key].detach().float().contiguous()
            trainable = exported.param_kinds.get(onnx_name) == "param"
            lines.append(f"weight {onnx_name} {int(trainable)} {t.numel()}")
            f.write(t.numpy().astype(np.float32).tobytes())
    with open(os.path.join(out, "inputs.bin"), "wb") as f:
        data = [ids] if mask is None else [ids, mask]
        for name, t in list(zip(exported.input_names, data)) + [(TARGET, targets)]:
            lines.append(f"input {name} " + " ".join(str(d) for d in t.shape))
            f.write(t.numpy().astype(np.int64).tobytes())
    lines.append(f"model {kind}")
    with open(os.path.join(out, "meta.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    name = {"bert": "BERT", "gpt2": "GPT-2", "llama": "Llama"}[kind]
    print(f"{out}: {name} {layers} layers, width {width}, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}; "
          f"{'attention_mask with left and right padding, ' if padding else ''}"
          f"exporter {exported.exporter}, {len(exported.param_map)} weights")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--model", choices=("gpt2", "bert", "llama"), default="gpt2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--padding", action="store_true", help="call the model with a padded attention_mask")
    a = ap.parse_args()
    write(a.out, a.layers, a.width, a.heads, a.seq, a.batch, a.vocab, a.padding, a.model)


if __name__ == "__main__":
    main()
