"""Anthropic's Messages API: its request into the internal one, the events into Anthropic's."""
