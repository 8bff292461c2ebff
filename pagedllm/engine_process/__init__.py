"""Where the engine runs for a server: on a thread of the caller's process (``engine_thread``), or
in a process of its own (``client`` starts ``child``; ``messages`` is what crosses between them).

Both hand the server the same surface: add / abort / abort_all, outputs left in a sink per
request, the engine's statistics, its failure. This package's ``__init__``, ``messages`` and
``client`` import no torch: the API process of ``pagedllm serve`` holds only the tokenizer.
"""
