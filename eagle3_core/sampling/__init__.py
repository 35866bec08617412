"""Phase 1, serve and sample: the client and the phase (`phase`), the resumable store of Parquet parts
(`store`) and its table (`table`), prompt sources (`prompts`), the chat template's tokens (`chat_tokens`),
and whether extraction reuses sampling's server (`reuse_decision`)."""
