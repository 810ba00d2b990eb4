"""The two CRDs as pure builder functions, generated from the ModelPool schema's own constants so
the YAML under charts/ cannot drift from `kvbank.modelpool`."""
