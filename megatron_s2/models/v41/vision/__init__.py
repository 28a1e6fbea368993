"""The V4.1 multimodal input pathway (report §2.1.1), in the public reference's layout.

* :mod:`.processor` — resize planning to the patch / downsample grid, pixels -> patches, image
  spans and token types, ``prepare_vl_inputs`` (pure Python planning; torch / Pillow on use).
* :mod:`.rope2d` — the tower's 2D rotary embedding.
* :mod:`.tower` — DeepSeek-ViT, the aligner (3x3 pixel-unshuffle + MLP projector), the
  image-span delimiter embeddings (``V41Model.vision``) and the merge into the token embeddings.

Configured by the ``vision_*`` fields of :class:`~megatron_s2.models.v41.config.V41Config`
(``vision_n_layers: 0`` = text only); counted by ``megatron-s2 account``; converted with the
release's ``vision.*`` / ``aligner.*`` / ``image_*`` names.
"""
