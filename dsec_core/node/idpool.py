"""Host uid ranges for sandboxes: one range of its own per sandbox, from a configured pool.

The kernel keeps several limits per host uid: the key quota (``kernel.keys.maxkeys``, 200 keys,
and runc gives every container a session keyring), ``RLIMIT_NPROC``, inotify instances and
watches, message queue bytes. Sandboxes that shared one uid shared all of them, so one sandbox
could exhaust them for every other, and a node stopped creating after about 150 sandboxes. Each
sandbox now gets ``size`` ids of its own, starting at ``base + k * size`` for range ``k``.

A range goes back to the pool only once its sandbox is fully gone (processes, mounts, files),
and it goes to the back of the queue: ranges never used are handed out first, then the ones
freed longest ago, so kernel objects a dead sandbox's uid still owns (keys wait for the key
garbage collector) have the longest time to go before the uid serves again.

A sandbox's layer clones are idmapped through a user namespace with its range's maps
(``clone_idmapped``). Making one costs about 2 ms of a helper process (``unshare``), so the pool
makes the next range's ahead of need, off the create path (``warm``), and keeps each range's
namespace for the next sandbox of that range (up to ``KEPT_NAMESPACES``): nothing runs in it,
it only maps ids, and a range's maps never change, so the next sandbox's clones are mapped
exactly as a new namespace would map them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable

from ..errors import AdmissionRejected, InvalidSpec
from ..linux.mounts import UserNamespaceHandle
from ..records import IdMap

__all__ = ["MAX_HOST_ID", "UidPool"]

#: The largest host id a range may reach ((uid_t)-1 is "no id").
MAX_HOST_ID = (1 << 32) - 2
#: Ranges whose user namespace the pool keeps open (a descriptor each), least recently used
#: closed first.
KEPT_NAMESPACES = 4096


class UidPool:
    """``count`` ranges of ``size`` host ids from ``base``; gid 0 of every range maps to
    ``group``. Thread-safe."""

    def __init__(self, base: int, size: int, count: int, group: int) -> None:
        if size < 2 or count < 1 or base < 1:
            raise InvalidSpec(
                f"uid pool: base {base}, {count} ranges of {size} ids: base and count must "
                "be positive and a range at least 2 ids",
                field="uid_pool",
            )
        if base + size * count - 1 > MAX_HOST_ID:
            raise InvalidSpec(
                f"uid pool: {count} ranges of {size} ids from {base} end past the largest "
                f"host id {MAX_HOST_ID}; use fewer ranges (DSEC_UID_RANGES) or smaller ones",
                field="uid_pool",
            )
        self.base, self.size, self.count, self.group = base, size, count, group
        self._next = 0  # ranges below this were handed out at least once
        self._freed: deque[int] = deque()  # oldest first
        self._used: set[int] = set()
        # each range's namespace, made ahead by warm() or by a first use; oldest use first
        self._warm: OrderedDict[int, UserNamespaceHandle] = OrderedDict()
        self._lock = threading.Lock()

    def _idmap(self, k: int) -> IdMap:
        return IdMap(self.base + k * self.size, self.size, self.group)

    def _index(self, idmap: IdMap) -> int | None:
        k, rem = divmod(idmap.host_base - self.base, self.size)
        if rem or not 0 <= k < self.count or idmap.size != self.size:
            return None
        return k

    def allocate(self) -> IdMap:
        """A free range, or ``AdmissionRejected`` naming the pool when there is none."""
        with self._lock:
            if self._next < self.count:
                k = self._next
                self._next += 1
            elif self._freed:
                k = self._freed.popleft()
            else:
                raise AdmissionRejected(
                    f"uid pool exhausted: all {self.count} ranges of {self.size} host ids from "
                    f"{self.base} are in use (DSEC_UID_RANGES raises the count)",
                    reason="uid-pool",
                    pool="uid",
                    ranges=self.count,
                )
            self._used.add(k)
            return self._idmap(k)

    def release(self, idmap: IdMap) -> None:
        """Give back the range of a sandbox that is fully gone."""
        with self._lock:
            k = self._index(idmap)
            if k is None or k not in self._used:
                return  # not from this pool (a sandbox of an older daemon's settings)
            self._used.discard(k)
            self._freed.append(k)

    def adopt(self, in_use: Iterable[IdMap]) -> None:
        """After a daemon restart: the ranges of the sandboxes it took over are in use, every
        other one is free (those used before come after the never-used ones)."""
        with self._lock:
            used = {k for k in (self._index(m) for m in in_use) if k is not None}
            self._used = used
            self._next = max(used, default=-1) + 1
            self._freed = deque(k for k in range(self._next) if k not in used)

    def in_use(self) -> int:
        with self._lock:
            return len(self._used)

    def free(self) -> int:
        with self._lock:
            return self.count - len(self._used)

    def namespace(self, idmap: IdMap) -> UserNamespaceHandle:
        """A user namespace with ``idmap``'s maps, the pool's (the caller must not close it):
        the one kept for its range, else a new one, kept if the range is the pool's. Blocking
        (call it off the event loop)."""
        k = self._index(idmap)
        lines = (idmap.uid_lines(), idmap.gid_lines())
        with self._lock:
            ns = self._warm.get(k) if k is not None else None
            if k is not None and ns is not None and (ns.uid_map, ns.gid_map) == lines:
                self._warm.move_to_end(k)
                return ns
        ns = UserNamespaceHandle(*lines)
        return ns if k is None else self._keep(k, ns)

    def _keep(self, k: int, ns: UserNamespaceHandle) -> UserNamespaceHandle:
        """Keep ``ns`` for range ``k``, unless one with the same maps is kept already (made
        meanwhile by another thread, and maybe in use): then ``ns`` is closed and that one
        returned."""
        closing = []
        with self._lock:
            old = self._warm.get(k)
            if old is not None and (old.uid_map, old.gid_map) == (ns.uid_map, ns.gid_map):
                closing.append(ns)
                ns = old
            else:
                if old is not None:  # another pool's maps for k (never in use here)
                    closing.append(old)
                self._warm[k] = ns
            self._warm.move_to_end(k)
            while len(self._warm) > KEPT_NAMESPACES:  # the least recently used
                closing.append(self._warm.popitem(last=False)[1])
        for handle in closing:  # a sandbox's clones keep theirs alive
            handle.close()
        return ns

    def upcoming(self) -> IdMap | None:
        """The range ``allocate`` would hand out next, if any is free."""
        with self._lock:
            if self._next < self.count:
                return self._idmap(self._next)
            return self._idmap(self._freed[0]) if self._freed else None

    def warm(self) -> None:
        """Make the next range's user namespace now (blocking: call it off the event loop), so
        the create that takes the range does not wait for it."""
        idmap = self.upcoming()
        if idmap is None:
            return
        k = self._index(idmap)
        with self._lock:
            if k is None or k in self._warm:
                return
        self._keep(k, UserNamespaceHandle(idmap.uid_lines(), idmap.gid_lines()))

    def close(self) -> None:
        with self._lock:
            namespaces = list(self._warm.values())
            self._warm.clear()
        for ns in namespaces:
            ns.close()
