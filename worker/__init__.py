"""pdserve worker runtime shared by the prefill and decode roles."""
