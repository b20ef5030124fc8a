"""The demo's data: a built-in synthetic corpus (sentences from a small grammar, generated deterministically),
modelled character by character. The global batch of step ``k`` is a function of the seed and ``k`` only, cut into
equal parts by data-parallel rank, so the data position of a checkpoint is the step."""

from __future__ import annotations

import random
from typing import List, Tuple

import torch

__all__ = ["build_corpus", "CharData"]

_NAMES = ["anna", "bob", "carla", "dev", "emil", "fatima", "gus", "hana", "ivan", "jules"]
_ADJ = ["red", "small", "quiet", "bright", "old", "green", "heavy", "soft", "quick", "lazy"]
_NOUN = ["cat", "lamp", "river", "garden", "train", "letter", "window", "cloud", "drum", "boat"]
_VERB = ["sees", "paints", "finds", "carries", "likes", "builds", "follows", "hears"]
_PLACE = ["in the park", "at home", "by the sea", "under the bridge", "on the hill", "near the mill"]


def build_corpus(num_sentences: int = 4000, seed: int = 0) -> str:
    """A deterministic synthetic text: sentences like ``"anna sees the red cat by the sea."`` and counting lines
    (``"3 4 5 6."``), enough structure for a small LM to learn quickly."""
    rng = random.Random(seed)
    out = []
    for i in range(num_sentences):
        if i % 7 == 6:
            s = rng.randint(0, 5)
            out.append(" ".join(str(s + j) for j in range(4)) + ".")
        else:
            n = rng.choice(_NAMES)
            s = f"{n} {rng.choice(_VERB)} the {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
            if rng.random() < 0.5:
                s += " " + rng.choice(_PLACE)
            out.append(s + ".")
    return "\n".join(out) + "\n"


class CharData:
    """A text as a sequence of character ids (``vocab_size`` distinct characters)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.int64)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def step_microbatches(self, seed: int, step: int, dp: int, dp_rank: int, microbatches: int, batch: int,
                          seq: int, device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Step ``step``'s ``microbatches`` (tokens, labels) pairs of ``[batch, seq]`` for data-parallel rank
        ``dp_rank`` of ``dp``: the global batch of the step is a fixed function of ``seed`` and ``step``, cut into
        equal parts by data-parallel rank, so a resumed run (at any data-parallel size with the same global batch)
        sees the same data."""
        per_rank = microbatches * batch
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - seq - 1, (dp * per_rank,), generator=gen)
        mine = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank].view(microbatches, batch, 1)
        win = self.data[mine + torch.arange(seq + 1)]  # [M, B, S + 1]
        return [(w[:, :-1].contiguous().to(device, non_blocking=True),
                 w[:, 1:].contiguous().to(device, non_blocking=True)) for w in win]
