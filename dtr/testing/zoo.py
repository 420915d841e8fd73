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

``DYNAMIC`` names the dynamic models at realistic sizes (issue 18), kept apart from ``MODELS``
(which many tests parametrize over) and built the same way (``build(name, size)``):

- ``treelstm_batch``: child-sum TreeLSTM over a batch of random trees with embedded tokens and a
  classifier on the roots, node by node, recursion in Python (:class:`ChildSumTreeLSTM`);
- ``treelstm_nary``: binary (N = 2) TreeLSTM over random binary trees (:class:`BinaryTreeLSTM`);
- ``gru_cell``, ``lstm_cell_masked``: ``nn.GRUCell`` / ``nn.LSTMCell`` loops over padded
  variable-length sequences, finished sequences keeping their state through a mask, and an early
  exit once every sequence has ended (:class:`MaskedCellLoop`);
- ``gru``: ``nn.GRU`` (two layers, ``batch_first``) over a padded batch (:class:`GRUClassifier`);
- ``lstm_packed``: ``nn.LSTM`` (three layers) over a ``PackedSequence`` made with
  ``pack_padded_sequence(..., enforce_sorted=False)`` (:class:`PackedLSTMClassifier`).

Each has a "tiny" preset (for tests: a step in milliseconds eagerly, well under a second under
a budget) and a "bench" preset at the sizes such models are trained at (for benchmarks: a step
of about a second or a few on a 2-core CPU). Each model class's docstring says what its presets
are and why those sizes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "build", "on_device", "MODELS", "DYNAMIC", "PRESETS"]


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


# ---------------------------------------------------------------------------- dynamic models (issue 18)


class ChildSumTreeLSTM(nn.Module):
    """Child-sum TreeLSTM (Tai et al. 2015, section 3.1) classifying a batch of trees.

    A tree is ``(tokens, children)``: ``tokens`` a 1-D int64 tensor with one token per node,
    ``children[j]`` the tuple of node ``j``'s children (node 0 is the root). As in Tai et al.'s
    code and its PyTorch ports, each tree's tokens are embedded with one op, then the nodes are
    processed **one at a time, by recursion in Python** (children before parents), each node a
    handful of small ops on a ``(1, hidden)`` state: ``x_j = emb[j:j+1]``;
    ``h~ = sum_k h_k``; ``i, o, u = W x_j + U h~ + b``; ``f_k = sigmoid(W_f x_j + U_f h_k + b_f)``
    (one per child, all children at once); ``c = i*u + sum_k f_k*c_k``; ``h = o*tanh(c)``. The
    trees of a batch are processed one after the other, and the roots' states go through one
    linear classifier (cross-entropy over ``classes``). No tracing, no batching across nodes:
    the graph dtr sees is the trees themselves, thousands of tiny ops per step.

    Presets: "tiny" is 3 trees of 6-14 nodes, hidden 8 (tests: ~300 ops forward). "bench" is
    16 trees of 50-150 nodes (about 1,600 nodes, like a batch of SST sentences' dependency
    trees), embeddings of 300 (GloVe's width), hidden 512 and 5 classes (SST fine-grained),
    vocabulary 5,000: the sizes the paper trains at, with hidden a little larger (it uses 150
    for child-sum) so that the states, not the Python loop, are what memory is made of.
    """

    def __init__(self, vocab: int, d_emb: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_emb)
        self.ioux = nn.Linear(d_emb, 3 * hidden)
        self.iouh = nn.Linear(hidden, 3 * hidden, bias=False)
        self.fx = nn.Linear(d_emb, hidden)
        self.fh = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, classes)
        self.hidden = hidden

    def node(self, x, children, j):
        xj = x[j : j + 1]
        kids = [self.node(x, children, k) for k in children[j]]
        iou = self.ioux(xj)
        if kids:
            hs = torch.cat([h for h, _ in kids])
            cs = torch.cat([c for _, c in kids])
            iou = iou + self.iouh(hs.sum(0, keepdim=True))
        i, o, u = iou.chunk(3, 1)
        c = torch.sigmoid(i) * torch.tanh(u)
        if kids:
            f = torch.sigmoid(self.fh(hs) + self.fx(xj))
            c = c + (f * cs).sum(0, keepdim=True)
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, trees):
        roots = [self.node(self.emb(tokens), children, 0)[0] for tokens, children in trees]
        return self.head(torch.cat(roots))


class BinaryTreeLSTM(nn.Module):
    """N-ary TreeLSTM with N = 2 (Tai et al. 2015, section 3.2) over random binary trees.

    A tree is ``(tokens, shape)``: ``tokens`` a 1-D int64 tensor of the leaves' tokens (a
    sentence), ``shape`` nested pairs whose leaves are positions in ``tokens`` (a binarized
    constituency parse). Leaves read their embedded token: ``i, o, u = W x + b``,
    ``c = i*u``, ``h = o*tanh(c)``. Internal nodes have no input but their two children:
    ``i, o, u = U [h_l; h_r] + b``, ``f_l, f_r = sigmoid(U_f [h_l; h_r] + b_f)`` (each forget gate
    sees both children, as the N-ary cell has it), ``c = i*u + f_l*c_l + f_r*c_r``,
    ``h = o*tanh(c)``. Nodes are processed one at a time by recursion in Python, trees one after
    the other; one linear classifier on the roots (cross-entropy over ``classes``).

    Presets: "tiny" is 3 sentences of 3-8 words, hidden 8 (tests). "bench" is 16 sentences of
    25-75 words (49-149 nodes each, about 1,600 per step), embeddings of 300, hidden 512,
    5 classes, vocabulary 5,000: an SST-sized batch of binarized parses (the paper's
    constituency TreeLSTM, with hidden 512 rather than its 150 so the states dominate memory).
    """

    def __init__(self, vocab: int, d_emb: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_emb)
        self.leaf = nn.Linear(d_emb, 3 * hidden)
        self.iou = nn.Linear(2 * hidden, 3 * hidden)
        self.f = nn.Linear(2 * hidden, 2 * hidden)
        self.head = nn.Linear(hidden, classes)

    def node(self, x, shape):
        if isinstance(shape, int):
            i, o, u = self.leaf(x[shape : shape + 1]).chunk(3, 1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return torch.sigmoid(o) * torch.tanh(c), c
        (hl, cl), (hr, cr) = self.node(x, shape[0]), self.node(x, shape[1])
        h2 = torch.cat([hl, hr], 1)
        i, o, u = self.iou(h2).chunk(3, 1)
        fl, fr = torch.sigmoid(self.f(h2)).chunk(2, 1)
        c = torch.sigmoid(i) * torch.tanh(u) + fl * cl + fr * cr
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, trees):
        roots = [self.node(self.emb(tokens), shape)[0] for tokens, shape in trees]
        return self.head(torch.cat(roots))


class MaskedCellLoop(nn.Module):
    """An ``nn.GRUCell`` or ``nn.LSTMCell`` unrolled by hand over a padded batch of
    variable-length token sequences, as one writes a loop that needs per-step control:
    every sequence runs at every step, and a sequence that has ended keeps its state
    (``h = torch.where(mask, h_new, h)``, with ``mask = lengths > t`` computed in the loop);
    the loop stops as soon as every sequence has ended (``if not mask.any(): break``, a
    data-dependent branch on a tensor made in the step), which with sequences shorter than the
    padding is before the padded length. The final states go through a linear classifier
    (cross-entropy). The lengths are not sorted.

    Presets: "tiny" is 6 sequences of 2-9 tokens padded to 12, hidden 8 (tests). "bench" is
    64 sequences of 20-80 tokens padded to 100, embeddings of 256, hidden 512, vocabulary
    10,000, 5 classes: a sentence-classification batch, the loop stopping at the longest
    sequence (about 80 steps of a cell on a 64 x 512 state).
    """

    def __init__(self, kind: str, vocab: int, d_emb: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_emb)
        self.cell = {"gru": nn.GRUCell, "lstm": nn.LSTMCell}[kind](d_emb, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens, lengths):
        x = self.emb(tokens)  # (batch, padded length, d_emb)
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        c = x.new_zeros(h.shape) if isinstance(self.cell, nn.LSTMCell) else None
        for t in range(x.shape[1]):
            mask = (lengths > t).unsqueeze(1)
            if not mask.any():
                break
            if c is None:
                h = torch.where(mask, self.cell(x[:, t], h), h)
            else:
                h_new, c_new = self.cell(x[:, t], (h, c))
                h, c = torch.where(mask, h_new, h), torch.where(mask, c_new, c)
        return self.head(h)


class GRUClassifier(nn.Module):
    """``nn.GRU(d_emb, hidden, num_layers=2, batch_first=True)`` over a padded batch of
    same-length token sequences, the last layer's final state into a linear classifier: the
    fused RNN op next to ``MaskedCellLoop``'s hand-written loop.

    Presets: "tiny" is 4 sequences of 10 tokens, hidden 8 (tests). "bench" is 32 sequences of
    128 tokens, embeddings of 256, hidden 512, vocabulary 10,000, 5 classes: a typical
    text-classification batch (two layers of 128 steps on a 32 x 512 state).
    """

    def __init__(self, vocab: int, d_emb: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_emb)
        self.rnn = nn.GRU(d_emb, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        _, h = self.rnn(self.emb(tokens))
        return self.head(h[-1])


class PackedLSTMClassifier(nn.Module):
    """``nn.LSTM`` (several layers, ``batch_first``) over a ``PackedSequence``: the padded,
    unsorted batch is packed in the step (``pack_padded_sequence(..., enforce_sorted=False)``,
    which sorts by length and gathers), the LSTM runs on shrinking batch sizes, and the last
    layer's final state (put back in the batch's order by ``nn.LSTM``) goes into a linear
    classifier. With ``pool=True`` the output is also unpacked (``pad_packed_sequence``) and
    mean-pooled over each sequence's length, and the classifier reads both; no preset sets it:
    ``pad_packed_sequence`` fails under ``dtr.budget`` for now (``tests/test_zoo_dynamic.py``,
    ``test_pad_packed_sequence``), so ``build("lstm_packed", pool=True)`` is the case to flip.

    Presets: "tiny" is 6 sequences of 2-10 tokens padded to 10, 2 layers, hidden 8 (tests).
    "bench" is 32 sequences of 16-128 tokens padded to 128, 3 layers, embeddings of 256,
    hidden 512, vocabulary 10,000, 5 classes: a document-classification batch whose lengths
    vary by 8x, where packing skips about 40% of the padded steps.
    """

    def __init__(self, vocab: int, d_emb: int, hidden: int, layers: int, classes: int, pool: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_emb)
        self.rnn = nn.LSTM(d_emb, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(2 * hidden if pool else hidden, classes)
        self.pool = pool

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        if not self.pool:
            return self.head(h[-1])
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        mean = out.sum(1) / lengths.to(out.dtype).unsqueeze(1)
        return self.head(torch.cat([h[-1], mean], 1))


def random_tree_children(rng: random.Random, nodes: int):
    """A random tree's ``children`` tuple (node ``i`` > 0 picks a random earlier parent)."""
    children: List[list] = [[] for _ in range(nodes)]
    for i in range(1, nodes):
        children[rng.randrange(i)].append(i)
    return tuple(tuple(c) for c in children)


def random_binary_tree(rng: random.Random, lo: int, hi: int):
    """Random nested pairs over leaf positions ``lo .. hi - 1`` (each span split at a uniform
    point, as a random binarized parse of the sentence)."""
    if hi - lo == 1:
        return lo
    k = rng.randint(lo + 1, hi - 1)
    return (random_binary_tree(rng, lo, k), random_binary_tree(rng, k, hi))


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
    # Dynamic models (issue 18); each model class's docstring says why these sizes.
    "treelstm_batch": {
        "tiny": dict(vocab=20, d_emb=6, hidden=8, classes=3, trees=3, nodes=(6, 14)),
        "bench": dict(vocab=5000, d_emb=300, hidden=512, classes=5, trees=16, nodes=(50, 150)),
    },
    "treelstm_nary": {
        "tiny": dict(vocab=20, d_emb=6, hidden=8, classes=3, trees=3, leaves=(3, 8)),
        "bench": dict(vocab=5000, d_emb=300, hidden=512, classes=5, trees=16, leaves=(25, 75)),
    },
    "gru_cell": {
        "tiny": dict(vocab=20, d_emb=6, hidden=8, classes=3, batch=6, lengths=(2, 9), padded=12),
        "bench": dict(vocab=10000, d_emb=256, hidden=512, classes=5, batch=64, lengths=(20, 80), padded=100),
    },
    "lstm_cell_masked": {
        "tiny": dict(vocab=20, d_emb=6, hidden=8, classes=3, batch=6, lengths=(2, 9), padded=12),
        "bench": dict(vocab=10000, d_emb=256, hidden=512, classes=5, batch=64, lengths=(20, 80), padded=100),
    },
    "gru": {
        "tiny": dict(vocab=20, d_emb=6, hidden=8, classes=3, batch=4, seq=10),
        "bench": dict(vocab=10000, d_emb=256, hidden=512, classes=5, batch=32, seq=128),
    },
    "lstm_packed": {
        "tiny": dict(vocab=20, d_emb=6, hidden=8, layers=2, classes=3, batch=6, lengths=(2, 10), padded=10),
        "bench": dict(vocab=10000, d_emb=256, hidden=512, layers=3, classes=5, batch=32, lengths=(16, 128), padded=128),
    },
}

# The seven models the core tests parametrize over (explicit: PRESETS holds DYNAMIC's too).
MODELS = ("mlp", "cnn", "resnet", "transformer", "lstm", "lstmcell", "treelstm")

# Dynamic models at realistic sizes (issue 18): trees and recurrent loops, built by ``build``.
DYNAMIC = ("treelstm_batch", "treelstm_nary", "gru_cell", "lstm_cell_masked", "gru", "lstm_packed")


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
    if name in DYNAMIC:
        return _build_dynamic(name, cfg, rng)
    raise ValueError(f"unknown workload {name!r}; choose from {MODELS + DYNAMIC}")


def _classify(m, b):
    """Cross-entropy of ``m(*inputs)`` against the labels, for ``batch = (*inputs, labels)``."""
    return F.cross_entropy(m(*b[:-1]), b[-1])


def _build_dynamic(name: str, cfg: dict, rng: random.Random) -> Workload:
    """``build`` for the ``DYNAMIC`` models (the RNG is already seeded)."""
    classes = cfg["classes"]
    if name in ("treelstm_batch", "treelstm_nary"):
        trees = []
        for _ in range(cfg["trees"]):
            if name == "treelstm_batch":
                n = rng.randint(*cfg["nodes"])
                trees.append((torch.randint(0, cfg["vocab"], (n,)), random_tree_children(rng, n)))
            else:
                n = rng.randint(*cfg["leaves"])
                trees.append((torch.randint(0, cfg["vocab"], (n,)), random_binary_tree(rng, 0, n)))
        cls = ChildSumTreeLSTM if name == "treelstm_batch" else BinaryTreeLSTM
        model = cls(cfg["vocab"], cfg["d_emb"], cfg["hidden"], classes)
        batch = (trees, torch.randint(0, classes, (len(trees),)))
    elif name == "gru":
        model = GRUClassifier(cfg["vocab"], cfg["d_emb"], cfg["hidden"], classes)
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
        batch = (tokens, torch.randint(0, classes, (cfg["batch"],)))
    else:
        if name == "lstm_packed":
            model = PackedLSTMClassifier(cfg["vocab"], cfg["d_emb"], cfg["hidden"], cfg["layers"], classes, cfg.get("pool", False))
        else:
            model = MaskedCellLoop("gru" if name == "gru_cell" else "lstm", cfg["vocab"], cfg["d_emb"], cfg["hidden"], classes)
        lengths = torch.tensor([rng.randint(*cfg["lengths"]) for _ in range(cfg["batch"])])
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["padded"]))
        tokens = tokens.masked_fill(torch.arange(cfg["padded"]) >= lengths.unsqueeze(1), 0)  # 0 pads
        batch = (tokens, lengths, torch.randint(0, classes, (cfg["batch"],)))
    return Workload(name, model, batch, _classify)


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
