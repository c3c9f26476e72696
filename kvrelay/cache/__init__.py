"""Paged caches: the refcounted block pool, page arithmetic, and the cache tensors (pools)."""
