"""The host's memory as sacpass shares it: the container's limit (cgroup v1 and v2, from fake files), the
launcher's local ranks, the node budget and each rank's share, the pool's refusal naming the rank, and several
ranks of one host (gloo, through torchrun) whose pools together stay within the node budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sacpass
from sacpass.errors import SacpassError
from sacpass.host import HOST_SHARE, cgroup_limit, host_budget, local_ranks
from sacpass.offload.pool import HostMemory

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_least_limit_from_the_process_s_cgroup_up(tmp_path):
    write(tmp_path / "self", "0::/kubepods/pod1/ctr\n")
    write(tmp_path / "memory.max", "max\n")
    write(tmp_path / "kubepods" / "memory.max", str(64 * MIB))
    write(tmp_path / "kubepods" / "pod1" / "memory.max", str(48 * MIB))
    write(tmp_path / "kubepods" / "pod1" / "ctr" / "memory.max", "max\n")
    assert cgroup_limit(str(tmp_path), str(tmp_path / "self")) == 48 * MIB


def test_cgroup_v2_at_the_root_and_no_limit(tmp_path):
    write(tmp_path / "self", "0::/\n")
    write(tmp_path / "memory.max", str(32 * MIB))
    assert cgroup_limit(str(tmp_path), str(tmp_path / "self")) == 32 * MIB
    write(tmp_path / "memory.max", "max\n")
    assert cgroup_limit(str(tmp_path), str(tmp_path / "self")) is None


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    write(tmp_path / "self", "12:memory:/docker/abc\n")  # no v2 line: a v1 host
    write(tmp_path / "memory" / "memory.limit_in_bytes", str(24 * MIB))
    assert cgroup_limit(str(tmp_path), str(tmp_path / "self")) == 24 * MIB
    write(tmp_path / "memory" / "memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_limit(str(tmp_path), str(tmp_path / "self")) is None


def test_no_cgroup_files_no_limit(tmp_path):
    assert cgroup_limit(str(tmp_path / "none"), str(tmp_path / "none" / "self")) is None


@pytest.mark.parametrize("environ,expected", [
    ({}, (1, 0, "one process (no launcher variable)")),
    ({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3"}, (8, 3, "LOCAL_WORLD_SIZE")),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (4, 1, "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ({"SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_LOCALID": "7"}, (8, 7, "SLURM_NTASKS_PER_NODE")),
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}, (2, 0, "LOCAL_WORLD_SIZE")),  # torchrun's first
])
def test_local_ranks_as_the_launcher_says(environ, expected):
    assert local_ranks(environ) == expected


@pytest.mark.parametrize("bad", ["0", "-2", "eight"])
def test_a_launcher_count_that_is_no_count_is_refused_naming_the_variable(bad):
    with pytest.raises(SacpassError, match=rf"LOCAL_WORLD_SIZE={bad!r} is not a valid count.*Fix the launcher"):
        local_ranks({"LOCAL_WORLD_SIZE": bad})


def test_the_rank_budget_is_the_node_budget_over_the_local_ranks(tmp_path):
    write(tmp_path / "self", "0::/\n")
    write(tmp_path / "memory.max", str(100 * MIB))
    write(tmp_path / "meminfo", f"MemTotal: 999999999 kB\nMemAvailable: {80 * 1024} kB\n")
    b = host_budget({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2"}, cgroup_root=str(tmp_path),
                    proc_cgroup=str(tmp_path / "self"), meminfo=str(tmp_path / "meminfo"))
    assert b.cgroup == 100 * MIB and b.available == 80 * MIB and b.node_memory == 80 * MIB  # the least
    assert b.node_bytes == int(HOST_SHARE * 80 * MIB) and b.rank_bytes == b.node_bytes // 4
    assert (b.local_ranks, b.local_rank) == (4, 2)
    assert "local rank 2 of 4 (LOCAL_WORLD_SIZE)" in b.describe() and "cgroup limit" in b.describe()


def test_a_pool_past_its_rank_s_share_names_the_rank_the_budget_and_the_fix(tmp_path):
    write(tmp_path / "self", "0::/\n")
    write(tmp_path / "memory.max", str(40 * MIB))
    b = host_budget({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, cgroup_root=str(tmp_path),
                    proc_cgroup=str(tmp_path / "self"))
    memory = HostMemory(b)
    assert memory.limit == b.rank_bytes == 8 * MIB
    blocks = [memory.allocate(MIB, pinned=False) for _ in range(8)]
    with pytest.raises(sacpass.OffloadError) as err:
        memory.allocate(MIB, pinned=False)
    text = str(err.value)
    assert f"local rank 3's share of this host, {8 * MIB} bytes" in text and "local rank 3 of 4" in text, text
    assert "Offload less" in text and "set_host_limit" in text
    assert memory.held <= b.rank_bytes and len(blocks) == 8


def test_a_freed_block_is_handed_out_again_once_its_copies_finish_asked_only_when_the_room_is_needed(tmp_path):
    """Blocks freed with copies in flight wait; releasing them asks nothing of the copies (a step frees hundreds);
    an allocation that fits elsewhere asks nothing either; one that needs their room asks each once, takes the
    finished ones and waits only where none has."""
    class Copy:  # a copy's completion: done or not, counting the questions
        asked = 0

        def __init__(self, done):
            self.done = done

        def query(self):
            Copy.asked += 1
            return self.done

        def synchronize(self):
            self.done = True

    write(tmp_path / "self", "0::/\n")
    write(tmp_path / "memory.max", str(64 * MIB))
    memory = HostMemory(host_budget({}, cgroup_root=str(tmp_path), proc_cgroup=str(tmp_path / "self")),
                        available=lambda: 1 << 40)
    memory.limit = 4 * MIB  # one slab of 4 MiB (plain memory: the pinned kind's logic on a machine without a GPU)
    pool = memory.kinds[False]
    blocks = [memory.allocate(MIB, pinned=False) for _ in range(3)]
    copies = [Copy(done=False), Copy(done=True), Copy(done=False)]
    for block, copy in zip(blocks, copies):
        block.events["d2h"] = copy
        memory.release(block, pinned=False)
    assert Copy.asked == 0 and len(pool.pending) == 3
    memory.allocate(MIB, pinned=False)  # the slab's fourth MiB: the freed blocks are not asked
    assert Copy.asked == 0
    again = memory.allocate(MIB, pinned=False)  # needs a freed block's room: the finished copy's block
    assert Copy.asked == 3 and again.offset == blocks[1].offset and not any(c.done for c in copies[::2])
    memory.allocate(MIB, pinned=False)  # none left finished: the pool waits for the unfinished copies
    assert all(c.done for c in copies) and memory.held == 4 * MIB and not pool.pending
    memory.release(again, pinned=False)  # no copy touched it (its events were never set): free at once
    assert not pool.pending and pool.in_use == 2 * MIB


@pytest.mark.distributed
@pytest.mark.slow  # three processes; the rank's share and its refusal are the quick tests above
def test_ranks_of_one_host_hold_no_more_than_the_node_budget_together(tmp_path):
    """Three ranks (torchrun, gloo) under a fake 64 MiB container: each rank's pool defaults to a third of the
    node budget and its model plan to 90% of that; two ranks offload what fits, the third more than its share
    and is refused naming its rank; what the pools hold together stays within the node budget."""
    write(tmp_path / "self-cgroup", "0::/\n")
    write(tmp_path / "memory.max", str(64 * MIB))
    out = tmp_path / "ranks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(ROOT / "tests" / "support" / "host_ranks.py"), "--cgroup", str(tmp_path), "--extra-mib", "10",
           "--last-extra-mib", "30", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    node = ranks[0]["node_bytes"]
    assert node == int(HOST_SHARE * 64 * MIB)
    assert [r["local_rank"] for r in ranks] == [0, 1, 2] and all(r["local_ranks"] == 3 for r in ranks)
    for r in ranks:
        assert r["limit"] == node // 3 and r["plan_host_bytes"] == int(0.9 * r["limit"]), r
        assert r["peak_held"] <= r["limit"], r
    assert sum(r["peak_held"] for r in ranks) <= node
    assert [r["error"] is None for r in ranks] == [True, True, False] and ranks[0]["offloaded"] == 10
    assert "local rank 2's share of this host" in ranks[2]["error"] and "local rank 2 of 3 (LOCAL_WORLD_SIZE)" in \
        ranks[2]["error"], ranks[2]["error"]
