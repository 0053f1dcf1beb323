"""pdserve kv_transfer."""
