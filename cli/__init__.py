"""The `eagle3` command line (`main`). Outside `eagle3_core`: its `run`, `regenerate` and `deploy` commands
reach Prefect."""
