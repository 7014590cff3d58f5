# Databricks notebook source
# MAGIC %md
# MAGIC # Transformer language model: PyTorch vs ortrain, side by side in MLflow
# MAGIC
# MAGIC The PyTorch `nn.Transformer` language-model tutorial (emsize 200, nhid 200, 2 layers, 2 heads,
# MAGIC dropout 0.2, bptt 35, batch 20, Adam lr 1e-3), unchanged except for one magic: `%%ort compare`
# MAGIC trains the cell twice from the same starting state, first in PyTorch and then in the ortrain
# MAGIC engine, and logs both runs (ms/batch, loss, perplexity per batch) to MLflow.
# MAGIC
# MAGIC Data: WikiText-2 when it can be downloaded; otherwise real English prose that ships with Python
# MAGIC itself (`pydoc_data.topics`), read through the same code path.

# COMMAND ----------

# MAGIC %load_ext ortrain

# COMMAND ----------

import math, os, re, collections
import torch
from torch import nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
MAX_STEPS = int(os.environ.get("ORTRAIN_TUTORIAL_STEPS", "200"))   # steps per run

# COMMAND ----------

# MAGIC %md
# MAGIC ## Data: WikiText-2, or Python's own documentation text offline

# COMMAND ----------

def load_text():
    try:
        import urllib.request
        url = "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/train.txt"
        if os.environ.get("ORTRAIN_OFFLINE"):
            raise OSError("offline")
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode("utf-8"), "WikiText-2"
    except OSError:
        from pydoc_data.topics import topics
        return "\n".join(topics.values()), "pydoc_data.topics (offline)"

text, source = load_text()
words = re.findall(r"[A-Za-z]+|[0-9]+|[^\sA-Za-z0-9]", text.lower())
counts = collections.Counter(words)
itos = ["<unk>"] + [w for w, _ in counts.most_common(10000)]
stoi = {w: i for i, w in enumerate(itos)}
ids = torch.tensor([stoi.get(w, 0) for w in words], dtype=torch.long)
print(f"{source}: {len(words):,} words, vocabulary {len(itos):,}")

def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous().to(device)

batch_size, bptt = 20, 35
split = int(len(ids) * 0.9)
train_data = batchify(ids[:split], batch_size)
val_data = batchify(ids[split:], 10)

def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)

# COMMAND ----------

# MAGIC %md
# MAGIC ## The model (as in the PyTorch tutorial)

# COMMAND ----------

class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return self.dropout(x + self.pe[: x.size(0)])


class TransformerModel(nn.Module):
    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def init_weights(self):
        initrange = 0.1
        self.encoder.weight.data.uniform_(-initrange, initrange)
        self.decoder.bias.data.zero_()
        self.decoder.weight.data.uniform_(-initrange, initrange)

    def forward(self, src, src_mask):
        src = self.encoder(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, src_mask)
        return self.decoder(output)


ntokens = len(itos)
emsize, nhid, nlayers, nhead, dropout = 200, 200, 2, 2, 0.2
model = TransformerModel(ntokens, emsize, nhead, nhid, nlayers, dropout).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
src_mask = nn.Transformer.generate_square_subsequent_mask(bptt).to(device)
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train: PyTorch first, then ortrain, from the same start

# COMMAND ----------

# MAGIC %%ort compare --experiment tutorial --max-steps $MAX_STEPS
# MAGIC model.train()
# MAGIC for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
# MAGIC     data, targets = get_batch(train_data, i)
# MAGIC     mask = src_mask if data.size(0) == bptt else src_mask[: data.size(0), : data.size(0)]
# MAGIC     output = model(data, mask)
# MAGIC     loss = criterion(output.view(-1, ntokens), targets)
# MAGIC     optimizer.zero_grad()
# MAGIC     loss.backward()
# MAGIC     torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
# MAGIC     optimizer.step()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Evaluate the trained model

# COMMAND ----------

model.eval()
total, n = 0.0, 0
with torch.no_grad():
    for i in range(0, min(val_data.size(0) - 1, 10 * bptt), bptt):
        data, targets = get_batch(val_data, i)
        mask = src_mask[: data.size(0), : data.size(0)]
        total += len(data) * criterion(model(data, mask).view(-1, ntokens), targets).item()
        n += len(data)
print(f"validation loss {total / n:.3f}, ppl {math.exp(total / n):.1f}")
