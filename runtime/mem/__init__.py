"""Memory: request pool rows, KV slot allocator, KV pool, prefix caches."""
