"""REST handlers under /api/gpumigrate, one small module per resource."""

from __future__ import annotations

from . import gpus, kernels, operations, peer, refused
from .base import NoRouteHandler

API_PREFIX = "/api/gpumigrate"

PEER = f"{API_PREFIX}/peer"
KERNEL_ID = r"(?P<kernel_id>[\w-]+)"


def handlers() -> list[tuple[str, type]]:
    return [
        (rf"{API_PREFIX}/kernels/?", kernels.KernelListHandler),
        (rf"{API_PREFIX}/kernels/{KERNEL_ID}/?", kernels.KernelHandler),
        (rf"{API_PREFIX}/kernels/{KERNEL_ID}/(?P<action>suspend|resume|migrate|transplant|back)/?", kernels.KernelActionHandler),
        (rf"{API_PREFIX}/operations/?", operations.OperationListHandler),
        (rf"{API_PREFIX}/operations/(?P<op_id>[\w-]+)/?", operations.OperationHandler),
        (rf"{API_PREFIX}/gpus/?", gpus.GpuListHandler),
        (rf"{API_PREFIX}/gpus/(?P<index>[0-9]+)/drain/?", gpus.DrainHandler),
        (rf"{API_PREFIX}/refused/?", refused.RefusedListHandler),
        (rf"{PEER}/check/?", peer.CheckHandler),
        (rf"{PEER}/transplants/check/?", peer.TransplantCheckHandler),
        (rf"{PEER}/images/{KERNEL_ID}/?", peer.ImagesHandler),
        (rf"{PEER}/images/{KERNEL_ID}/complete/?", peer.CompleteHandler),
        (rf"{PEER}/images/{KERNEL_ID}/prefetch/?", peer.PrefetchHandler),
        (rf"{PEER}/images/{KERNEL_ID}/(?P<name>[\w.-]+)", peer.ImageFileHandler),
        (rf"{PEER}/kernels/{KERNEL_ID}/?", peer.GuestHandler),
        (rf"{PEER}/kernels/{KERNEL_ID}/(?P<action>restore|dump|resume|signal|transplant|switch)/?", peer.GuestActionHandler),
        (rf"{PEER}/kernels/{KERNEL_ID}/channels", peer.ChannelsHandler),
        (rf"{PEER}(/.*)?", peer.NoPeerRouteHandler),  # what no peer route above takes, asked by a peer
        (rf"{API_PREFIX}(/.*)?", NoRouteHandler),  # last: what no route above takes
    ]
