"""The node's lazy layers (``LazyLayers``): the service that serves every layer a node loads
on demand, through one FUSE filesystem of data blobs over one shared chunk cache. The lazy
form itself and the parts it is served with are ``dsec_core.lazy``.

When a layer comes from a source that publishes its lazy form (a small EROFS metadata image
plus a chunked data blob and its chunk index), the node fetches the metadata and the index
eagerly and serves the data blob through ``FuseServer`` at ``$DSEC_HOME/run/lazy/<blob hex>``:
a read of file data in any sandbox becomes, on a cache miss, one fetch of a whole chunk
(default 1 MiB) from the source, verified against the index before it is stored. The cache
(``$DSEC_HOME/cache/chunks``) is content-addressed, so a chunk shared by several layers is
fetched and stored once, and bounded (LRU).

A layer published with a read profile (``lazy.layout``) has its data blob stored in the order
its tasks first read it; when such a layer is registered, the chunks holding that "hot" part
are fetched in the background at once, so its first sandboxes find them cached.

The FUSE connection outlives the daemon: a keeper process (``dsec_core.lazy.fuse_keeper``)
holds a copy of its fd, and each blob's source and layer are recorded under ``run/lazy-blobs``.
A restarted daemon takes the fd from the keeper, registers the recorded blobs again and starts
serving; the kernel re-sends the requests the dead daemon had taken, so a reader in a sandbox
waits through the restart instead of failing, and the chunk cache on disk is reused as is. The
daemon watches its keeper (the one it started or the one it took the fd from) and starts
another if it dies, so the next restart still finds the connection held.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from ..config import NodeConfig
from ..errors import DsecError, NodeUnavailable
from ..lazy.blob import LazyBlob, prefetch
from ..lazy.chunks import ChunkCache
from ..lazy.fuse import FuseServer, abort_connection
from ..lazy.fuse_keeper import dismiss_keeper, take_from_keeper
from ..lazy.layout import AccessTrace, ReadProfile
from ..lazy.split import LazyForm
from ..linux.mounts import mounted_under, unmount
from ..linux.processes import start_time, still_running
from ..plugins import Registry
from ..records import LayerInfo
from ..sources.base import LayerSource

__all__ = ["LazyLayers"]

log = logging.getLogger("dsec.lazy_layers")

WARM_PARALLEL = 4  # fetches in flight per layer while warming its hot chunks
KEEPER_CHECK = 1.0  # seconds between two looks at whether the keeper still lives


class LazyLayers:
    """The node's lazy layers, loaded on demand. ``prepare`` returns what ``MountCache.acquire``
    mounts."""

    def __init__(self, config: NodeConfig, registry: Registry) -> None:
        self.registry = registry
        self.config = config
        self.mountpoint = config.run_dir / "lazy"
        self.state_dir = config.run_dir / "lazy-blobs"
        self.keeper_socket = config.run_dir / "lazy-keeper.sock"
        self.cache: ChunkCache | None = None
        self.server: FuseServer | None = None
        self.blobs: dict[str, LazyBlob] = {}  # by blob digest
        self.layer_of: dict[str, str] = {}  # blob digest -> layer digest
        self._warmers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._keeper: subprocess.Popen | None = None
        self._keeper_pid: tuple[int, int | None] | None = None  # (pid, start time) watched
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        #: digests of the layers whose connection died with a keeper and a daemon (``_open``)
        self.lost_layers: set[str] = set()

    # --- the FUSE connection ----------------------------------------------------------------
    def ensure_open(self) -> None:
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self.server is not None:
            return
        self.cache = ChunkCache(self.config.cache_dir / "chunks", self.config.chunk_cache_bytes)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._adopt():
            return
        if self.mountpoint in mounted_under(self.mountpoint):
            self._drop_dead_connection()  # before anything looks at it: that could hang
        self.mountpoint.mkdir(exist_ok=True)
        server = FuseServer()
        fd = server.mount(self.mountpoint)
        self.server = server
        self._start_keeper(fd)
        self._watch_keeper()

    def _adopt(self) -> bool:
        """Take over the connection a previous daemon left with the keeper, if any."""
        if not self.keeper_socket.exists():
            return False
        try:
            fd, pid = take_from_keeper(os.fspath(self.keeper_socket))
        except OSError:
            self.keeper_socket.unlink(missing_ok=True)  # its keeper is gone with it
            return False
        if fd is None:
            return False
        self._keeper_pid = (pid, start_time(pid))
        server = FuseServer.from_fd(fd, self.mountpoint)
        for path in sorted(self.state_dir.glob("*.json")):
            doc = json.loads(path.read_text())
            try:
                source = self.registry.open_source(doc["source"], self.config)
                self._register(
                    server,
                    source,
                    LayerInfo.from_dict(doc["layer"]),
                    LazyForm.from_json(doc["form"]),
                )
            except DsecError as e:  # the blob stays unregistered; its reads fail with ENOENT
                log.error("cannot serve on-demand blob %s again: %s", path.stem, e)
        server.start()  # re-sends what the dead daemon had taken
        self.server = server
        log.info("adopted the on-demand filesystem with %d blobs", len(self.blobs))
        self._watch_keeper()
        return True

    def _drop_dead_connection(self) -> None:
        """A connection nobody holds any more (its keeper and its daemon both died): it is
        detached, so the new one is not stacked on it, and the layers that read through it
        are ``lost_layers`` (their mounts and the sandboxes on them cannot read again)."""
        for path in sorted(self.state_dir.glob("*.json")):
            try:
                self.lost_layers.add(
                    LayerInfo.from_dict(json.loads(path.read_text())["layer"]).digest
                )
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("on-demand blob record %s unreadable: %s", path, e)
            path.unlink(missing_ok=True)
        log.warning(
            "on-demand filesystem at %s had no keeper: aborted and detached, %d layers lost "
            "with it",
            self.mountpoint,
            len(self.lost_layers),
        )
        # a stray process may still hold its fd (one a daemon spawned before its fds were
        # close-on-exec): then the connection lives, nobody serves it, and every look at the
        # mount waits for good; aborted, they all fail at once
        abort_connection(self.mountpoint, self.config.run_dir / "fusectl")
        unmount(self.mountpoint, lazy=True)

    def _watch_keeper(self) -> None:
        self._watcher = threading.Thread(
            target=self._keep_a_keeper, name="fuse-keeper-watch", daemon=True
        )
        self._watcher.start()

    def _keep_a_keeper(self) -> None:
        """While the filesystem is served: a keeper that died (killed from outside) is
        replaced by a new one holding the same connection. Without one, the next daemon
        restart would drop the connection, and every on-demand layer mount with it."""
        while not self._stopping.wait(KEEPER_CHECK):
            with self._lock:
                if self.server is None or self.server.fd < 0:
                    return
                if self._keeper_alive():
                    continue
                log.warning("the on-demand filesystem's fd keeper died; starting another")
                self.keeper_socket.unlink(missing_ok=True)
                try:
                    self._start_keeper(self.server.fd)
                except (OSError, DsecError) as e:  # tried again next round
                    log.error("starting a new fd keeper: %s", e)

    def _keeper_alive(self) -> bool:
        if self._keeper is not None:
            if self._keeper.poll() is None:
                return True
            self._keeper = None  # reaped
            return False
        if self._keeper_pid is not None:
            return still_running(*self._keeper_pid)
        return False

    def _start_keeper(self, fd: int) -> None:
        self._keeper_pid = None
        self._keeper = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsec_core.lazy.fuse_keeper",
                "--fd",
                str(fd),
                "--socket",
                os.fspath(self.keeper_socket),
                "--mountpoint",
                os.fspath(self.mountpoint),
            ],
            pass_fds=(fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        out = self._keeper.stdout
        assert out is not None  # stdout=PIPE
        if out.readline().strip() != b"ready":
            self._keeper.kill()
            self._keeper.wait()
            raise NodeUnavailable("the on-demand loader's fd keeper did not start")
        out.close()

    # --- blobs ------------------------------------------------------------------------------
    def _register(
        self, server: FuseServer, source: LayerSource, info: LayerInfo, form: LazyForm
    ) -> None:
        index = form.index
        if index.blob_digest in self.blobs:
            return
        assert self.cache is not None, "_open() first"
        blob = LazyBlob(
            index,
            self.cache,
            lambda off, n: source.read_blob(index.blob_digest, off, n),
            self.config.fetch_timeout,
            trace=AccessTrace() if self.config.trace_reads else None,
        )
        server.add_blob(index.blob_digest.split(":", 1)[-1], index.blob_size, blob.read)
        self.blobs[index.blob_digest] = blob
        self.layer_of[index.blob_digest] = info.digest
        if index.hot and self.config.prefetch_hot:
            self._warmers = [w for w in self._warmers if w.is_alive()]
            warmer = threading.Thread(
                target=self._warm_hot,
                args=(blob, info.ref),
                name=f"warm-{index.blob_digest[7:19]}",
                daemon=True,
            )
            self._warmers.append(warmer)
            warmer.start()

    def _warm_hot(self, blob: LazyBlob, ref: str) -> None:
        """Fetch the chunks a layer's read profile says its sandboxes read first, a few at a
        time in stored order, behind the sandbox that mounts it (readers never wait for this:
        a chunk they need sooner is fetched for them, and both share the one fetch)."""
        chunks = iter(blob.index.hot_chunks)
        lock = threading.Lock()
        done: list[int] = []

        def work() -> None:
            while not self._stopping.is_set():
                with lock:
                    i = next(chunks, None)
                if i is None:
                    return
                try:
                    blob.chunk(i)
                except DsecError as e:  # a reader will retry it and report the error
                    log.warning("warming %s stopped at chunk %d: %s", ref, i, e)
                    return
                done.append(i)

        helpers = [
            threading.Thread(
                target=work, name=f"{threading.current_thread().name}-{n}", daemon=True
            )
            for n in range(1, WARM_PARALLEL)
        ]
        for t in helpers:
            t.start()
        work()
        for t in helpers:
            t.join()
        log.info("warmed %s: %d chunks its profile reads", ref, len(done))

    def profiles(self, workload: str = "") -> list[ReadProfile]:
        """What was read of each on-demand blob so far (``NodeConfig.trace_reads``), as read
        profiles of the logical blobs; blobs nothing read are left out."""
        out = []
        for digest, blob in list(self.blobs.items()):
            if blob.trace is None or not len(blob.trace):
                continue
            out.append(
                ReadProfile(
                    self.layer_of[digest],
                    blob.index.logical_digest,
                    blob.index.blob_size,
                    tuple(blob.trace.ranges()),
                    workload,
                )
            )
        return out

    def prepare(self, source: LayerSource, info: LayerInfo) -> tuple[Path, Path] | None:
        """(metadata image, data blob path) for an on-demand mount of ``info``, or None if the
        source offers only the whole image. Blocking: fetches the metadata."""
        form = source.lazy_form(info)
        if form is None:
            return None
        meta = source.fetch_meta(form)
        name = form.index.blob_digest.split(":", 1)[-1]
        with self._lock:
            self._open()
            server = self.server
            assert server is not None
            if form.index.blob_digest not in self.blobs:
                record = self.state_dir / f"{name}.json"
                tmp = record.with_suffix(".tmp")
                tmp.write_text(
                    json.dumps(
                        {"source": source.url, "layer": info.to_dict(), "form": form.to_json()}
                    )
                )
                os.replace(tmp, record)
                self._register(server, source, info, form)
                log.info(
                    "layer %s on demand: %d chunks of %d KiB from %s",
                    info.ref,
                    len(form.index.chunks),
                    form.index.chunk_size >> 10,
                    source.url,
                )
        return meta, server.path_of(name)

    def prefetch(self, blob_digest: str) -> int:
        """Warm every chunk of a registered blob; returns how many were fetched."""
        return prefetch(self.blobs[blob_digest])

    def close(self) -> None:
        """Unmount the on-demand filesystem and let its keeper go (no sandbox uses it)."""
        self._stopping.set()
        for warmer in self._warmers:
            warmer.join()  # at most one chunk fetch (fetch_timeout) away
        self._warmers.clear()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        self._stopping.clear()
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None
            if self.keeper_socket.exists():
                try:
                    dismiss_keeper(os.fspath(self.keeper_socket))
                except OSError:
                    pass
            if self._keeper is not None:
                self._keeper.wait(timeout=10)
                self._keeper = None
            for path in self.state_dir.glob("*.json") if self.state_dir.exists() else []:
                path.unlink()
            self.blobs.clear()
            self.layer_of.clear()
