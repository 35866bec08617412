"""Phase 6, evaluation: acceptance of the exported draft on held-out prompts, measured with the real
target in transformers (`speculative`) and in vLLM (`vllm_measure`), reported in `eval/` (`report`)."""

from eagle3_core.evaluation.phase import evaluate_draft

__all__ = ["evaluate_draft"]
