"""The platform's services; each runs as `python -m services.<name>`."""
