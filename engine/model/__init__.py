"""A Llama-family decoder on the paged KV cache: config, weights, attention backends, sampling."""
