"""How much fresh memory is worth asking as huge pages, on this host.

Decoded weights land in fresh memory: each page is zeroed by the kernel on the first write. A
huge page (2 MiB) usually costs less per byte than 512 small ones, but not on a virtual machine
whose balloon driver reports free memory to the hypervisor (virtio-balloon free page reporting):
the kernel hands free blocks of 2^page_reporting_order pages and more back, the hypervisor drops
them, and a huge page, which always comes from such a block, is then backed again page by page,
while 4 KiB pages come first from the small free fragments still backed. Measured on this
project's hosts (page_reporting_order 5, fresh memory written once, load 7): 1 GiB at 275-352
MB/s of CPU in huge pages against 789-1747 MB/s in 4 KiB pages; a ~3 GB pack's fold load 73% in
the kernel's clear_page_erms under do_huge_pmd_anonymous_page. Small models keep their huge pages
(within the budget, fresh huge pages were faster there: 48 MiB 5-8 ms against 25-35 ms).
"""
from __future__ import annotations

import functools
import glob

# fresh memory per decode (an open pack, a session's arena) asked as huge pages where free page
# reporting would make gigabytes of them slow
REPORTING_HOST_BUDGET = 256 << 20
_REPORTING_FEATURE_BIT = 5  # VIRTIO_BALLOON_F_REPORTING


@functools.lru_cache(maxsize=4)
def free_page_reporting(sysfs: str = "/sys") -> bool:
    """Whether a virtio balloon device reports free pages to the hypervisor (Linux sysfs; False
    where there is none or it cannot be read)."""
    for device in glob.glob(f"{sysfs}/bus/virtio/drivers/virtio_balloon/virtio*"):
        try:
            with open(f"{device}/features") as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _REPORTING_FEATURE_BIT and bits[_REPORTING_FEATURE_BIT] == "1":
            return True
    return False


def huge_page_budget() -> float:
    """Bytes of fresh memory one decode should ask as huge pages before 4 KiB pages: a limit on a
    host with free page reporting, none (infinity) elsewhere."""
    return REPORTING_HOST_BUDGET if free_page_reporting() else float("inf")
