"""The agent gateway (Intern-S2 walkthrough, Ch. 6 "Harness x Task"): black-box harnesses talk
to the server in their own protocol while it silently captures training evidence.

* Protocols — OpenAI Chat Completions with tools, OpenAI Responses (``/v1/responses``) and
  Anthropic Messages (``/v1/messages``), streaming and not; text, reasoning and tool calls
  relayed in each protocol's native form (``chat_protocol``, ``responses_protocol``,
  ``messages_protocol``), all rendered through the tokenizer's chat template the same way
  (``conversation``) and parsed from the sampled token ids the same way (``tool_format``).
* Sessions — ``/sessions/<id>/v1/...`` tracks a harness that only knows a base URL (``routes``).
* TITO — token-in / token-out capture per session: exact input and output ids, log-probs and
  routed experts (R3); the stable history is never re-tokenised (``tito``).
* PrefixTree trace store — ``traces`` (on disk, no pickle; ``read_samples`` for post-training).

``megatron-s2 serve --gateway-traces DIR`` turns capture on.
"""
