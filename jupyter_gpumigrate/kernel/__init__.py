"""The kernel side: ``%migrate`` and its widget, talking to the kernel's own server with the kernel's own
credential (../credentials.py). Nothing here touches NVML: NVML handles in a kernel block its checkpoint."""
