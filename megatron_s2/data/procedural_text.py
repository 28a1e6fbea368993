"""Procedural text corpora: a "general" language and a "domain" language, generated from seeds.

The Memory Decoder (Intern-S2 walkthrough Ch. 2) specialises a frozen backbone to a domain corpus
whose token distribution differs from the general one; every phase of it (backbone, datastore,
memory pre-training, router training on domain + general, held-out perplexities) needs both
corpora offline and reproducible. Each language is a lexicon of pseudo-words over its own
alphabet and a sparse word-bigram grammar (each word has a few successors with 1/rank weights),
both fixed by ``language_seed``; documents (one to two sentences) are drawn from that grammar
with the document seed. So a held-out split is the same language with another document seed,
and the two languages differ in characters, word shapes and transitions:

* ``general`` — lowercase words of 2-7 letters, 8 successors per word: broad, less predictable;
* ``domain``  — nucleotide-like upper-case words (A, C, G, U) of 3-6 letters, some with a digit
  suffix, 3 successors per word: a narrow, regular distribution a small memory can absorb.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from megatron_s2.data.documents import InMemoryDocuments, render_text
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["CORPORA", "ProceduralLanguage", "language", "generate_texts", "build_procedural_text_documents"]


@dataclass(frozen=True)
class _Style:
    alphabet: str
    word_lengths: tuple[int, int]
    lexicon_size: int
    successors: int
    digit_suffix: float     # probability that a lexicon word ends in a digit
    sentence_words: tuple[int, int]


CORPORA: dict[str, _Style] = {
    "general": _Style(string.ascii_lowercase, (2, 7), 240, 8, 0.0, (3, 8)),
    "domain": _Style("ACGU", (3, 6), 90, 3, 0.3, (3, 8)),
}
"""The corpora :func:`language` builds, by name."""


class ProceduralLanguage:
    """A lexicon and a word-bigram grammar (module docstring); sample with :meth:`sentence`."""

    def __init__(self, style: _Style, seed: int):
        rng = random.Random(seed)
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < style.lexicon_size:
            word = "".join(rng.choice(style.alphabet) for _ in range(rng.randint(*style.word_lengths)))
            if rng.random() < style.digit_suffix:
                word += rng.choice(string.digits)
            if word not in seen:
                seen.add(word)
                words.append(word)
        self.style, self.words = style, words
        # successors[i]: the word indices that may follow word i, most likely first (weight 1/rank)
        self.successors = [rng.sample(range(len(words)), style.successors) for _ in words]
        self.weights = [1.0 / (rank + 1) for rank in range(style.successors)]

    def sentence(self, rng: random.Random) -> str:
        word = rng.randrange(len(self.words))
        out = [self.words[word]]
        for _ in range(rng.randint(*self.style.sentence_words) - 1):
            word = rng.choices(self.successors[word], self.weights)[0]
            out.append(self.words[word])
        return " ".join(out) + "."


def language(corpus: str, language_seed: int = 0) -> ProceduralLanguage:
    """The procedural language ``corpus`` (a key of :data:`CORPORA`) fixed by ``language_seed``."""
    if corpus not in CORPORA:
        raise ValueError(f"procedural text corpus '{corpus}' is unknown; valid: {', '.join(CORPORA)}")
    # the corpus name is part of the seed: general and domain are unrelated languages for one seed
    return ProceduralLanguage(CORPORA[corpus], hash_seed(corpus, language_seed))


def hash_seed(name: str, seed: int) -> int:
    """A stable (process-independent, unlike hash()) 63-bit seed from a name and an integer."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{name}:{seed}".encode()).digest()[:8], "little") >> 1


def generate_texts(corpus: str, count: int, seed: int, language_seed: int = 0) -> list[str]:
    """``count`` documents (one or two sentences) of ``corpus``; deterministic in both seeds."""
    lang = language(corpus, language_seed)
    rng = random.Random(hash_seed(f"documents:{corpus}", seed))
    return [" ".join(lang.sentence(rng) for _ in range(rng.randint(1, 2))) for _ in range(count)]


def build_procedural_text_documents(corpus: str, count: int, seed: int, tokenizer: Tokenizer,
                                    language_seed: int = 0) -> InMemoryDocuments:
    """Tokenised ``bos + text + eos`` documents of :func:`generate_texts` (every token a target)."""
    return InMemoryDocuments.from_documents(render_text(tokenizer, text)
                                            for text in generate_texts(corpus, count, seed, language_seed))
