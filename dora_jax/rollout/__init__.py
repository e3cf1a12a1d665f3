"""Rollout: instances, version window, orchestrator, trajectory queue, paradigms, ledger."""
