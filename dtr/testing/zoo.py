"""Small models of the shapes DTR must handle, for tests, benchmarks and the demo.

Every entry builds ``(model, batch, loss_fn)`` from a size preset and a seed, so that the same
training step can be run eagerly and under ``dtr.budget`` and compared bit for bit:

- ``mlp``: Linear + ReLU(inplace) + Dropout stack;
- ``cnn``: Conv + BatchNorm + ReLU(inplace) + Dropout + MaxPool;
- ``resnet``: residual conv blocks (skip connections make residual DAGs);
- ``transformer``: a GPT-2-style decoder (scaled_dot_product_attention, LayerNorm, GELU,
  dropout; causal mask);
- ``lstm``: ``nn.LSTM`` (four layers, dropout): fused multi-output RNN ops;
- ``lstmcell``: an ``nn.LSTMCell`` loop over sequences of different lengths;
- ``treelstm``: a child-sum TreeLSTM over random trees (data-dependent recursion).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "build", "on_device", "MODELS"]


@dataclass
class Workload:
    """One training step's ingredients: ``loss_fn(model, batch)`` returns a scalar loss."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


# ---------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, p: float = 0.1) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU(inplace=True), nn.Dropout(p)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x))


class CNN(nn.Module):
    def __init__(self, channels: int, depth: int) -> None:
        super().__init__()
        layers: List[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1)]
        for i in range(depth):
            layers += [
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
                nn.ReLU(inplace=True),
                nn.Dropout(0.1),
            ]
            if i % 2 == 1:
                layers.append(nn.MaxPool2d(2))
        self.body = nn.Sequential(*layers)
        self.head = nn.LazyLinear(10)

    def forward(self, x):
        return self.head(torch.flatten(self.body(x), 1))


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(y)) + x)


class ResNet(nn.Module):
    def __init__(self, channels: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        y = self.blocks(self.stem(x))
        return self.head(y.mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.p = p
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, d)))


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int, p: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList([DecoderBlock(d, heads, p) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2's init; N(0, 1) would blow up the logits

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class StackedLSTM(nn.Module):
    """``nn.LSTM`` with dropout between layers: one fused multi-output op per layer."""

    def __init__(self, d_in: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, num_layers=layers, dropout=0.1, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out.mean(1))


class CellLoop(nn.Module):
    """An LSTMCell unrolled by hand over a batch of sequences of different lengths: at step t
    only the sequences still running take part, so shapes change from step to step."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(d_in, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, batch):
        x, lengths = batch  # x: (batch, max_len, d_in), sorted by decreasing length
        n = x.shape[0]
        h = x.new_zeros(n, self.cell.hidden_size)
        c = x.new_zeros(n, self.cell.hidden_size)
        finished = []
        for t in range(int(lengths[0])):
            active = int((lengths > t).sum())
            if active < h.shape[0]:
                finished.append(h[active:])
                h, c = h[:active], c[:active]
            h, c = self.cell(x[:active, t], (h, c))
        finished.append(h)
        return self.head(torch.cat(finished[::-1]))


class TreeLSTM(nn.Module):
    """Child-sum TreeLSTM (Tai et al. 2015); trees are nested tuples ``(leaf_id, children)``."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.iou = nn.Linear(2 * d, 3 * d)
        self.fx = nn.Linear(d, d)
        self.fh = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)
        self.d = d

    def node(self, tree):
        word, children = tree
        x = self.emb(torch.tensor([word], device=self.emb.weight.device))
        if children:
            states = [self.node(c) for c in children]
            hs = torch.cat([h for h, _ in states])
            cs = torch.cat([c for _, c in states])
            h_sum = hs.sum(0, keepdim=True)
        else:
            hs = cs = None
            h_sum = x.new_zeros(1, self.d)
        i, o, u = self.iou(torch.cat([x, h_sum], 1)).chunk(3, 1)
        i, o, u = torch.sigmoid(i), torch.sigmoid(o), torch.tanh(u)
        c = i * u
        if children:
            f = torch.sigmoid(self.fx(x) + self.fh(hs))
            c = c + (f * cs).sum(0, keepdim=True)
        return o * torch.tanh(c), c

    def forward(self, trees):
        return self.head(torch.cat([self.node(t)[0] for t in trees]))


def random_tree(rng: random.Random, nodes: int, vocab: int):
    """A random tree with ``nodes`` nodes (each node picks a random earlier parent)."""
    children: Dict[int, list] = {i: [] for i in range(nodes)}
    for i in range(1, nodes):
        children[rng.randrange(i)].append(i)

    def build(i):
        return (rng.randrange(vocab), [build(c) for c in children[i]])

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * nodes + 100))
    try:
        return build(0)
    finally:
        sys.setrecursionlimit(limit)


# ---------------------------------------------------------------------------- presets

# name -> size -> kwargs. "tiny" keeps unit tests fast; "bench" is the CPU sizes.
PRESETS: Dict[str, Dict[str, dict]] = {
    "mlp": {"tiny": dict(width=64, depth=6, batch=128), "bench": dict(width=1024, depth=8, batch=256)},
    "cnn": {"tiny": dict(channels=8, depth=4, batch=8, image=16), "bench": dict(channels=32, depth=6, batch=32, image=32)},
    "resnet": {"tiny": dict(channels=8, blocks=3, batch=4, image=16), "bench": dict(channels=32, blocks=6, batch=32, image=32)},
    "transformer": {
        "tiny": dict(vocab=64, d=32, heads=4, layers=2, seq=16, batch=4),
        "bench": dict(vocab=512, d=256, heads=4, layers=4, seq=256, batch=8),
    },
    "lstm": {
        "tiny": dict(d_in=8, hidden=16, layers=4, batch=16, seq=24),
        "bench": dict(d_in=64, hidden=256, layers=4, batch=32, seq=64),
    },
    "lstmcell": {"tiny": dict(d_in=8, hidden=16, batch=16, max_len=24), "bench": dict(d_in=64, hidden=256, batch=32, max_len=64)},
    "treelstm": {"tiny": dict(vocab=4, d=4, trees=2, nodes=30), "bench": dict(vocab=1000, d=256, trees=1, nodes=200)},
}

MODELS = tuple(PRESETS)


def build(name: str, size: str = "tiny", seed: int = 0, **overrides) -> Workload:
    """The workload ``name`` at preset ``size``, built deterministically from ``seed``."""
    cfg = dict(PRESETS[name][size], **overrides)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    if name == "mlp":
        model = MLP(cfg["width"], cfg["depth"])
        batch = (torch.randn(cfg["batch"], cfg["width"]), torch.randint(0, 10, (cfg["batch"],)))
        return Workload(name, model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    if name in ("cnn", "resnet"):
        model = CNN(cfg["channels"], cfg["depth"]) if name == "cnn" else ResNet(cfg["channels"], cfg["blocks"])
        x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"])
        y = torch.randint(0, 10, (cfg["batch"],))
        if name == "cnn":
            with torch.no_grad():
                model(x[:1])  # materialize the lazy head outside any budget
        return Workload(name, model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    if name == "transformer":
        model = GPT(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"])
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1))

        def lm_loss(m, b):
            logits = m(b[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

        return Workload(name, model, idx, lm_loss)
    if name == "lstm":
        model = StackedLSTM(cfg["d_in"], cfg["hidden"], cfg["layers"])
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_in"])
        y = torch.randn(cfg["batch"], 1)
        return Workload(name, model, (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    if name == "lstmcell":
        model = CellLoop(cfg["d_in"], cfg["hidden"])
        lengths = torch.tensor(sorted((rng.randint(1, cfg["max_len"]) for _ in range(cfg["batch"])), reverse=True))
        x = torch.randn(cfg["batch"], int(lengths[0]), cfg["d_in"])
        y = torch.randn(cfg["batch"], 1)
        return Workload(name, model, (x, lengths, y), lambda m, b: F.mse_loss(m((b[0], b[1])), b[2]))
    if name == "treelstm":
        model = TreeLSTM(cfg["vocab"], cfg["d"])
        trees = [random_tree(rng, cfg["nodes"], cfg["vocab"]) for _ in range(cfg["trees"])]
        y = torch.randn(cfg["trees"], 1)
        return Workload(name, model, (trees, y), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    raise ValueError(f"unknown workload {name!r}; choose from {MODELS}")


def on_device(w: Workload, device: Union[str, torch.device]) -> Workload:
    """``w`` with its model moved to ``device`` (in place) and a copy of its batch there."""
    w.model.to(device)

    def move(b):
        if isinstance(b, torch.Tensor):
            return b.to(device)
        if type(b) in (list, tuple):
            return type(b)(move(x) for x in b)
        return b  # a tree's token ids and structure

    return Workload(w.name, w.model, move(w.batch), w.loss_fn)
