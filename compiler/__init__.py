"""The driver: the ordered pipeline, artifact packaging, reports, the CLI and the Python API."""
