"""DSpark: the V4.1 speculative-decoding drafter (report §2.4.3) — model, training objective
and engine state (:mod:`.drafter`)."""
