"""What this host has, as its operating system says: memory, the cores this process may run on, and the
last-level caches."""

from __future__ import annotations

import glob
import os


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_cores() -> int:
    """Cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every platform has affinity masks
        return os.cpu_count() or 1


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu") -> int:
    """The bytes of this machine's last-level caches together (each shared cache counted once), as Linux's sysfs
    under `root` lists them; 0 where it says nothing."""
    caches: dict[tuple[int, str], int] = {}
    for index in glob.glob(os.path.join(root, "cpu[0-9]*", "cache", "index[0-9]*")):
        try:
            with open(os.path.join(index, "type")) as file:
                if file.read().strip() == "Instruction":
                    continue
            with open(os.path.join(index, "level")) as file:
                level = int(file.read())
            with open(os.path.join(index, "shared_cpu_list")) as file:
                shared = file.read().strip()
            with open(os.path.join(index, "size")) as file:
                size = _cache_size(file.read().strip())
        except (OSError, ValueError):  # (a cache entry this kernel describes differently)
            continue
        caches[level, shared] = size
    top = max((level for level, _ in caches), default=0)
    return sum(size for (level, _), size in caches.items() if level == top)


def _cache_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)
