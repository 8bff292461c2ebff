"""Several models behind one server, under one byte budget (``pagedllm serve --model NAME=PATH
--model NAME=PATH --memory 8GiB``).

The front (``app.py``) is a thin API process: it reads each request's ``model``, asks the
``Fleet`` (``fleet.py``) to make that model resident, and passes the request to the model's own
``pagedllm serve`` (its API process and engine process, on a loopback port), streaming the answer
back. Every API, its errors and its metrics are then the single-model server's own, unchanged.

The fleet keeps one promise: the front's own memory plus every resident model's ``--memory``
stays within the budget. Each model is planned before anything loads (``planning.py``: the
planner's numbers, from ``pagedllm plan``); one that cannot fit even alone is refused at start
with the planner's reason. A request for a model that is not resident makes room: the other
resident models are shrunk to what they need (their elastic memory, ``POST /v1/memory``), then
the least recently used idle one is unloaded (its requests finish first); a pinned model is never
unloaded.
"""
