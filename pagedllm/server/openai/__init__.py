"""OpenAI's APIs: each turns its request into the internal one (``generation.Job``) and the
events or the whole result back into its own JSON."""
