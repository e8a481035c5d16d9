"""Runnable demos of the advantage service (``advantage-demo``)."""
