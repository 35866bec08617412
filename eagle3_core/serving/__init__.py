"""Engines: the vLLM server's lifecycle (`engine`), its processes (`processes`), one server shared by
phases (`shared`) and children that die with their parent (`parent_death`). Knows no phase."""
