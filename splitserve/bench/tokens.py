"""TokenSynth: deterministic prompt token ids, so prompts need no tokenizer and a workload's
prefix sharing is exact (equal keys give equal tokens, different keys different ones)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Key namespaces of the seeded streams (the first word after seed and salt).
_STREAM, _BLOCK, _SYSTEM = 1, 2, 3

# For the chat endpoint, which takes text: token id -> word. Equal ids give equal words, so
# shared token prefixes stay shared text prefixes (lengths are then only approximate).
_WORDS = ("time person year way day thing man world life hand part child eye woman place "
          "work week case point company number group problem fact water room mother area "
          "money story month lot right study book job word business issue side kind head "
          "house service friend father power hour game line end member law car city name "
          "team minute idea body back parent face others level office door health art war "
          "history party result change morning reason research girl guy moment air teacher "
          "force education").split()


@dataclass
class TokenSynth:
    """Draws token ids uniformly from [low, high), a range of ordinary (non-special) tokens
    of the vocabulary. `salt` (the run index) changes every token but no length."""
    seed: int = 0
    salt: int = 0
    low: int = 1000
    high: int = 40000
    _blocks: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.salt, *keys])

    def _draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(t) for t in rng.integers(self.low, self.high, size=n)]

    def request(self, index: int, n: int) -> list[int]:
        """`n` fresh tokens for request (or message) number `index`."""
        return self._draw(self._rng(_STREAM, index), n)

    def system(self, n: int) -> list[int]:
        """The shared system prompt of the sessions workload."""
        return self._draw(self._rng(_SYSTEM), n)

    def block(self, hash_id: int, size: int) -> list[int]:
        """The `size` tokens of trace block `hash_id`: a function of (seed, salt, hash_id,
        size) only, so every request naming that id gets the same tokens."""
        key = (hash_id, size)
        if key not in self._blocks:
            self._blocks[key] = self._draw(self._rng(_BLOCK, hash_id), size)
        return self._blocks[key]


def token_text(token_ids: Sequence[int]) -> str:
    """A text stand-in for `token_ids` (one common English word per id), for /v1/chat."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids)
