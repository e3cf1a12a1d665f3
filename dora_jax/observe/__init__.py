"""Observability: TensorBoard metrics, progress display, Chrome-trace timeline, summary plots."""
