"""More than one node is Ray's job (issue 33, item 7), tested the only way one host allows: a Ray cluster of two
raylets on this machine (`ray.cluster_utils.Cluster`: a head node and a second node, each a raylet of its own
with one CPU), joined as a user joins a real cluster (`RAY_ADDRESS`). Two FSDP2 trainer ranks on Ray need two
bundles of one CPU, so they run on different raylets and train over gloo between them; the run ends with the
adapter of the same run in one process. This host has no GPUs, so the raylets are given none: a GPU placement
across real nodes is not tested here.
"""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # two raylets and a flow


@pytest.fixture
def two_raylets(monkeypatch):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # the run joins it as it joins a real cluster
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_two_trainer_ranks_on_two_raylets_train_as_one_process(two_raylets, tiny_model_dir, tmp_path):
    from flows.grpo_lora import train
    from lora_rl_core.store import AdapterStore
    from tests.integration.tiny_run import write_tiny_config

    path = write_tiny_config(tmp_path, tiny_model_dir, "two-nodes")
    train(config_path=str(path), run_id="it-one-process")
    ray.init(address=two_raylets.address, include_dashboard=False, log_to_driver=False)  # to look at the cluster
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2 and all(n["Resources"].get("CPU") == 1.0 for n in nodes)
    train(
        config_path=str(path),
        run_id="it-two-nodes",
        overrides=["trainer.backend=ray", "trainer.backend.world_size=2"],
    )
    groups = list(ray.util.placement_group_table().values())
    assert groups and all(g["state"] == "REMOVED" for g in groups)  # the ranks' placement group is gone
    used = {node for g in groups for node in g["bundles_to_node_id"].values()}  # kept after removal
    assert used == {n["NodeID"] for n in nodes}  # one rank per raylet: gloo ran between the two
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    one, _ = store.load_tensors("it-one-process", 2)
    two, _ = store.load_tensors("it-two-nodes", 2)
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=1e-4)
