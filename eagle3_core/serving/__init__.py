"""Engines: the vLLM server's lifecycle (`engine`), its processes (`processes`), one server shared by
phases (`shared`), children that die with their parent (`parent_death`) and the on-disk record of who holds
a slot of a concurrency limit (`holders`). Knows no phase."""
