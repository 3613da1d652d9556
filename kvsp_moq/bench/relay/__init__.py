"""``kvsp bench relay``: publisher -> relay -> 1/4/8 subscribers vs direct, and FETCH from a
warm vs a cold cache. :mod:`.driver` runs the figures; :mod:`.subscriber` is a subscriber in
its own process (``python -m kvsp_moq.bench.relay.subscriber``, ``--subscriber-processes``).
"""
