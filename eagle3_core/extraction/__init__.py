"""Phase 3, hidden-state extraction (`extract_hidden_states`, in `phase`): the backends (`hf_backend`,
`vllm_backend` and its `connector`), the shards (`storage`, `layout`) and their reader (`reader`).

Like every phase package, this one imports nothing: callers import the entry point from `phase`, so the
pure-torch modules (storage, hf_backend) import where pydantic is absent, as on the GPU benchmark host."""
