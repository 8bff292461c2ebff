"""`pagedllm bench`: offline throughput of pagedllm and, in the same invocation, of the engines a
user would pick instead, on the same workload and machine.

Each engine runs in its own subprocess (so peak RSS is its own) and reports JSON; this module
builds the workload, runs them, and prints the table with ratios.
"""
