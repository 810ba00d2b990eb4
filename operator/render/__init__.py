"""Pure builders: a parsed ModelPool (and settings) in, Kubernetes manifests (dicts) out. No I/O,
so each one is tested on its own and every apply of the same inputs is byte-identical."""
