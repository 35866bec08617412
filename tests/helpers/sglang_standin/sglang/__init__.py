"""A test-only stand-in for SGLang (put `tests/helpers/sglang_standin` on PYTHONPATH): `launch_server`."""
