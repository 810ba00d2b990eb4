"""Benchmarks: the `kvbank bench` command (`cli`), scenario files (`scenario`), their workloads
(`workload`), the virtual-clock runner (`virtual`), the policy run loop (`simulate`) and the
model-throughput probe (`throughput`)."""
