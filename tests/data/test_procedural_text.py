"""The procedural general / domain corpora of the Memory Decoder (megatron_s2/data/procedural_text.py):
deterministic per seed, two distinct token distributions, held-out splits of one language, and the
``procedural_text`` data kind through the ordinary data iterator."""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_s2.config.data import DataConfig
from megatron_s2.config.schema import ConfigError, from_mapping
from megatron_s2.data import build_data_iterator, build_tokenizer
from megatron_s2.data.procedural_text import generate_texts, language


def _chars(texts):
    counts = Counter("".join(texts))
    total = sum(counts.values())
    return {c: n / total for c, n in counts.items()}


def test_same_seeds_same_documents_other_seed_other_documents():
    assert generate_texts("domain", 50, seed=3) == generate_texts("domain", 50, seed=3)
    assert generate_texts("domain", 50, seed=3) != generate_texts("domain", 50, seed=4)
    assert generate_texts("domain", 5, seed=3, language_seed=1) != generate_texts("domain", 5, seed=3)


def test_domain_and_general_are_distinct_distributions():
    """Total variation between the two corpora's character distributions is large (they share only
    the space and the full stop), and the domain's grammar is narrower (fewer successors)."""
    general, domain = _chars(generate_texts("general", 400, 0)), _chars(generate_texts("domain", 400, 0))
    tv = 0.5 * sum(abs(general.get(c, 0.0) - domain.get(c, 0.0)) for c in set(general) | set(domain))
    assert tv > 0.7
    assert set(domain) - set(" .") <= set("ACGU0123456789")
    assert set(general) - set(" .") <= set("abcdefghijklmnopqrstuvwxyz")
    assert len(language("domain").successors[0]) < len(language("general").successors[0])


def test_a_held_out_split_is_the_same_language():
    """Another document seed draws new documents from the same lexicon and grammar."""
    lang = language("domain")
    lexicon = set(lang.words)
    held_out = generate_texts("domain", 200, seed=99)
    assert set(generate_texts("domain", 200, seed=0)) != set(held_out)
    for text in held_out:
        for sentence in text.rstrip(".").split(". "):
            words = sentence.split()
            assert set(words) <= lexicon
            for a, b in zip(words, words[1:]):  # every transition is one the grammar allows
                assert lang.words.index(b) in lang.successors[lang.words.index(a)]

def test_procedural_text_kind_feeds_the_data_iterator():
    cfg = from_mapping(DataConfig, {"kind": "procedural_text", "corpus": "domain", "num_documents": 64,
                                    "dataset_seed": 5})
    tok = build_tokenizer(cfg)
    it = build_data_iterator(cfg, seq_length=32, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1,
                             seed=1, phase="pretrain", tokenizer=tok)
    mb = it.next_step()[0]
    text = tok.decode([t for t in mb["tokens"][0].tolist() if t not in (tok.bos_id, tok.eos_id, tok.pad_id)])
    assert set(text) - set(" .") <= set("ACGU0123456789") and mb["loss_mask"].sum() > 0
    with pytest.raises(ConfigError, match="corpus"):
        from_mapping(DataConfig, {"kind": "procedural_text", "corpus": "biology"})
    with pytest.raises(ConfigError, match="language_seed"):
        from_mapping(DataConfig, {"kind": "procedural_text", "language_seed": -1})
