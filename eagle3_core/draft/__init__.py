"""The EAGLE-3 draft model (`model`) and its export to the layout vLLM and SGLang load (`export`)."""
