"""Executing compiled artifacts: per-device executors and the distributed launcher."""
