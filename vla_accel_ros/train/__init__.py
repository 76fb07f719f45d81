"""Behaviour cloning of bundles from recorded demonstrations (``vla-accel train``)."""
