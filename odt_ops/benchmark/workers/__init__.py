"""Peer workers, run by path in a fresh process each (see harness.py)."""
