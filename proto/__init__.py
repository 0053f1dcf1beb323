"""pdserve proto."""
