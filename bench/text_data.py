"""Word-level language-model data, as the PyTorch tutorial prepares WikiText-2: WikiText-2 when
it is on disk (path in ORTRAIN_WIKITEXT2, a folder with wiki.train.tokens), otherwise the English
prose CPython ships in pydoc_data.topics, through the same tokenise/batchify path."""
from __future__ import annotations

import os
import re

import torch


def load_text() -> tuple[str, str]:
    """(text, source name)."""
    folder = os.environ.get("ORTRAIN_WIKITEXT2")
    if folder and os.path.exists(os.path.join(folder, "wiki.train.tokens")):
        with open(os.path.join(folder, "wiki.train.tokens"), encoding="utf-8") as f:
            return f.read(), "WikiText-2"
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (CPython's documentation prose)"


def tokenize(text: str) -> tuple[torch.Tensor, dict]:
    words = [w for line in text.splitlines() for w in re.findall(r"\w+|[^\w\s]", line.lower()) + ["<eos>"]]
    vocab: dict = {}
    ids = [vocab.setdefault(w, len(vocab)) for w in words]
    return torch.tensor(ids, dtype=torch.long), vocab


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    """[N] -> [N // bsz, bsz], as the tutorial does."""
    n = data.size(0) // bsz
    return data[: n * bsz].view(bsz, n).t().contiguous()


def get_batch(source: torch.Tensor, i: int, bptt: int = 35):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)
