"""What crosses each process boundary, named in one place.

- ``api_engine``: the server's API process and the engine's own process (``engine_process``):
  requests and aborts one way, each step's deltas, the plan and the limits the other, over a
  socket pair;
- ``driver_ranks``: the driver of a split model and its other ranks (``engine.ranks`` starts or
  joins them, ``engine.rank_worker`` is a worker's loop): the setup every rank shares and the
  requests in place of a step; the steps themselves go over ``distributed.group``.

Only data lives here: the code on each side imports it, so neither side imports the other.
"""
