"""A real Redis Cluster for the tests: 3 primaries and 3 replicas of Debian's redis-server
(``/usr/bin/redis-server`` and its ``redis-cli``, .ci/system-packages.txt), started once per
session (per xdist worker) by :class:`~kvsp_moq.bench.redis_cluster.RedisClusterProcess` and
shared by every cluster test. A test that kills a primary leaves the cluster to
``healthy_cluster``, which starts the killed nodes again (they rejoin as replicas) and waits,
bounded, until every slot is served and every replica linked, before the next test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_support import REDIS_SERVER
from system_programs import require

from kvsp_moq.bench.redis_cluster import RedisClusterProcess


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    require(REDIS_SERVER)
    cluster = RedisClusterProcess(tmp_path_factory.mktemp("redis-cluster"), executable=REDIS_SERVER)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def healthy_cluster(redis_cluster: RedisClusterProcess) -> Iterator[RedisClusterProcess]:
    """The session's cluster, whole again after whatever the previous test killed; each test
    gets its own key prefix (``prefix``) so tests never read each other's keys."""
    heal(redis_cluster)
    yield redis_cluster
    heal(redis_cluster)


def heal(cluster: RedisClusterProcess) -> None:
    dead = [n for n in cluster.nodes if not n.running]
    for node in dead:
        node.start()
    if dead:
        cluster.wait_healthy()
