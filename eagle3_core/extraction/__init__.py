"""Phase 3, hidden-state extraction (`extract_hidden_states`, in `phase.py`).

The phase function is resolved lazily (PEP 562) so that the pure-torch modules of this package (storage,
hf_backend) import where pydantic is absent, as on the GPU benchmark host.
"""

from __future__ import annotations

from typing import Any

__all__ = ["extract_hidden_states"]


def __getattr__(name: str) -> Any:
    if name == "extract_hidden_states":
        from eagle3_core.extraction.phase import extract_hidden_states

        return extract_hidden_states
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
