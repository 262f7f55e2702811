"""Synthetic tasks that need position and retrieval, as seeded, deterministic token generators.

Every sequence is a full causal-LM sequence: the model reads ``tokens[:, :-1]`` and is scored where
``answer`` is True on ``tokens[:, 1:]``. Layouts (``|`` only separates parts here):

- passkey: ``BOS filler.. MARK k1..kK filler.. | SEP k1..kK`` -- the filler is drawn from the key's own
  alphabet, so the marker is the only cue and the key must be read at a fixed offset after it.
  ``depth`` 0 puts the marker right after BOS (farthest from the question), 1 right before SEP.
- copy / reverse: ``BOS x1..xn SEP x1..xn`` (reverse: ``xn..x1``).
- recall: ``BOS filler.. a1 v1 filler.. an vn filler.. SEP q1 w1 .. qm wm`` -- n (key, value) pairs with
  distinct keys at random places in filler drawn from the value alphabet (a value is only known by the
  key right before it); queries q_j among the keys, w_j the value stored with q_j. Longer sequences
  hold the same number of pairs in more filler.

Odd leftovers (a length that does not divide into the layout) become extra BOS tokens at the start.
Vocabulary: PAD 0, BOS 1, SEP 2, MARK 3, then the task's symbols.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import BenchConfig

PAD, BOS, SEP, MARK = 0, 1, 2, 3
NUM_SPECIAL = 4


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, N] int64
    answer: torch.Tensor  # [B, N] bool: tokens the model must predict (never position 0)
    depth: torch.Tensor | None = None  # [B] passkey depth fraction

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> inputs [B, N-1], targets [B, N-1], scored [B, N-1]."""
        return self.tokens[:, :-1], self.tokens[:, 1:], self.answer[:, 1:]


class Task:
    """A task: a vocabulary, a metric and ``sample(batch, length, generator)``."""

    name: str = ""
    metric: str = "token"  # "exact": a sequence counts when every answer token is right; "token": per token
    vocab_size: int = NUM_SPECIAL

    def min_length(self) -> int:
        raise NotImplementedError

    def max_length(self) -> int | None:
        return None

    def check_length(self, length: int) -> None:
        longest = self.max_length()
        if length < self.min_length() or (longest is not None and length > longest):
            raise ValueError(f"{self.name}: length {length} outside [{self.min_length()}, {longest or 'inf'}]")

    def sample(self, batch: int, length: int, generator: torch.Generator, **kw: float) -> Batch:
        raise NotImplementedError


def _symbols(low: int, count: int, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(low, low + count, shape, generator=g)


class Passkey(Task):
    name, metric = "passkey", "exact"

    def __init__(self, values: int = 16, key_len: int = 1) -> None:
        if values < 2 or key_len < 1:
            raise ValueError(f"passkey needs values >= 2 and key_len >= 1, got {values}, {key_len}")
        self.values, self.key_len = values, key_len
        self.vocab_size = NUM_SPECIAL + values

    def min_length(self) -> int:
        return 2 * self.key_len + 4  # BOS, MARK + key, one more marker position, SEP, answer

    def slots(self, length: int) -> int:
        """Number of marker positions minus one: depth d puts the marker at 1 + round(d * slots)."""
        return length - 2 * (self.key_len + 1) - 1

    def sample(self, batch: int, length: int, generator: torch.Generator, *, depth: float | None = None) -> Batch:
        self.check_length(length)
        k, slots = self.key_len, self.slots(length)
        tokens = _symbols(NUM_SPECIAL, self.values, (batch, length), generator)  # filler = key alphabet
        key = _symbols(NUM_SPECIAL, self.values, (batch, k), generator)
        if depth is None:
            marker = torch.randint(0, slots + 1, (batch,), generator=generator) + 1
        else:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth is a fraction in [0, 1], got {depth}")
            marker = torch.full((batch,), 1 + round(depth * slots))
        rows = torch.arange(batch)
        tokens[:, 0] = BOS
        tokens[rows, marker] = MARK
        for j in range(k):
            tokens[rows, marker + 1 + j] = key[:, j]
        tokens[:, length - k - 1] = SEP
        tokens[:, length - k :] = key
        answer = torch.zeros(batch, length, dtype=torch.bool)
        answer[:, length - k :] = True
        return Batch(tokens, answer, (marker - 1).float() / slots)


class Copy(Task):
    metric = "token"

    def __init__(self, values: int = 64, reverse: bool = False) -> None:
        if values < 2:
            raise ValueError(f"copy needs values >= 2, got {values}")
        self.values, self.reverse = values, reverse
        self.name = "reverse" if reverse else "copy"
        self.vocab_size = NUM_SPECIAL + values

    def min_length(self) -> int:
        return 4

    def sample(self, batch: int, length: int, generator: torch.Generator, **_: float) -> Batch:
        self.check_length(length)
        n, extra = divmod(length - 2, 2)
        x = _symbols(NUM_SPECIAL, self.values, (batch, n), generator)
        out = x.flip(1) if self.reverse else x
        start = torch.full((batch, 1 + extra), BOS)
        tokens = torch.cat((start, x, torch.full((batch, 1), SEP), out), dim=1)
        answer = torch.zeros_like(tokens, dtype=torch.bool)
        answer[:, length - n :] = True
        return Batch(tokens, answer)


class Recall(Task):
    name, metric = "recall", "token"

    def __init__(self, keys: int = 32, values: int = 16, pairs: int = 8, queries: int = 4) -> None:
        if not keys >= pairs >= queries >= 1 or values < 2:
            raise ValueError(
                f"recall needs keys >= pairs >= queries >= 1 and values >= 2, got {keys}, {pairs}, {queries}, {values}"
            )
        self.keys, self.values, self.pairs, self.queries = keys, values, pairs, queries
        self.vocab_size = NUM_SPECIAL + keys + values

    def min_length(self) -> int:
        return 2 + 2 * self.pairs + 2 * self.queries

    def sample(self, batch: int, length: int, generator: torch.Generator, **_: float) -> Batch:
        self.check_length(length)
        n, m = self.pairs, self.queries
        context = length - 2 - 2 * m  # tokens between BOS and SEP
        value_low = NUM_SPECIAL + self.keys
        tokens = _symbols(value_low, self.values, (batch, length), generator)  # filler = value alphabet
        tokens[:, 0], tokens[:, length - 2 * m - 1] = BOS, SEP
        keys = torch.stack([torch.randperm(self.keys, generator=generator)[:n] for _ in range(batch)]) + NUM_SPECIAL
        vals = _symbols(value_low, self.values, (batch, n), generator)
        # n non-overlapping (key, value) blocks among the filler: choose n of the context - n items, sorted;
        # block i then starts i tokens later (stars and bars), so every placement is equally likely
        items = torch.stack([torch.randperm(context - n, generator=generator)[:n].sort().values for _ in range(batch)])
        starts = 1 + items + torch.arange(n)  # [B, n]
        tokens.scatter_(1, starts, keys)
        tokens.scatter_(1, starts + 1, vals)
        asked = torch.stack([torch.randperm(n, generator=generator)[:m] for _ in range(batch)])  # [B, m]
        questions = torch.stack((keys.gather(1, asked), vals.gather(1, asked)), dim=-1).flatten(1)  # q1 w1 q2 w2 ..
        tokens[:, length - 2 * m :] = questions
        answer = torch.zeros_like(tokens, dtype=torch.bool)
        answer[:, length - 2 * m + 1 :: 2] = True  # the value after each query key
        return Batch(tokens, answer)


def build_task(name: str, cfg: BenchConfig) -> Task:
    if name == "passkey":
        return Passkey(cfg.passkey.values, cfg.passkey.key_len)
    if name in ("copy", "reverse"):
        options = cfg.copy if name == "copy" else cfg.reverse
        return Copy(options.values, reverse=name == "reverse")
    if name == "recall":
        r = cfg.recall
        return Recall(r.keys, r.values, r.pairs, r.queries)
    raise ValueError(f"unknown task {name!r}; known: passkey, copy, reverse, recall")
