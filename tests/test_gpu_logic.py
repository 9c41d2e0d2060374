"""The GPU rules that need no GPU: the restore mapping, every refusal of a move, and the API's answers on a
machine without GPUs. The GPUs here are records of the kind NVML gives; nothing stands in for the driver."""

from __future__ import annotations

import os

import pytest
from helpers import api

from jupyter_gpumigrate.engine import cudackpt, placement
from jupyter_gpumigrate.engine.errors import CudaUnavailable, GpuError
from jupyter_gpumigrate.engine.gpus import GpuInfo

GIB = 1024**3
UUIDS = [f"GPU-{i}0000000-0000-0000-0000-00000000000{i}" for i in range(4)]


def gpu(index: int, used: int = 1 * GIB, total: int = 80 * GIB, name: str = "NVIDIA H200", mig: bool = False,
        processes: dict[int, int] | None = None) -> GpuInfo:
    return GpuInfo(index=index, uuid=UUIDS[index], name=name, memory_total=total, memory_used=used,
                   utilization=0, persistence_mode=True, mig_enabled=mig, processes=processes or {})


def held(index: int, used: int) -> list[dict]:
    return [{"index": index, "uuid": UUIDS[index], "memory_used": used}]


def test_mapping_swaps_source_and_target_and_names_every_gpu():
    mapping = cudackpt.gpu_mapping(UUIDS, UUIDS[0], UUIDS[2])
    bare = [u[4:] for u in UUIDS]
    assert mapping == {bare[0]: bare[2], bare[2]: bare[0], bare[1]: bare[1], bare[3]: bare[3]}
    assert sorted(mapping.values()) == sorted(bare), "each GPU is a destination exactly once"
    with pytest.raises(ValueError, match="not among"):
        cudackpt.gpu_mapping(UUIDS[:2], UUIDS[0], UUIDS[3])


def test_a_move_is_planned_between_two_gpus_of_the_same_model():
    move = placement.plan_move([gpu(0, used=9 * GIB), gpu(1)], held(0, 8 * GIB), 1, 580)
    assert (move.source.index, move.target.index, move.needed) == (0, 1, 8 * GIB)


@pytest.mark.parametrize(
    ("gpus", "kernel_holds", "to_gpu", "driver", "words"),
    [
        ([], [], 0, None, "no NVIDIA GPU"),
        ([gpu(0), gpu(1)], held(0, GIB), 2, 580, "GPU 2 does not exist: this machine has GPUs 0 to 1"),
        ([gpu(0), gpu(1)], [], 1, 580, "holds no GPU memory"),
        ([gpu(0), gpu(1)], held(0, GIB) + held(1, GIB), 1, 580, "GPUs 0 and 1; only a kernel on a single GPU"),
        ([gpu(0), gpu(1)], held(1, GIB), 1, 580, "already on GPU 1"),
        ([gpu(0), gpu(1, name="NVIDIA H100")], held(0, GIB), 1, 580, "same model"),
        ([gpu(0), gpu(1, mig=True)], held(0, GIB), 1, 580, "MIG is enabled on GPU 1"),
        ([gpu(0, mig=True), gpu(1)], held(0, GIB), 1, 580, "MIG is enabled on GPU 0"),
        ([gpu(0), gpu(1)], held(0, GIB), 1, 570, "driver is 570; moving a kernel to another GPU needs driver 580"),
        ([gpu(0), gpu(1, used=79 * GIB)], held(0, 4 * GIB), 1, 580, "GPU 1 has 1.1 GB free and the kernel needs 4.3 GB"),
    ],
)
def test_every_refusal_says_what_to_do(gpus, kernel_holds, to_gpu, driver, words):
    with pytest.raises(GpuError) as info:
        placement.plan_move(gpus, kernel_holds, to_gpu, driver)
    assert words in str(info.value)
    assert info.value.http_status == 409


def test_resume_goes_back_where_it_was_else_to_the_emptiest_gpu_of_its_model():
    was = {"index": 0, "uuid": UUIDS[0], "name": "NVIDIA H200", "memory_used": 4 * GIB}
    gpus = [gpu(0), gpu(1, used=30 * GIB), gpu(2, used=10 * GIB), gpu(3, name="NVIDIA H100")]
    assert placement.plan_resume(gpus, was, None, 580).target.index == 0
    gpus[0] = gpu(0, used=78 * GIB)  # someone took GPU 0 meanwhile
    assert placement.plan_resume(gpus, was, None, 580).target.index == 2
    assert placement.plan_resume(gpus, was, 1, 580).target.index == 1
    with pytest.raises(GpuError, match="same model"):
        placement.plan_resume(gpus, was, 3, 580)
    with pytest.raises(GpuError, match="needs driver 580"):
        placement.plan_resume(gpus, was, 1, 570)


def test_without_cuda_core_or_a_driver_the_checkpoint_api_says_what_to_install():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver: the gpu suite exercises the checkpoint API itself")
    with pytest.raises(CudaUnavailable) as info:
        cudackpt.CudaProcess(os.getpid())
    assert "cuda-core" in str(info.value) or "nvidia-smi" in str(info.value)
    assert not cudackpt.is_cuda_process(os.getpid())


async def test_migrate_requests_without_a_gpu(jp_fetch, kernel, criu_binary):
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={}, expect=400)
    assert "needs to_gpu" in error["message"]
    for body in ({"to_gpu": "1"}, {"to_gpu": -2}, {"to_gpu": 1, "to_host": "b"}):
        await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body=body, expect=400)
    await api(jp_fetch, "kernels", "no-such-kernel", "migrate", method="POST", body={"to_gpu": 1}, expect=404)
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 1}, expect=409)
    if not os.path.exists("/dev/nvidiactl"):
        assert "no NVIDIA GPU" in error["message"]
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    assert (await kernel.run("print('still here')")).strip() == "still here"
    # A suspended kernel is not moved live: resume it first.
    assert (await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=202))
    from helpers import wait_operation

    ops = await api(jp_fetch, "operations")
    await wait_operation(jp_fetch, ops[-1])
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 0}, expect=409)
    assert "suspended, so it cannot be moved" in error["message"]


def test_the_kernel_list_offers_only_the_gpus_that_can_take_the_kernel():
    gpus = [gpu(0, used=9 * GIB), gpu(1), gpu(2, used=79 * GIB), gpu(3, name="NVIDIA H100")]
    running = placement.targets(gpus, held(0, 8 * GIB), [], "running", 580)
    assert [t["index"] for t in running if t["ok"]] == [1]
    why = {t["index"]: t["reason"] for t in running if not t["ok"]}
    assert "already on GPU 0" in why[0] and "free" in why[2] and "same model" in why[3]
    suspended_on = [{"index": 1, "uuid": UUIDS[1], "name": "NVIDIA H200", "memory_used": 8 * GIB}]
    resumable = placement.targets(gpus, [], suspended_on, "suspended", 580)
    assert [t["index"] for t in resumable if t["ok"]] == [0, 1], "back where it was, or another H200 with room"
    assert [t["index"] for t in placement.targets(gpus, held(0, GIB), [], "running", 570) if t["ok"]] == []
