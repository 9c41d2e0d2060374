"""The GPU rules that need no GPU: the restore mapping, every refusal of a move, and the API's answers on a
machine without GPUs. The GPUs here are records of the kind NVML gives; nothing stands in for the driver."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

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
    mapping = cudackpt.gpu_mapping(UUIDS, {UUIDS[0]: UUIDS[2]})
    bare = [u[4:] for u in UUIDS]
    assert mapping == {bare[0]: bare[2], bare[2]: bare[0], bare[1]: bare[1], bare[3]: bare[3]}
    assert sorted(mapping.values()) == sorted(bare), "each GPU is a destination exactly once"
    with pytest.raises(ValueError, match="not among"):
        cudackpt.gpu_mapping(UUIDS[:2], {UUIDS[0]: UUIDS[3]})


def test_mapping_of_a_kernel_on_several_gpus_is_a_permutation_of_every_gpu():
    bare = [u[4:] for u in UUIDS]
    swapped = cudackpt.gpu_mapping(UUIDS, {UUIDS[0]: UUIDS[1], UUIDS[1]: UUIDS[0]})
    assert swapped == {bare[0]: bare[1], bare[1]: bare[0], bare[2]: bare[2], bare[3]: bare[3]}
    # 0 and 1 onto 2 and 3: the GPUs they leave take the places 2 and 3 leave.
    away = cudackpt.gpu_mapping(UUIDS, {UUIDS[0]: UUIDS[2], UUIDS[1]: UUIDS[3]})
    assert away == {bare[0]: bare[2], bare[1]: bare[3], bare[2]: bare[0], bare[3]: bare[1]}
    # One stays, one moves.
    half = cudackpt.gpu_mapping(UUIDS, {UUIDS[0]: UUIDS[0], UUIDS[1]: UUIDS[3]})
    assert half == {bare[0]: bare[0], bare[1]: bare[3], bare[2]: bare[2], bare[3]: bare[1]}
    for mapping in (swapped, away, half):
        assert sorted(mapping.values()) == sorted(bare)
    with pytest.raises(ValueError, match="same GPU"):
        cudackpt.gpu_mapping(UUIDS, {UUIDS[0]: UUIDS[2], UUIDS[1]: UUIDS[2]})


def test_a_move_is_planned_between_two_gpus_of_the_same_model():
    move = placement.plan_move([gpu(0, used=9 * GIB), gpu(1)], held(0, 8 * GIB), 1, 580)
    assert (move.source.index, move.target.index, move.needed) == (0, 1, 8 * GIB)


@pytest.mark.parametrize(
    ("gpus", "kernel_holds", "to_gpu", "driver", "words"),
    [
        ([], [], 0, None, "no NVIDIA GPU"),
        ([gpu(0), gpu(1)], held(0, GIB), 2, 580, "GPU 2 does not exist: this machine has GPUs 0 to 1"),
        ([gpu(0), gpu(1)], [], 1, 580, "holds no GPU memory"),
        ([gpu(0), gpu(1)], held(0, GIB) + held(1, GIB), 1, 580,
         "The kernel holds GPUs 0 and 1: name a GPU for each, in that order (to_gpus [1, 0]; --to-gpu 1,0)"),
        ([gpu(0), gpu(1), gpu(2)], held(0, GIB) + held(1, GIB), [2], 580, "name a GPU for each"),
        ([gpu(0), gpu(1), gpu(2)], held(0, GIB) + held(1, GIB), [2, 1, 0], 580,
         "3 GPUs were named, but the kernel holds 2 (GPUs 0 and 1): name one GPU for each"),
        ([gpu(0), gpu(1), gpu(2)], held(0, GIB) + held(1, GIB), [2, 2], 580, "GPU 2 is named twice"),
        ([gpu(0), gpu(1)], held(0, GIB) + held(1, GIB), [0, 1], 580, "already on GPUs 0 and 1, in that order"),
        ([gpu(0), gpu(1)], held(0, GIB), [0, 1], 580, "2 GPUs were named, but the kernel holds 1 (GPU 0)"),
        ([gpu(0), gpu(1), gpu(2, used=79 * GIB)], held(0, GIB) + held(1, 2 * GIB), [1, 2], 580,
         "GPU 2 has 1.1 GB free and the kernel needs 2.1 GB"),
        ([gpu(0), gpu(1), gpu(2, name="NVIDIA H100")], held(0, GIB) + held(1, GIB), [2, 0], 580, "same model"),
        ([gpu(0), gpu(1)], held(0, GIB) + held(1, GIB), [1, 0], 570, "needs driver 580"),
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


def test_a_resume_goes_to_no_gpu_being_drained_unless_it_names_it():
    """While GPU 0 is drained (operations.py refuses a request that names it), a resume that would go back
    there goes to the roomiest other GPU of its model; with every such GPU drained, it is refused, saying so."""
    was = {"index": 0, "uuid": UUIDS[0], "name": "NVIDIA H200", "memory_used": 4 * GIB}
    gpus = [gpu(0), gpu(1, used=30 * GIB), gpu(2, used=10 * GIB), gpu(3, name="NVIDIA H100")]
    assert placement.plan_resume(gpus, was, None, 580, avoid={0}).target.index == 2
    assert placement.plan_resume(gpus, was, None, 580, avoid={0, 2}).target.index == 1
    with pytest.raises(GpuError, match=r"being drained \(GPU 0, 1, 2\).*Try again then; the kernel stays as it is"):
        placement.plan_resume(gpus, was, None, 580, avoid={0, 1, 2})
    two = [{"index": 1, "uuid": UUIDS[1], "name": "NVIDIA H200", "memory_used": 16 * GIB},
           {"index": 0, "uuid": UUIDS[0], "name": "NVIDIA H200", "memory_used": 16 * GIB}]
    assert placement.plan_resume(gpus, two, None, 580, avoid={1}).to_gpus == [0, 2]


def test_a_kernel_on_two_gpus_swaps_them_counting_what_it_frees_on_each():
    # 30 GB on each of two 80 GB GPUs, each 70 GB full: neither has room for the other's 30 GB until the
    # kernel's own leaves it; the driver checkpoints every GPU before it restores any.
    gpus = [gpu(0, used=70 * GIB), gpu(1, used=70 * GIB), gpu(2)]
    move = placement.plan_move(gpus, held(1, 30 * GIB) + held(0, 30 * GIB), [1, 0], 580)
    assert (move.from_gpus, move.to_gpus, move.needed, move.several) == ([0, 1], [1, 0], 60 * GIB, True)
    assert move.assignment() == {UUIDS[0]: UUIDS[1], UUIDS[1]: UUIDS[0]}
    assert move.describe() == "GPU 0 -> 1, GPU 1 -> 0"
    # One GPU stays, the other goes to GPU 2.
    assert placement.plan_move(gpus, held(0, 30 * GIB) + held(1, 30 * GIB), [0, 2], 580).to_gpus == [0, 2]
    # GPU 2 cannot take 30 GB while it holds 60 GB of someone else's.
    gpus[2] = gpu(2, used=60 * GIB)
    with pytest.raises(GpuError, match="GPU 2 has 21.5 GB free"):
        placement.plan_move(gpus, held(0, 30 * GIB) + held(1, 30 * GIB), [0, 2], 580)


def test_a_kernel_suspended_on_two_gpus_resumes_where_it_was_else_on_the_roomiest_others():
    was = [{"index": 1, "uuid": UUIDS[1], "name": "NVIDIA H200", "memory_used": 16 * GIB},
           {"index": 0, "uuid": UUIDS[0], "name": "NVIDIA H200", "memory_used": 16 * GIB}]
    gpus = [gpu(0), gpu(1), gpu(2, used=40 * GIB), gpu(3, used=10 * GIB)]
    assert placement.plan_resume(gpus, was, None, 580).to_gpus == [0, 1]
    assert placement.plan_resume(gpus, was, [1, 0], 580).to_gpus == [1, 0], "swapped, as asked"
    gpus[0] = gpu(0, used=70 * GIB)  # someone took GPU 0 meanwhile: its part goes to the roomiest other
    move = placement.plan_resume(gpus, was, None, 580)
    assert (move.from_gpus, move.to_gpus) == ([0, 1], [3, 1])
    with pytest.raises(GpuError, match="name a GPU for each"):
        placement.plan_resume(gpus, was, 2, 580)
    with pytest.raises(GpuError, match="too few of that model"):  # one H200 left here, for two
        placement.plan_resume([gpu(0, used=70 * GIB), gpu(3, name="NVIDIA H100")], was, None, 580)
    # The kernel list offers no single GPU to a kernel on two: each says how to name one per GPU.
    listed = placement.targets(gpus, [], was, "suspended", 580)
    assert listed and all(not t["ok"] and "name a GPU for each" in t["reason"] for t in listed)


def test_where_a_moves_tensors_wait_follows_the_setting_and_the_request():
    from types import SimpleNamespace

    from jupyter_gpumigrate.engine.plans import host_move
    from jupyter_gpumigrate.operations import OperationManager

    one = placement.plan_move([gpu(0), gpu(1)], held(0, 8 * GIB), 1, 580)
    two = placement.plan_move([gpu(0), gpu(1)], held(0, GIB) + held(1, GIB), [1, 0], 580)
    for setting in ("peer", "host"):
        provisioner = SimpleNamespace(move_stash=setting)
        assert OperationManager._move_via(provisioner, one, "auto") == setting
        assert OperationManager._move_via(provisioner, one, "caller") == setting, "%migrate gets the host stash too"
        assert OperationManager._move_via(provisioner, one, "off") is None, "off: the driver moves everything"
        assert OperationManager._move_via(provisioner, two, "auto") is None, "several GPUs: the driver moves them"
    # NVML cannot say (no such GPUs here, or no NVML): the peer link is tried, and steps aside if it fails.
    assert OperationManager._move_via(SimpleNamespace(move_stash="auto"), one, "auto") == "peer"
    # A move to another host takes a kernel on one GPU, said before anything is touched.
    host_move.refuse_several(held(0, GIB))
    with pytest.raises(GpuError, match="holds GPUs 0 and 1: a move to another host takes a kernel on one GPU"):
        host_move.refuse_several(held(1, GIB) + held(0, GIB))


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
    # a GPU being drained is offered to no kernel while the drain runs, with the operation's reason
    drained = placement.targets(gpus, [], suspended_on, "suspended", 580, draining={1})
    assert [t["index"] for t in drained if t["ok"]] == [0]
    assert "GPU 1 is being drained" in next(t["reason"] for t in drained if t["index"] == 1)
    assert [t["index"] for t in placement.targets(gpus, held(0, 8 * GIB), [], "running", 580, draining={1})
            if t["ok"]] == []


def test_a_drain_transplants_onto_the_roomiest_gpu_of_any_model_else_the_cpu():
    """Where a drain that may transplant sends a kernel the driver cannot move: the roomiest GPU with room for
    its tensors and the transplant's headroom, whatever its model, never a drained one; else the CPU."""
    a100 = "NVIDIA A100-SXM4-80GB"
    fleet = [gpu(0, used=40 * GIB), gpu(1, used=79 * GIB), gpu(2, used=30 * GIB, name=a100),
             gpu(3, used=10 * GIB, name=a100)]
    assert placement.transplant_target(fleet, 0, 8 * GIB) == 3
    assert placement.transplant_target(fleet, 0, 8 * GIB, draining={3}) == 2
    assert placement.transplant_target(fleet, 0, 8 * GIB, draining={2, 3}) is None, "GPU 1 has 1 GiB free"
    # Exactly the tensors and the headroom fit; a byte more does not.
    room = 70 * GIB - placement.TRANSPLANT_HEADROOM
    assert placement.transplant_target(fleet, 0, room) == 3
    assert placement.transplant_target(fleet, 0, room + 1, draining={2}) is None
    # MIG instances and a GPU NVML cannot read are never chosen; a GPU alone is drained to the CPU.
    split = [gpu(0), gpu(1, used=0, mig=True), dataclasses.replace(gpu(2, used=0), error="Unknown Error")]
    assert placement.transplant_target(split, 0, GIB) is None
    assert placement.transplant_target([gpu(0)], 0, 0) is None


def _stash_index(nbytes: int) -> dict:
    return {"format": 1, "parts": 1, "session": "s", "buffers": [{"kind": "cuda", "size": nbytes}],
            "chunks": [{"buffer": 0, "at": 0, "size": nbytes, "part": 0, "offset": 0, "xxh3": 1}]}


def test_a_prefetch_begun_as_images_arrive_never_outlives_them(tmp_path, monkeypatch):
    """The other host's prefetch, begun as a GPU kernel's images arrive (peers.GuestHost.begin_prefetch), on a
    GPU as NVML records it: its room counts the kernel, a second copy of its buffers and the placement's
    headroom; it ends when the images are received again, when they are discarded, when its restore goes
    elsewhere for want of room, and once nothing more of the images arrives and no restore takes it. Its helper process is
    real (here, with no GPU, it starts and says so), and ends each time."""
    from jupyter_gpumigrate import peers
    from jupyter_gpumigrate.engine.images import Manifest
    from jupyter_gpumigrate.peers import Guest, GuestHost

    needed, nbytes = 33 * GIB, 32 * GIB
    gpus = [gpu(0, used=1 * GIB, total=141 * GIB)]
    guests = GuestHost(tmp_path / "guests", lambda: None, inventory=lambda: gpus,
                       records=tmp_path / "state" / "guests-running")
    held_there = [{"index": 0, "uuid": UUIDS[0], "memory_used": needed, "name": "NVIDIA H200"}]
    kid = "k-early"

    def begin() -> dict:
        return guests.begin_prefetch(kid, _stash_index(nbytes), held_there, None)

    guests.begin(kid, 1 << 20)
    assert begin() == {"gpu": 0, "reason": None}
    first = guests._early[kid][0]
    helper = first.helper.proc
    guests.begin(kid, 1 << 20)  # the images come again: the copy begun for the first ones ends
    assert kid not in guests._early and first.helper is None
    assert helper.wait(15) is not None

    assert begin()["gpu"] == 0
    second = guests._early[kid][0].helper.proc
    guests.discard(kid)
    assert kid not in guests._early and second.wait(15) is not None

    # Room: the kernel, the copy and the helper's reserve, and the placement's headroom beside them.
    guests.begin(kid, 1 << 20)
    free = needed + nbytes + (1 << 30) + placement.HEADROOM
    gpus[0] = gpu(0, used=141 * GIB - free + 1, total=141 * GIB)
    said = begin()
    assert said["gpu"] is None and "too little for the kernel and a second copy" in said["reason"], said
    gpus[0] = gpu(0, used=141 * GIB - free, total=141 * GIB)
    assert begin()["gpu"] == 0

    # The restore pins the prefetch's GPU while the kernel has its room there beside it, and only then.
    guest = Guest(Manifest(kernel_id=kid, kernel_name="python3", pid=4242, ids=[4242], gpus=held_there), "a")
    gpus[0] = gpu(0, used=141 * GIB - needed - placement.HEADROOM, total=141 * GIB)  # the copy is held
    assert guests._prefetched_gpu(kid, guest, None) == 0 and kid in guests._early
    assert guests._prefetched_gpu(kid, guest, 1) == 1, "a GPU asked is the restore's"
    third = guests._early[kid][0].helper.proc
    gpus[0] = gpu(0, used=141 * GIB - needed, total=141 * GIB)  # another process took memory meanwhile
    assert guests._prefetched_gpu(kid, guest, None) is None
    assert kid not in guests._early and third.wait(15) is not None

    # Nothing more arrives and no restore takes it (its peer died or gave up): it ends by itself; while bytes
    # still arrive, it stays. And once the images are complete, no restore taking it, it ends too.
    monkeypatch.setattr(peers, "PREFETCH_WATCH", 0.05)
    monkeypatch.setattr(peers, "PREFETCH_STALLED", 0.5)
    monkeypatch.setattr(peers, "PREFETCH_UNTAKEN", 60.0)
    gpus[0] = gpu(0, used=1 * GIB, total=141 * GIB)

    def ends_by_itself(helper: Any) -> None:
        deadline = time.monotonic() + 10
        while kid in guests._early:
            assert time.monotonic() < deadline, "a prefetch nobody took outlived its images"
            time.sleep(0.05)
        assert helper.wait(15) is not None

    assert begin()["gpu"] == 0
    fourth = guests._early[kid][0].helper.proc
    with open(guests.image_path(kid, "stash-00.bin"), "wb") as arriving:
        for _ in range(20):  # 1 s of bytes arriving, twice the patience
            arriving.write(b"x" * 4096)
            arriving.flush()
            time.sleep(0.05)
            assert kid in guests._early, "ended while its images still arrived"
    ends_by_itself(fourth)

    monkeypatch.setattr(peers, "PREFETCH_STALLED", 60.0)
    monkeypatch.setattr(peers, "PREFETCH_UNTAKEN", 0.5)
    assert begin()["gpu"] == 0
    fifth = guests._early[kid][0].helper.proc
    guests.store.write_manifest(guests.store.path_for(kid), guest.manifest)
    guests.complete(kid, [], "a")
    ends_by_itself(fifth)
    guests.discard(kid)
