"""pdserve prefill_worker."""
