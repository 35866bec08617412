"""What the target is (`reference`: embedded | folder | Hub id, and its config.json without a weight), phase 0
that prepares it (`prepare`, `hub`), its identity by content (`digest`), and what other phases read of it
(`models`: layer ids, tensors read through the safetensors index)."""
