"""Leto: in-place recovery of distributed training from retained, protected state."""
