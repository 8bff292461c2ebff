"""Size limits the CPU kernels tile their work by, so their workspace never grows with the batch.

The kernels use them and the memory planner budgets by them: one place, torch-free.
"""

# Query rows x keys scored at once per KV head (2^18 pairs = 1 MiB of fp32 scores).
PAIRS_BUDGET = 1 << 18
# Key slots gathered at once for a group of decode rows (a longer single context is gathered whole).
GATHER_BUDGET = 8192
# Sampler rows processed at once on the full sampling path.
SAMPLER_CHUNK_ROWS = 8
