"""`python -m cli`: the `eagle3` command."""

from cli.main import app

app(prog_name="eagle3")
