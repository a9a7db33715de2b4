"""verify, read buffers: the memory each file thread reads tensors into, reused from tensor to
tensor and file to file, and the leases that keep a buffer from being written while a check still
holds the tensor in it. The memory is io.buffers' (its allocator, and the run's scratch of each
thread)."""

from __future__ import annotations

from dataclasses import dataclass

from mla_convert.io.buffers import new_map, scratch


@dataclass(eq=False)
class Lease:
    """A holder's claim on the read buffer a tensor lives in: while the lease is live, the
    buffer set does not write that buffer again. The holder releases it when it drops the tensor."""

    owner: str  # the tensor kept in the buffer
    live: bool = True

    def release(self) -> None:
        self.live = False


class ReadBuffers:
    """Two buffers, used in turn, for the tensors a thread reads (`take`): the hash of one runs while the
    next is read and checked (the data pass's background sha256 waits for it before taking the next).
    They are reused across tensors and files: a fresh buffer costs a page fault per 4 KB, more than
    the copy from the page cache. A buffer under a live lease when its turn comes again (a check
    keeps an MLA artifact, or a weight whose scale comes later) is left to its holder, and the turn
    takes a spare one whose leases have all been released (or a new one): a weight waiting for its
    scale costs no fresh memory. Spares beyond SPARES are let go. Tensors over REUSE_BYTES
    (embeddings) get memory of their own, so none is held after its file."""

    REUSE_BYTES = 256 * 1024 * 1024
    SPARES = 2

    def __init__(self) -> None:
        self._slots = [_new_buffer(0), _new_buffer(0)]
        self._leases: list[list[Lease]] = [[], []]  # per slot: the leases handed out on its buffer
        self._held: list[tuple[object, list[Lease]]] = []  # buffers left to their leases' holders
        self._turn = 0

    def take(self, nbytes: int) -> memoryview:
        """Memory for the next tensor read, `nbytes` long."""
        self._turn ^= 1
        if nbytes > self.REUSE_BYTES:
            return memoryview(_new_buffer(nbytes))[:nbytes]
        turn = self._turn
        if any(lease.live for lease in self._leases[turn]):
            self._held.append((self._slots[turn], self._leases[turn]))
            self._slots[turn] = self._spare(nbytes)
        elif len(self._slots[turn]) < nbytes:
            self._slots[turn] = self._spare(nbytes)
        self._leases[turn] = []
        return memoryview(self._slots[turn])[:nbytes]

    def _spare(self, nbytes: int):
        """A held buffer of at least nbytes whose leases are all released, else a new one."""
        free = [i for i, (_, leases) in enumerate(self._held) if not any(lease.live for lease in leases)]
        fits = [i for i in free if len(self._held[i][0]) >= nbytes]
        buf = self._held.pop(fits[0])[0] if fits else _new_buffer(nbytes)
        free = [b for b, leases in self._held if not any(lease.live for lease in leases)]
        if len(free) > self.SPARES:  # the smallest spares go first
            drop = sorted(free, key=len)[: len(free) - self.SPARES]
            self._held = [(b, leases) for b, leases in self._held if not any(b is d for d in drop)]
        return buf

    def lease(self, view: memoryview, owner: str) -> Lease:
        """Lease the buffer behind `view` (returned by take) to `owner`, until it releases it. A
        tensor over REUSE_BYTES has memory of its own, which no later read writes anyway."""
        lease = Lease(owner)
        for slot, leases in zip(self._slots, self._leases, strict=True):
            if view.obj is slot:
                leases.append(lease)
        return lease


def thread_buffers() -> ReadBuffers:
    """This thread's read buffers, made on first use and kept for the next file of the run; let go
    with the run (io.buffers.scratch)."""
    return scratch().kept("verify_read_buffers", ReadBuffers)


def _new_buffer(nbytes: int):
    """Memory to read `nbytes` into at once: its pages mapped in one call rather than one fault per
    4 KB as they are first written."""
    return new_map(nbytes, populate=True)
