"""The training loop: recipes -> model, optimiser, data -> forward/backward steps -> metrics
and checkpoints. ``megatron-s2 train`` is :mod:`megatron_s2.cli.train`."""
