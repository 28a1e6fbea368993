"""The data rules of the Intern-S2 walkthrough's Ch. 3: long documents split into overlapping
chunks (Worked example 9: the chapter's numbers, and the rule's properties checked exhaustively
over small sizes) and the visual-gain filter (Worked example 7)."""

from __future__ import annotations

import itertools

import pytest

from megatron_s2.data.chunking import chunk_count, chunk_spans, duplicated_tokens, split_document

CAP, OVERLAP = 256_000, 512


def test_worked_example_9_stride_and_duplicated_fraction():
    """"With a stride of 256,000 − 512 = 255,488 new tokens per chunk, a document of D tokens needs
    about D / 255,488 chunks ... Two tokens in a thousand, seen twice. For a corpus of 1 trillion
    tokens that is 2 billion duplicated tokens." And: "at a 512/256,000 overlap ratio you are
    re-training on 0.2% of tokens twice"."""
    spans = chunk_spans(3 * CAP, CAP, OVERLAP)
    assert [b - a for a, b in spans[:-1]] == [CAP] * (len(spans) - 1)
    assert spans[1][0] - spans[0][0] == 255_488 == CAP - OVERLAP
    d = 10**12
    assert abs(chunk_count(d, CAP, OVERLAP) - d / 255_488) < 1
    dup = duplicated_tokens(d, CAP, OVERLAP)
    assert round(dup / d, 3) == 0.002 and round(dup / 1e9) == 2     # 2.004e9: "2 billion"
    assert round(OVERLAP / CAP * 100, 1) == 0.2


def test_worked_example_9_a_dependency_across_the_seam_survives():
    """"Consider a cross-reference ... landing 200 tokens after a hard chunk boundary ... With a
    512-token overlap, every dependency shorter than 512 tokens survives intact in at least one
    chunk." The evidence 300 tokens before the first chunk's end, the claim 200 tokens after it."""
    spans = chunk_spans(600_000, CAP, OVERLAP)
    evidence, claim = CAP - 300, CAP + 200
    assert evidence < CAP <= claim and claim - evidence < OVERLAP  # a hard cut at CAP would separate them
    assert any(a <= evidence and claim < b for a, b in spans)


def test_a_document_that_fits_is_one_chunk_and_an_empty_one_none():
    assert chunk_spans(CAP, CAP, OVERLAP) == [(0, CAP)]
    assert chunk_spans(5, CAP, OVERLAP) == [(0, 5)]
    assert chunk_spans(0, CAP, OVERLAP) == [] and duplicated_tokens(0, CAP, OVERLAP) == 0
    assert split_document("abcdefghij", 4, 1) == ["abcd", "defg", "ghij"]


@pytest.mark.parametrize("cap, overlap", [(4, 4), (4, 7), (0, 0), (4, -1)])
def test_impossible_settings_are_refused(cap, overlap):
    with pytest.raises(ValueError, match="chunk"):
        chunk_spans(10, cap, overlap)


def test_properties_exhaustively_over_small_sizes():
    """For every length <= 60, cap <= 12 and overlap < cap: the chunks cover the document in order,
    none is empty or over the cap, consecutive chunks share exactly ``overlap`` tokens, each brings
    new tokens, every window of ``overlap + 1`` tokens lies whole in one chunk, and the closed forms
    (count, duplicated tokens) agree with the spans."""
    for length, cap in itertools.product(range(61), range(1, 13)):
        for overlap in range(cap):
            spans = chunk_spans(length, cap, overlap)
            assert len(spans) == chunk_count(length, cap, overlap)
            assert sum(b - a for a, b in spans) - length == duplicated_tokens(length, cap, overlap)
            if length == 0:
                assert spans == []
                continue
            assert spans[0][0] == 0 and spans[-1][1] == length
            assert all(0 < b - a <= cap for a, b in spans)
            for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
                assert b0 - a1 == overlap and b1 > b0
            window = min(overlap + 1, length)
            for start in range(length - window + 1):
                assert any(a <= start and start + window <= b for a, b in spans), (length, cap, overlap, start)


def test_worked_example_7_visual_gain_in_bits():
    """Walkthrough, Worked example 7: "text-only PPL 12.4, interleaved PPL 9.1" -> Delta H =
    0.3094 nats = 0.4464 bits per token; "700 text tokens, so the figure supplied 700 x 0.4464 ≈
    312 bits — about 39 bytes". The stock photo: "text-only PPL 11.0, interleaved PPL 10.9. Then
    Delta H = ln(11.0) − ln(10.9) = 2.3979 − 2.3888 = 0.0091 nats = 0.0131 bits per token, or about
    9 bits for the whole page"."""
    from megatron_s2.data.visual_gain import visual_gain

    figure = visual_gain(12.4, 9.1, 700)
    assert (round(figure.nats_per_token, 4), round(figure.bits_per_token, 4)) == (0.3094, 0.4464)
    assert round(figure.page_bits) == 312 and round(figure.page_bits / 8) == 39
    photo = visual_gain(11.0, 10.9, 700)
    # the walkthrough converts the rounded 0.0091 nats (0.0091 / ln 2 = 0.0131); unrounded it is 0.01318
    assert round(photo.nats_per_token, 4) == 0.0091 and abs(photo.bits_per_token - 0.0131) < 1e-4
    assert round(photo.page_bits) == 9
    assert figure.keep(0.1) and not photo.keep(0.1)
    with pytest.raises(ValueError, match="perplexities"):
        visual_gain(0.5, 2.0, 10)
