"""Training tasks on real data present on every machine, nothing downloaded at run time.

* ``mlp``  -- next-byte MLP on the Python standard library's source (the demo's task).
* ``gpt``  -- byte-level causal transformer (pre-LN) on the same corpus.
* ``bert`` -- masked-byte model, pre-LN transformer encoder (the papers' BERT setting in miniature).
* ``digits`` -- a small CNN on scikit-learn's bundled 8x8 digits (optional extra ``vision``).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["BLOCK", "TASKS", "ByteCorpus", "ByteMLP", "ByteTransformer", "DigitsCNN", "Task", "TaskSpec", "digits_split"]

TASKS = ("mlp", "gpt", "bert", "digits")
MASK = 256  # the masked-LM's [MASK] token, after the 256 byte values
BLOCK = 4096  # bytes per block of ByteCorpus's block split and iid shards


def _english_bytes() -> bytes:
    """English prose shipped with every CPython: the documentation topics behind ``help()``."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    if not text:
        raise RuntimeError("pydoc_data.topics holds no text")
    return text.encode("utf-8")


def _python_bytes(max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python sources found under {root}")
    return b"".join(chunks)


class ByteCorpus:
    """Real text present on every machine, split train/held-out: the standard library's
    ``.py`` files (``"python"``, sorted, capped) or its English documentation (``"english"``,
    the ``help()`` topics, about 0.7 MB, with the UTF-8 multi-byte characters that make some
    byte values rare).

    ``split="tail"`` holds out the last ``holdout`` of the bytes (for the sorted sources: other
    modules than those trained on); ``"blocks"`` every ``1/holdout``-th block of
    :data:`BLOCK` bytes, so that the held-out text comes from the training distribution.
    """

    def __init__(self, max_bytes: int = 4_000_000, holdout: float = 0.1, text: str = "python",
                 split: str = "tail") -> None:
        if text not in ("python", "english"):
            raise ValueError(f"text must be 'python' or 'english', got {text!r}")
        if split not in ("tail", "blocks"):
            raise ValueError(f"split must be 'tail' or 'blocks', got {split!r}")
        raw = _english_bytes() if text == "english" else _python_bytes(max_bytes)
        data = torch.frombuffer(bytearray(raw[:max_bytes]), dtype=torch.uint8).long()
        if split == "tail":
            cut = int(len(data) * (1 - holdout))
            self.train, self.heldout = data[:cut], data[cut:]
            return
        blocks = data[: len(data) // BLOCK * BLOCK].view(-1, BLOCK)
        held = torch.arange(len(blocks)) % round(1 / holdout) == round(1 / holdout) - 1
        self.train, self.heldout = blocks[~held].reshape(-1), blocks[held].reshape(-1)

    def shard(self, rank: int, world: int, iid: bool = False) -> None:
        """Keep only this rank's 1/world of the training bytes: a contiguous slice (the sorted
        sources: each rank its own modules, strongly non-identical data), or with ``iid`` every
        ``world``-th of the :data:`BLOCK`-byte blocks in a fixed random order (each rank a
        sample of the whole text)."""
        if not iid:
            size = len(self.train) // world
            self.train = self.train[rank * size : (rank + 1) * size]
            return
        blocks = self.train[: len(self.train) // BLOCK * BLOCK].view(-1, BLOCK)
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))
        self.train = blocks[order[rank::world]].reshape(-1)

    def windows(self, length: int, size: int, generator: torch.Generator, heldout: bool = False) -> Tensor:
        """``size`` random windows of ``length`` consecutive bytes, as int64."""
        data = self.heldout if heldout else self.train
        start = torch.randint(0, len(data) - length, (size,), generator=generator)
        return data[start.unsqueeze(1) + torch.arange(length)]

    def batch(self, context: int, size: int, generator: torch.Generator, heldout: bool = False) -> tuple[Tensor, Tensor]:
        """``size`` random windows: ``context`` bytes in, the next byte as target."""
        windows = self.windows(context + 1, size, generator, heldout)
        return windows[:, :context], windows[:, context]


def digits_split(rank: int = 0, world: int = 1) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """scikit-learn's bundled 8x8 digits, shuffled once: this rank's 1/world of the 80% training
    split, and the 20% held out, as (images, labels) pairs."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits task needs scikit-learn: pip install 'onebit[vision]'") from exc
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    train = order[:cut].chunk(world)[rank]
    return (x[train], y[train]), (x[order[cut:]], y[order[cut:]])


class ByteMLP(nn.Module):
    """Next-byte predictor: embed ``context`` bytes, two hidden layers, 256 logits."""

    def __init__(self, context: int = 16, embed: int = 32, hidden: int = 512, hidden2: int | None = None) -> None:
        super().__init__()
        self.context = context
        hidden2 = hidden if hidden2 is None else hidden2
        self.embed = nn.Embedding(256, embed)
        self.net = nn.Sequential(
            nn.Linear(context * embed, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden2),
            nn.GELU(),
            nn.Linear(hidden2, 256),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.embed(x).flatten(1))


class ByteTransformer(nn.Module):
    """Pre-LN transformer over bytes: causal (GPT) or bidirectional with a [MASK] token (BERT).

    About ``12 * layers * d_model**2`` parameters: ``d_model=128, layers=4`` is ~0.9M,
    ``512, 8`` ~25M, ``768, 12`` ~85M.
    """

    def __init__(self, context: int, d_model: int, layers: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(257, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        nn.init.normal_(self.position, std=0.02)
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x) + self.position[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=self.causal)))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a linear head for 8x8 grey digits."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


@dataclass(frozen=True)
class TaskSpec:
    """The task and its model's size options (each task reads the ones it needs)."""

    task: str = "mlp"
    context: int = 16
    hidden: int = 512
    d_model: int = 128
    layers: int = 2
    heads: int = 4


class Task:
    """A model, its training batches and its held-out loss."""

    def __init__(self, spec: TaskSpec) -> None:
        if spec.task not in TASKS:
            raise ValueError(f"unknown task {spec.task!r}; available: {', '.join(TASKS)}")
        self.spec = spec
        self.loss_fn = nn.CrossEntropyLoss()
        if spec.task == "digits":
            self.train_xy, self.heldout_xy = digits_split()
        else:
            self.corpus = ByteCorpus()

    def model(self) -> nn.Module:
        s = self.spec
        if s.task == "mlp":
            return ByteMLP(context=s.context, hidden=s.hidden)
        if s.task == "digits":
            return DigitsCNN()
        if s.d_model % s.heads:
            raise ValueError(f"d_model={s.d_model} must be a multiple of heads={s.heads}")
        return ByteTransformer(s.context, s.d_model, s.layers, s.heads, causal=s.task == "gpt")

    def batch(self, size: int, generator: torch.Generator, heldout: bool = False) -> tuple[Tensor, Tensor]:
        """Inputs and targets, in the shapes :meth:`loss` expects."""
        s = self.spec
        if s.task == "digits":
            x, y = self.heldout_xy if heldout else self.train_xy
            idx = torch.randint(0, len(y), (size,), generator=generator)
            return x[idx], y[idx]
        if s.task == "mlp":
            return self.corpus.batch(s.context, size, generator, heldout)
        if s.task == "gpt":
            w = self.corpus.windows(s.context + 1, size, generator, heldout)
            return w[:, :-1], w[:, 1:]
        # BERT-style masking: 15% of positions are predicted; of those 80% [MASK], 10% random, 10% kept.
        w = self.corpus.windows(s.context, size, generator, heldout)
        chosen = torch.rand(w.shape, generator=generator) < 0.15
        roll = torch.rand(w.shape, generator=generator)
        x = w.clone()
        x[chosen & (roll < 0.8)] = MASK
        random_bytes = torch.randint(0, 256, w.shape, generator=generator)
        swap = chosen & (roll >= 0.8) & (roll < 0.9)
        x[swap] = random_bytes[swap]
        return x, torch.where(chosen, w, torch.full_like(w, -100))

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = model(x)
        if out.dim() == 3:
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=-100)
        return self.loss_fn(out, y)

