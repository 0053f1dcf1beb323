"""pdserve engine."""
