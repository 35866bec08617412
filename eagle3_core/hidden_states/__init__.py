"""The hidden states as data, below both extraction (which writes them) and training (which reads them):
what a set of states is (`description`: layer ids, dtype, hidden size, last-state-normed), which target
layers they come from (`layers`), their shards and fp8 (`storage`), the dataset of packed sequences read
from the shards (`reader`) and the one fed by a live engine (`online`).

Like every phase package, this one imports nothing: callers import its modules, so the pure-torch ones
(storage) import where pydantic is absent, as on the GPU benchmark host."""
