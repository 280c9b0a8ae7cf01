"""What the CPU is, as `/proc/cpuinfo` says (Linux; empty elsewhere)."""

import functools


@functools.cache
def cpu_field(field: str) -> str:
    """The value of `field` (`"model name"`, `"vendor_id"`) for the first CPU, or `""` where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""
