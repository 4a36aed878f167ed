"""`bench/bench_residency.py --reference`: modes run in separate calls compare their outputs with an earlier
``single`` run of the same workload, and refuse one of another workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factories import load_bench



def _bench() -> Any:
    return load_bench("bench_residency")


def test_a_reference_run_gives_its_single_outputs_only_for_the_same_workload(tmp_path: Path) -> None:
    br = _bench()
    names, mixes = br.make_ids(3, 2)
    assert br.zipf_requests(names + mixes, 20, 1.1) == br.zipf_requests(names + mixes, 20, 1.1)  # seeded
    workload = {"replicas": 2, "adapters": 3, "mixes": 2, "requests": 20}
    earlier = tmp_path / "single.json"
    earlier.write_text(json.dumps({"workload": workload, "runs": {"single": {"outputs": ["a", "b"],
                                                                             "adapter_builds_total": 35}}}))
    assert br.reference_run(str(earlier), workload) == {"outputs": ["a", "b"], "adapter_builds_total": 35}
    with pytest.raises(SystemExit, match="is not this run's"):
        br.reference_run(str(earlier), {**workload, "requests": 400})
    earlier.write_text(json.dumps({"workload": workload, "runs": {"affinity": {}}}))
    with pytest.raises(SystemExit, match="no 'single' run"):
        br.reference_run(str(earlier), workload)


def test_node_caches_lists_the_commits_each_nodes_own_cache_holds(tmp_path: Path) -> None:
    """The two-node run gives each node its own Hugging Face cache; what each resolved is read back per node."""
    br = _bench()
    for node, commits in (("node0", ["c0ffee"]), ("node1", ["c0ffee", "0ld"])):
        for commit in commits:
            (tmp_path / f"hf-cache-{node}" / "models--acme--residency" / "snapshots" / commit).mkdir(parents=True)
    assert br.node_caches(tmp_path) == {"node0": ["c0ffee"], "node1": ["0ld", "c0ffee"]}
    assert br.node_caches(tmp_path / "none") == {"node0": [], "node1": []}
