"""Pipeline parallelism for a backbone whose layers share attention state (report §3.1.2):
payload extensions (:mod:`.payload`), shadow replicas (:mod:`.shadows`), point-to-point
transport (:mod:`.p2p`), 1F1B / interleaved 1F1B schedules (:mod:`.schedules`), and the
per-rank runtime that ties them to the model (:mod:`.stage`)."""
