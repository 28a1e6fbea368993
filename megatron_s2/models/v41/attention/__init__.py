"""CSA2 attention (report §2.3): compressor, indexer, hierarchical candidates, the layer."""
