"""Qwen2-MoE: Qwen2's attention, routed experts beside a gated shared one."""
