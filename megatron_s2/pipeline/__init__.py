"""Pipeline parallelism, generic over model families: the forward/backward schedules of one
optimiser step (no pipelining, 1F1B, interleaved 1F1B: :mod:`.schedules`), what they take and
return (:mod:`.step`, layout-independent loss normalisation: :mod:`.losses`) and this rank's
stages at run time (:mod:`.runtime`). What crosses a cut beyond the hidden state is the family's
(``ModelFamily.stage_payloads``; the V4.1 backbone's CSA2 payload extensions and shadow replicas,
report §3.1.2, live in ``megatron_s2/models/v41/pipeline/``); the transport is
:mod:`megatron_s2.parallel.p2p`."""
