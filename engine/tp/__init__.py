"""Tensor parallelism: ranks launched in one process tree (`launch`), one rank per pod from the
operator's environment (`pod`), and the per-step plan every rank replays (`sync`)."""
