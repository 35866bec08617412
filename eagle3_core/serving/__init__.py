"""Engines: the vLLM server's lifecycle (`engine`), its processes (`processes`), and one server shared by
phases (`shared`). Knows no phase."""
