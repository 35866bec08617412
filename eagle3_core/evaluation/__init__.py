"""Phase 6, evaluation (`evaluate_draft`, in `phase`): acceptance of the exported draft on held-out prompts,
measured with the real target in transformers (`speculative`) and in vLLM (`vllm_measure`), reported in
`eval/` (`report`). Like every phase package, this one imports nothing: callers import from `phase`."""
