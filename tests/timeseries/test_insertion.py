"""Series tokens land at their reserved positions in a family's embeddings (issue 24, "inserted
at series-token positions"), for both families, and the backbone's loss trains the encoder."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.models.family import family_of
from megatron_s2.models.timeseries.encoder import SeriesInput, TimeSeriesEncoder, TimeSeriesEncoderConfig
from megatron_s2.models.timeseries.insertion import SeriesPlacement, merge_series_embeddings


def _model(family: str):
    if family == "intern_s2":
        from megatron_s2.models.intern_s2.config import InternS2Config
        cfg = InternS2Config()
    else:
        import yaml
        from pathlib import Path
        from megatron_s2.config.schema import from_mapping
        from megatron_s2.models.v41.config import V41Config
        recipe = Path(__file__).resolve().parents[2] / "recipes" / "models" / "tiny.yaml"
        cfg = from_mapping(V41Config, yaml.safe_load(recipe.read_text()))
    torch.manual_seed(0)
    return family_of(cfg).build_model(cfg).init_weights(0)


@pytest.mark.parametrize("family", ["intern_s2", "v41"])
def test_series_tokens_replace_their_span_only(family):
    model = _model(family)
    words = model.embedding["word_embeddings"]
    torch.manual_seed(1)
    encoder = TimeSeriesEncoder(TimeSeriesEncoderConfig(output_hidden=words.weight.size(1), hidden=16, heads=2,
                                                        token_budget=8, queries_per_patch=2, temporal_layers=1))
    ids = torch.randint(0, 100, (2, 24))
    h = words(ids).float()
    placements = [[SeriesPlacement(3, SeriesInput(torch.randn(2, 300), 50.0))],
                  [SeriesPlacement(0, SeriesInput(torch.randn(1, 5))), SeriesPlacement(16, SeriesInput(torch.randn(3, 40)))]]
    merged, encoding = merge_series_embeddings(h, placements, encoder)
    counts = [plan.num_tokens for plan in encoding.plans]
    assert counts == [8, 6, 8]       # budget 8, Q 2 -> at most 4 patches; T = 5 -> L = 2, 3 patches
    spans = [(0, 3), (1, 0), (1, 16)]
    touched = torch.zeros(2, 24, dtype=torch.bool)
    for k, ((row, start), count) in enumerate(zip(spans, counts)):
        torch.testing.assert_close(merged[row, start:start + count], encoding.tokens[k, :count])
        touched[row, start:start + count] = True
    torch.testing.assert_close(merged[~touched], h[~touched])


def test_backbone_loss_trains_the_encoder():
    """Intern-S2 end to end: merged embeddings through the layers and head; the text loss's
    gradient reaches the CNN embedder and the Q-Former."""
    model = _model("intern_s2").train()
    encoder = TimeSeriesEncoder(TimeSeriesEncoderConfig(output_hidden=model.config.hidden_size, hidden=16, heads=2,
                                                        token_budget=8, queries_per_patch=2, temporal_layers=1))
    ids = torch.randint(0, 100, (1, 20))
    (h,) = model.embed(ids)
    merged, _ = merge_series_embeddings(h, [[SeriesPlacement(2, SeriesInput(torch.randn(2, 64), 10.0))]], encoder)
    ctx = model.make_context({"tokens": ids})
    loss = model.loss(model.head(*model.run_layers((merged,), ctx)), torch.roll(ids, -1, 1)).mean()
    loss.backward()
    assert torch.isfinite(loss)
    for name in ("embedder.conv_in.weight", "qformer.queries", "to_backbone.weight"):
        assert encoder.get_parameter(name).grad.abs().sum() > 0, name


def test_span_past_the_sequence_says_how_many_to_reserve():
    encoder = TimeSeriesEncoder(TimeSeriesEncoderConfig(output_hidden=8, hidden=8, heads=2, token_budget=8,
                                                        queries_per_patch=2, temporal_layers=1))
    with pytest.raises(ValueError, match=r"runs past its 10 positions; reserve .* = 8 positions"):
        merge_series_embeddings(torch.zeros(1, 10, 8), [[SeriesPlacement(5, SeriesInput(torch.randn(1, 50)))]], encoder)


def test_text_only_batch_is_untouched():
    h = torch.randn(2, 5, 8)
    merged, encoding = merge_series_embeddings(h, [None, []], encoder=None)
    assert merged is h and encoding is None
