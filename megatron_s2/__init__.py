"""megatron_s2: a Megatron-style parallelism library and launcher for S2-class models.

Model family 1 is the DeepSeek-V4.1-Flash-style Causal Encoder-Decoder MoE with CSA2
(``megatron_s2.models.v41``). See README.md for the map from report sections to modules.
"""

__version__ = "0.1.0"
