"""``protocol.memory.release_memory``: freed memory goes back to the system, not only to the allocator."""

from __future__ import annotations

import platform

import psutil
import pytest

from parity_tests.protocol.memory import release_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's; elsewhere it is a no-op")
def test_memory_freed_between_live_blocks_is_given_back():
    """Half of 4000 blocks of 64 KB freed (under glibc's mmap threshold, so into the arena, between live blocks
    that keep it from shrinking by itself): the trim hands those 128 MB back to the system."""
    process = psutil.Process()
    blocks = [bytearray(64 * 1024) for _ in range(4000)]
    for b in blocks:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page: resident
    del blocks[::2]
    before = process.memory_info().rss
    release_memory()
    assert before - process.memory_info().rss > 64e6
    assert len(blocks) == 2000  # the other half stays alive through the trim
