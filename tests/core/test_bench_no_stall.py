"""`bench/bench_no_stall.py`'s breakdown of B's time to first token (issue 39 item 4), read from the plugin's lines
in a server log: the build process's build and hand-over (with the job's time in the pipe), the worker's wait for
its answer, the worker's load and GPU staging, each timed from B's arrival; lines of other adapters are not B's."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import pytest

from factories import load_bench


def _clock() -> tuple[float, Callable[[float], str]]:
    """B's arrival (a whole millisecond, as the log writes it) and the log's stamp of a time after it."""
    arrived = round(time.time(), 3)

    def stamp(after: float) -> str:  # the log's clock, to the millisecond (rounded: %f would truncate 0.62 to 0.619)
        ms = round((arrived + after) * 1000)
        return datetime.datetime.fromtimestamp(ms // 1000).strftime("%Y-%m-%d %H:%M:%S") + f",{ms % 1000:03d}"

    return arrived, stamp


def test_bs_phases_are_read_from_the_server_log_and_other_adapters_lines_are_not_bs() -> None:
    bench = load_bench("bench_no_stall")
    arrived, stamp = _clock()

    log = "\n".join([
        f"INFO {stamp(0.2)} [vllm_lora_ext.integration.build_child] built adapter 'A' in 0.40 s, handed over in "
        "0.02 s (1620 MiB; queued 0.00 s, spare used)",
        f"INFO {stamp(0.62)} [vllm_lora_ext.integration.build_child] built adapter 'B2d' in 0.55 s, handed over "
        "in 0.03 s (1620 MiB; in the pipe 0.02 s, queued 0.01 s, spare used)",
        f"(EngineCore pid=1) INFO {stamp(0.66)} [vllm_lora_ext.integration.build_process] adapter 'B2d': the build "
        "process answered 0.64 s after the job was sent (its pickling included); mapped in 0.002 s",
        f"(EngineCore pid=1) INFO {stamp(0.7)} [vllm_lora_ext.integration.loader] loaded adapter 'B2d' from /w/B2d: "
        "rank 16, 98 modules (48 MoE blocks: 2d), 1620.3 MiB read, 0.71 s (describing the model 0.01 s, building "
        "0.66 s (build process), wrapping 0.04 s)",
        f"(EngineCore pid=1) INFO {stamp(0.81)} [vllm_lora_ext.integration.staging] staged 1545 MiB on cuda:0 in "
        "0.102 s (allocation 0.001 s)",
    ])
    got = bench.b_phases(log, "B2d", arrived)
    assert got["build_process"] == {"done_after_arrival_s": 0.62, "build_s": 0.55, "hand_over_s": 0.03,
                                    "mib": 1620.0, "queued_s": 0.01, "in_pipe_s": 0.02}
    assert got["answer"] == {"done_after_arrival_s": 0.66, "after_send_s": 0.64, "mapped_s": 0.002}
    older = bench.b_phases(log.replace("in the pipe 0.02 s, ", ""), "B2d", arrived)  # a log from before the field
    assert older["build_process"]["queued_s"] == 0.01 and "in_pipe_s" not in older["build_process"]
    assert got["build"]["seconds"] == 0.71 and got["build"]["done_after_arrival_s"] == 0.7
    assert "building 0.66 s (build process)" in got["build"]["phases"]
    assert got["staging"] == {"done_after_arrival_s": 0.81, "mib": 1545.0, "seconds": 0.102}
    assert bench.b_phases(log, "B3d", arrived) == {}


def test_the_engine_side_phases_after_staging_are_read_in_the_formats_the_plugin_logs() -> None:
    """The server's last probe, the engine taking the model, its registration and slot copy, and the load route's
    answer; the formats are checked against the plugin's own logging calls, so the bench does not drift from them."""
    from pathlib import Path

    bench = load_bench("bench_no_stall")
    arrived, stamp = _clock()

    log = "\n".join([
        f"(EngineCore pid=1) INFO {stamp(0.55)} [vllm_lora_ext.integration.prebuild] adapter 'B2d': merged ahead in "
        "0.0041 s",
        f"(EngineCore pid=1) INFO {stamp(0.58)} [vllm_lora_ext.integration.activation] adapter 'B2d': 1440 slot "
        "writes planned in 0.0210 s (0 modules left to vLLM)",
        f"(APIServer pid=2) INFO {stamp(0.61)} [vllm_lora_ext.integration.server] adapter 'B2d': built in the "
        "background, answered 0.602 s after the first probe (31 probes)",
        f"(EngineCore pid=1) INFO {stamp(0.63)} [vllm_lora_ext.integration.prebuild] adapter 'B2d' (id 2): built in "
        "the background, taken by the engine",
        f"(EngineCore pid=1) INFO {stamp(0.64)} [vllm_lora_ext.integration.worker_patches] adapter 'B2d' (id 2): "
        "registered and copied into its slot in 0.0123 s, unstaged in 0.0010 s (0 bytes copied back)",
        f"(APIServer pid=2) INFO {stamp(0.66)} [vllm_lora_ext.integration.server_patches] adapter 'B2d': registered "
        "by the engine 0.051 s after its build was answered",
        f"(APIServer pid=2) INFO {stamp(0.9)} [vllm_lora_ext.integration.server] adapter 'B3d': built in the "
        "background, answered 0.2 s after the first probe (3 probes)",
    ])
    got = bench.b_phases(log, "B2d", arrived)
    assert got["probed"] == {"done_after_arrival_s": 0.61, "after_first_probe_s": 0.602, "probes": 31}
    assert got["taken"] == {"done_after_arrival_s": 0.63}
    assert got["merged"] == {"done_after_arrival_s": 0.55, "merge_s": 0.0041}
    assert got["planned"] == {"done_after_arrival_s": 0.58, "slot_writes": 1440, "plan_s": 0.021}
    assert got["slot_copy"] == {"done_after_arrival_s": 0.64, "register_s": 0.0123, "unstage_s": 0.001,
                                "copied_back_bytes": 0}
    assert got["registered"] == {"done_after_arrival_s": 0.66, "after_build_answer_s": 0.051}
    src = Path(__file__).resolve().parents[2] / "src" / "vllm_lora_ext" / "integration"
    texts = {name: (src / name).read_text() for name in ("server.py", "worker_patches.py", "server_patches.py",
                                                           "prebuild.py", "activation.py")}
    assert "built in the background, answered %.3f s after the first probe (%d probes)" in texts["server.py"]
    assert "registered and copied into its slot in %.4f s, unstaged in %.4f s" in texts["worker_patches.py"]
    assert '"(%d bytes copied back)"' in texts["worker_patches.py"]
    assert "registered by the engine %.3f s after its build was answered" in texts["server_patches.py"]
    assert "built in the background, taken by the engine" in texts["prebuild.py"]
    assert "%d slot writes planned in %.4f s" in texts["activation.py"]
    assert "adapter %r: merged ahead in %.4f s" in texts["prebuild.py"]


def test_reps_give_each_mode_and_case_a_median_and_a_single_run_none() -> None:
    bench = load_bench("bench_no_stall")
    row = {"max_gap_s": 0.05, "b_ttft_s": 0.7, "throughput_ratio": 0.9}
    summary = {"plugin/2d": row, "plugin/2d#1": {**row, "b_ttft_s": 0.6}, "plugin/2d#2": {**row, "b_ttft_s": 0.9},
               "plugin/3d": row, "stock/2d": row, "b2d_output_equals_stock": True}
    bench._medians(summary, ["2d", "3d"], 3)
    assert summary["plugin/2d/median"] == {"max_gap_s": 0.05, "b_ttft_s": 0.7, "throughput_ratio": 0.9, "reps": 3}
    assert "plugin/3d/median" not in summary and "stock/2d/median" not in summary  # one run: no median
    once = {"plugin/2d": row}
    bench._medians(once, ["2d"], 1)
    assert once == {"plugin/2d": row}


def test_this_version_is_set_against_the_earlier_one_by_medians_where_both_ran() -> None:
    bench = load_bench("bench_no_stall")
    new = {"max_gap_s": 0.03, "b_ttft_s": 0.6, "throughput_ratio": 0.95}
    old = {"max_gap_s": 0.04, "b_ttft_s": 0.8, "throughput_ratio": 0.95}
    summary = {"plugin/2d": {**new, "b_ttft_s": 9.0}, "plugin/2d/median": {**new, "reps": 3},  # the median, not rep 1
               "plugin_old/2d": old, "plugin/3d": new}  # 3D: no earlier version ran
    bench._against_old(summary, ["2d", "3d"])
    got = summary["plugin_vs_old/2d"]
    assert got["plugin"] == new and got["plugin_old"] == old
    assert got["ratio"] == pytest.approx({"max_gap_s": 0.75, "b_ttft_s": 0.75, "throughput_ratio": 1.0})
    assert "plugin_vs_old/3d" not in summary
