"""The KV cache's bookkeeping: integer page ids (`pages`), the prefix index over them (`prefix`),
and the cache that joins the two for the scheduler (`cache`). Pure Python, no tensors."""
