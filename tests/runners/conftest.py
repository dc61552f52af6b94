"""One real local multi-node Ray cluster for every test of the Ray runner (started once, ~10 s,
and stopped after the last test of tests/runners/, so that the rest of the suite runs without it).

A head node with no GPU (the test process is its driver, and Ray cannot remove the node its
driver is on) and two worker nodes with one fake GPU each: a one-slot trial lands on either worker,
a two-slot trial is spread over both, and a test may remove a worker (``ray_cluster.replace``
brings a new one). Trials run on the CPU (DS_ACCELERATOR=cpu is passed on to them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

OBJECT_STORE_BYTES = 80 * 2**20
WORKER_NODE = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": OBJECT_STORE_BYTES}


@dataclasses.dataclass
class RayTestCluster:
    cluster: Any

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def worker(self, node_id: str) -> Any:
        """The cluster's worker node with this Ray node id."""
        return next(n for n in self.cluster.worker_nodes if n.node_id == node_id)

    def remove(self, node_id: str, graceful: bool = True) -> None:
        """Take the node out: as when it shuts down, or (not ``graceful``) as when it dies, its
        processes killed, and Ray learns of it only by the health checks it misses."""
        self.cluster.remove_node(self.worker(node_id), allow_graceful=graceful)

    def restore(self) -> None:
        """Back to two live worker nodes, after a test removed one."""
        while len(self.cluster.worker_nodes) < 2:
            self.cluster.add_node(**WORKER_NODE)
        self.cluster.wait_for_nodes()


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[RayTestCluster]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 0,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    for _ in range(2):
        cluster.add_node(**WORKER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        yield RayTestCluster(cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
