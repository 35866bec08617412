"""Phase 1, serve and sample (`sample_prompts`, in `phase`): the client and the phase (`phase`), the
resumable store of Parquet parts (`store`) and its table (`table`), prompt sources (`prompts`), the chat
template's tokens (`chat_tokens`), and whether extraction reuses sampling's server (`reuse_decision`).
Like every phase package, this one imports nothing: callers import from `phase`."""
