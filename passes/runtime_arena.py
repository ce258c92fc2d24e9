"""Fresh buffers for many small tensors cut from a few large arrays, so that their pages come as
huge pages.

Why: numpy asks the kernel for transparent huge pages on arrays of 4 MiB and more (madvise), and
the kernel then maps 2 MiB at a fault; an array under 4 MiB gets 4 KiB pages, a fault (and a
page zeroed) each. A packed model's weights decode into fresh arrays and a float16 model's
weights fold into fresh arrays, most of them ~1 MiB (minilm: 1536x384): first-touch faults of
1.2 MB took 0.56 ms (295 faults), of 22 MB in one np.empty 2.26 ms (773: only its 2 MiB-aligned
part got huge pages), of a 16 MiB chunk mapped as below 0.80 ms (8 faults), where 16 MiB of
1.2 MB arrays would take ~7.5 ms (one process on this host, thread CPU, first touch).

Memory: a chunk is freed when the last tensor cut from it is; CHUNK_BYTES bounds what one
surviving tensor can hold back. Tensors of OWN_BYTES and more get an np.empty of their own, as
before (numpy asks huge pages for those).

Huge pages only for the first huge_bytes an arena hands out (passes/_pages.huge_page_budget: 256
MiB on a virtual machine whose balloon reports free pages to the hypervisor, where fresh huge
pages cost several times 4 KiB ones; no limit elsewhere); 4 KiB pages after that. bench/load.py's
generated ~3 GB pack, fold load on such a host: 10.9-12.0 s of CPU to a ready session with every
weight in huge pages, 9.5 of it the kernel zeroing them, against 4.1-5.3 s past the budget (the
plain .onnx: 4.3-6.7 s)."""
from __future__ import annotations

import mmap

import numpy as np

from ._pages import huge_page_budget

# size of the shared arrays small tensors are cut from: a multiple of 2 MiB, which the kernel
# maps at a 2 MiB boundary, so that every page of it can be a huge page
CHUNK_BYTES = 16 << 20
# tensors this large get their own array (numpy's huge-page threshold: 4 MiB)
OWN_BYTES = 4 << 20
# start of each tensor in a chunk (cache line; the fold kernel's vector loads need no more)
ALIGN = 64


class Arena:
    """Hands out fresh uint8 arrays (`take`), cut from shared chunks where small."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, own_bytes: int = OWN_BYTES, huge_bytes: float | None = None):
        self.chunk_bytes = chunk_bytes
        self.own_bytes = own_bytes
        self._chunk = None
        self._used = 0
        # fresh memory still to be asked as huge pages (None: this host's budget, see the docstring)
        self._huge_left = huge_page_budget() if huge_bytes is None else huge_bytes

    def _huge(self, nbytes: int) -> bool:
        """Whether `nbytes` more of fresh memory come as huge pages (within the arena's budget)."""
        if nbytes > self._huge_left:
            self._huge_left = 0
            return False
        self._huge_left -= nbytes
        return True

    def take(self, nbytes: int) -> np.ndarray:
        """A fresh, writable, C-contiguous uint8 array of `nbytes` (contents undefined)."""
        nbytes = int(nbytes)
        if nbytes >= self.own_bytes or nbytes <= 0:
            nbytes = max(nbytes, 0)
            if nbytes == 0 or self._huge(nbytes):
                return np.empty(nbytes, np.uint8)
            return anonymous_array(nbytes, huge_pages=False)
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.nbytes:
            self._chunk = _fresh_chunk(self.chunk_bytes, self._huge(self.chunk_bytes))
            start = 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes]

    def empty(self, shape, dtype) -> np.ndarray:
        """np.empty(shape, dtype) from the arena."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return self.take(count * dtype.itemsize).view(dtype).reshape(shape)


def _fresh_chunk(nbytes: int, huge_pages: bool = True) -> np.ndarray:
    """A uint8 array of `nbytes` in a private anonymous mapping of its own, huge pages asked for
    (unless `huge_pages` is False: past the arena's budget).

    Not np.empty: glibc serves a malloc of this size from its heap once a larger block has been
    freed (its mmap threshold rises up to 32 MiB), and memory freed inside the heap stays with the
    process (open_nsfw q8.onnxz: 10.8 MB more resident after the session); a mapping of its own
    goes back to the system when the last tensor cut from it does."""
    return anonymous_array(nbytes, huge_pages=huge_pages)


def anonymous_array(nbytes: int, huge_pages: bool) -> np.ndarray:
    """A zero-filled uint8 array of `nbytes` in a private anonymous mapping of its own (untouched
    pages cost no memory), with transparent huge pages asked for (`huge_pages`: many tensors
    written whole, fewer faults) or refused (a buffer written in small scattered pieces, where
    each piece would make a whole 2 MiB page resident: runtime_source._sparse_zeros).

    Private, not Python's default MAP_SHARED for mmap(-1): shared anonymous memory is shmem, whose
    pages fault slower (restoring a pack's graph bytes into it: open_nsfw_fp16 q8.onnxz 0.39-0.46
    ms against 0.31-0.33 private, minilm_fp16 float.onnxz 0.44-0.49 against 0.31-0.32; same
    fault counts; thread CPU, min of 15 in one process)."""
    try:
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError):  # (no anonymous private mappings here)
        return np.zeros(nbytes, np.uint8)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            area.madvise(advice)
        except OSError:
            pass
    return np.frombuffer(area, np.uint8)


def data_address(array) -> int | None:
    """Address of an array's first byte (None for anything else)."""
    if not isinstance(array, np.ndarray):
        return None
    return array.__array_interface__["data"][0]


class MemoryOwners:
    """Which of some registered arrays holds a given array's memory: `find(view)` gives the value
    registered with the array whose bytes contain the view's first byte.

    Why not the `.base` chain: numpy points a view of a view at the array owning the memory, so
    a weight cut from an Arena chunk and then reshaped has the chunk as its base, not the array
    handed out; by address, any view of a registered array (reshaped, retyped, sliced) is found."""

    def __init__(self):
        self._starts = []   # sorted start addresses
        self._items = []    # (end address, value, the array: held, so its addresses stay its own)

    def add(self, array: np.ndarray, value) -> None:
        import bisect

        start = data_address(array)
        at = bisect.bisect_left(self._starts, start)
        self._starts.insert(at, start)
        self._items.insert(at, (start + array.nbytes, value, array))

    def find(self, array, default=None):
        import bisect

        address = data_address(array)
        if address is None:
            return default
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0:
            return default
        end, value, _ = self._items[at]
        return value if address < end else default

    def clear(self) -> None:
        self._starts, self._items = [], []
