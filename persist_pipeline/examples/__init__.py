"""Runnable examples (``make run``)."""
