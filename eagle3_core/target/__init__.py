"""Phase 0, prepare the target (`prepare`), and what other phases read of it (`models`: layer ids, tensors
read through the safetensors index)."""
