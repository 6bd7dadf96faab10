"""Kopf reconcilers and the operator's in-memory state."""
