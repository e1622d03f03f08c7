"""leto-run: the torchrun-compatible launcher (CLI, per-node agent, dashboard)."""
