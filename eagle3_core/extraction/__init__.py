"""Phase 3, hidden-state extraction (`extract_hidden_states`, in `phase`): the backends (`hf_backend`,
`vllm_backend` and its `connector`). The states' format, shards and reader are `eagle3_core.hidden_states`.

Like every phase package, this one imports nothing: callers import the entry point from `phase`, so the
pure-torch module hf_backend imports where pydantic is absent, as on the GPU benchmark host."""
