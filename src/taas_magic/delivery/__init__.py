"""Distributed data delivery: registered DataLoaders served to the ranks by CPU prefetch workers.

    plan.py       which element of the stream goes to which rank, in which order (pure)
    transport.py  one element across processes: a memory file per element, its descriptor on a socket
    producer.py   a producer process: fetches its share of each pass with the loader's own parts
    standin.py    what a rank iterates instead of the registered loader
    service.py    the producers' side of a run: channels, shared counters, progress
    counters.py   counters in shared memory: flow control and the progress line
    cluster.py    across a cluster's nodes: producers on CPU nodes, their elements relayed to the ranks

The kernel decides which loaders a cell uses (``kernel/running/delivery_planning.py``); everything here runs in
the run's supervisor, its producers and its ranks.
"""
