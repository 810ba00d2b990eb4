"""Who may start: the policy interface (`policy`), what a policy reads (`view`) and returns
(`actions`), the registry by name (`registry`), the banker (`banker`), peak-fit (`peak`), the
baseline policies (`baselines`), the ledger backends, embedded or a sidecar's (`backend`), and
the one reader of a backend's decisions (`decisions`)."""
