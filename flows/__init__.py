"""Prefect flows. A flow run without PREFECT_API_URL starts a temporary (ephemeral) Prefect server in a
subprocess, which inherits this environment: its telemetry is turned off with Prefect's documented setting,
so an offline machine logs no `Failed to send telemetry` error. A user's own server is not affected."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
