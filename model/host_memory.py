"""The memory this process may use, read once here for the exporter and the server (torch-free):
the cgroup (container) limit where there is one (v2, else v1), else the host's."""

from __future__ import annotations

import os

# (limit, usage) files of cgroup v2, then v1; a limit of 2^60 or more means none
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
NO_LIMIT = 1 << 60


def _cgroup() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup, or None without a limit."""
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit = open(limit_file).read().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < NO_LIMIT:
            try:
                usage = int(open(usage_file).read().strip())
            except (OSError, ValueError):
                usage = 0
            return int(limit), usage
    return None


def memory_limit() -> int:
    """Bytes this process may use: the cgroup limit when there is one, else physical memory."""
    cgroup = _cgroup()
    return cgroup[0] if cgroup else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_free() -> int:
    """Bytes this process may still take: MemAvailable, less where the cgroup's room is smaller."""
    available = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    cgroup = _cgroup()
    return min(available, cgroup[0] - cgroup[1]) if cgroup else available
