"""The node's local layer store: EROFS images addressed by sha256, named by ``name@version`` refs.

Layout under ``root``::

    blobs/sha256/<hex>.erofs       one read-only image per distinct content
    refs/<name>/<version>.json     a LayerInfo as JSON; many refs may share one blob
    tmp/                           scratch space of builds (same filesystem, so renames are atomic)
    .lock                          writers take it; readers never do

Every file a reader can see is complete: blobs and refs are written under a temporary name and
renamed into place, so the node daemon can resolve layers while the CLI adds or removes some.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import InvalidSpec, LayerExists, LayerInUse, UnknownLayer
from ..lazy.layout import ReadProfile
from ..linux.files import digest_hex, file_digest, remove_tree, write_atomic
from ..records import LAYER_KINDS, LayerInfo, LayerRef

__all__ = ["LayerStore", "Progress", "check_kind"]

#: ``progress(stage, fraction)``: what a build is doing; fraction in [0, 1] or None if unknown.
Progress = Callable[[str, "float | None"], None]


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is one of ``LAYER_KINDS``; raise ``InvalidSpec`` naming them if not."""
    if kind not in LAYER_KINDS:
        raise InvalidSpec(
            f"unknown layer kind {kind!r}; expected one of {', '.join(LAYER_KINDS)}", field="kind"
        )
    return kind


class LayerStore:
    """A content-addressed directory of EROFS layers; see the module docstring for the layout."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LayerStore({str(self.root)!r})"

    # --- paths ----------------------------------------------------------------------------
    @property
    def blob_dir(self) -> Path:
        return self.root / "blobs" / "sha256"

    @property
    def ref_dir(self) -> Path:
        return self.root / "refs"

    @property
    def tmp_dir(self) -> Path:
        """Scratch space for builds; on the store's filesystem so results rename into place."""
        return self.root / "tmp"

    def _blob(self, digest: str) -> Path:
        return self.blob_dir / f"{digest_hex(digest)}.erofs"

    def profile_path(self, digest: str) -> Path:
        """Where the read profile of layer ``digest`` is kept (``lazy.layout.ReadProfile``)."""
        return self.root / "profiles" / f"{digest_hex(digest)}.json"

    # --- read profiles ---------------------------------------------------------------------
    def save_profile(self, profile: ReadProfile) -> Path:
        """Keep ``profile`` with its layer (replacing an older one); publishing uses it."""
        self.by_digest(profile.layer_digest)  # UnknownLayer if the layer is not here
        path = self.profile_path(profile.layer_digest)
        write_atomic(path, profile.to_json().encode())
        return path

    def load_profile(self, info: LayerInfo) -> ReadProfile | None:
        """The saved read profile of ``info``, or None. A damaged file is ``LayerCorrupt``."""
        try:
            text = self.profile_path(info.digest).read_bytes()
        except FileNotFoundError:
            return None
        return ReadProfile.from_json(text)

    def _ref_file(self, name: str, version: str) -> Path:
        return self.ref_dir / name / f"{version}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def scratch(self, prefix: str = "build-") -> Iterator[Path]:
        """A temporary directory in ``tmp/``, removed on exit whatever happened inside."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp_dir))
        try:
            yield path
        finally:
            remove_tree(path)

    # --- reading (no lock: every visible file is complete) --------------------------------
    def _read_ref(self, path: Path) -> LayerInfo | None:
        try:
            return LayerInfo.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:  # removed while we listed
            return None

    def list(self) -> list[LayerInfo]:
        """Every layer in the store, by name then oldest first."""
        out = []
        if self.ref_dir.is_dir():
            for path in self.ref_dir.glob("*/*.json"):
                info = self._read_ref(path)
                if info is not None:
                    out.append(info)
        return sorted(out, key=lambda i: (i.name, i.created, i.version))

    def _versions(self, name: str) -> builtins.list[LayerInfo]:
        d = self.ref_dir / name
        infos = [self._read_ref(p) for p in d.glob("*.json")] if d.is_dir() else []
        return sorted((i for i in infos if i is not None), key=lambda i: (i.created, i.version))

    def resolve(self, ref: LayerRef | str) -> LayerInfo:
        """The layer ``ref`` names; an unversioned ref means the newest (by created time)."""
        ref = LayerRef.parse(str(ref))  # also re-checks a LayerRef built without parse()
        versions = self._versions(ref.name)
        if ref.version is None:
            if versions:
                return versions[-1]
        else:
            info = self._read_ref(self._ref_file(ref.name, ref.version))
            if info is not None:
                return info
        known = [i.ref for i in versions] or [i.ref for i in self.list()]
        raise UnknownLayer(
            f"unknown layer {str(ref)!r} in {self.root}: build it first (`dsec catalog build` "
            "for a catalog's layers, `dsec layer build` for a directory or image)",
            name=str(ref),
            known=known,
        )

    def exists(self, ref: LayerRef | str) -> bool:
        try:
            self.resolve(ref)
        except UnknownLayer:
            return False
        return True

    def by_digest(self, digest: str) -> LayerInfo:
        """The newest layer whose image has this digest (``sha256:<hex>`` or bare hex)."""
        want = f"sha256:{digest_hex(digest)}"
        matches = [i for i in self.list() if i.digest == want]
        if not matches:
            raise UnknownLayer(
                f"no layer with digest {want} in {self.root}",
                name=want,
                known=[f"{i.ref} {i.digest[:19]}" for i in self.list()],
            )
        return max(matches, key=lambda i: i.created)

    def image_path(self, info: LayerInfo) -> Path:
        """The layer's EROFS image; raises ``UnknownLayer`` if its blob is gone."""
        path = self._blob(info.digest)
        if not path.exists():
            raise UnknownLayer(f"layer {info.ref}: image {path} is missing", name=info.ref)
        return path

    # --- writing (under the lock) ---------------------------------------------------------
    def add(
        self,
        image: Path | str,
        *,
        name: str,
        version: str | None,
        kind: str,
        source: str = "",
        progress: Progress | None = None,
        parents: Sequence[str] = (),
        parent_digests: Sequence[str] = (),
        env: Sequence[str] = (),
        workdir: str = "",
        recipe_digest: str = "",
    ) -> LayerInfo:
        """Take ``image`` (it is moved, not copied) into the store as ``name@version``.

        ``version=None`` names the layer by the first 12 hex digits of its digest. Adding the
        same content under the same ref again returns the existing layer; a different content
        under an existing ref raises ``LayerExists``: versions are immutable. ``parents`` and
        ``parent_digests``: refs and digests of the layers (top first) a ``snapshot`` layer
        was taken over; ``env`` (``KEY=VALUE``) and ``workdir``: its sandbox's.
        ``recipe_digest``: the fingerprint of the catalog recipe it was built from.
        """
        image = Path(image)
        check_kind(kind)
        digest = file_digest(image, progress)
        version = version or digest_hex(digest)[:12]
        LayerRef.parse(f"{name}@{version}")
        with self._locked():
            existing = self._read_ref(self._ref_file(name, version))
            if existing is not None:
                if existing.digest != digest:
                    raise LayerExists(
                        f"layer {name}@{version} already exists with digest {existing.digest}; "
                        f"this image is {digest}: pick a new version",
                        ref=f"{name}@{version}",
                        digest=existing.digest,
                    )
                image.unlink()
                return existing
            blob = self._blob(digest)
            if blob.exists():
                image.unlink()  # same content under another name: share the blob
            else:
                self._move_in(image, blob)
            info = LayerInfo(
                name=name,
                version=version,
                kind=kind,
                digest=digest,
                size=blob.stat().st_size,
                created=time.time(),
                source=source,
                parents=tuple(parents),
                parent_digests=tuple(parent_digests),
                env=tuple(env),
                workdir=workdir,
                recipe_digest=recipe_digest,
            )
            write_atomic(
                self._ref_file(name, version), json.dumps(info.to_dict(), indent=2).encode() + b"\n"
            )
            if progress:
                progress("store", 1.0)
            return info

    def _move_in(self, image: Path, blob: Path) -> None:
        blob.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.tmp_dir, prefix="blob-", suffix=".erofs")
        os.close(fd)
        try:
            try:
                os.rename(image, tmp)
            except OSError:  # another filesystem: copy, then drop the original
                shutil.copyfile(image, tmp)
                image.unlink()
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, 0o444)
            os.rename(tmp, blob)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def remove(self, ref: LayerRef | str, *, force: bool = False) -> LayerInfo:
        """Drop the ref; its blob goes too when no other ref uses it.

        An unversioned ref is accepted only when the name has exactly one version, so a typo
        cannot delete the newest of several. A layer that snapshots of this store are taken
        over is ``LayerInUse`` unless ``force``.
        """
        ref = LayerRef.parse(str(ref))
        with self._locked():
            if ref.version is None:
                versions = self._versions(ref.name)
                if len(versions) > 1:
                    raise InvalidSpec(
                        f"{ref.name} has {len(versions)} versions; name one: "
                        + ", ".join(i.ref for i in versions),
                        ref=str(ref),
                    )
            info = self.resolve(ref)
            dependents = [
                i.ref
                for i in self.list()
                if any(
                    (r, d) == (info.ref, info.digest)
                    for r, d in zip(i.parents, i.parent_digests, strict=True)
                )
            ]
            if dependents and not force:
                raise LayerInUse(
                    f"layer {info.ref} is a parent of snapshot(s) {', '.join(dependents)}: "
                    "remove them first, or force it",
                    ref=info.ref,
                    dependents=dependents,
                )
            self._ref_file(info.name, info.version).unlink()
            with contextlib.suppress(OSError):
                (self.ref_dir / info.name).rmdir()
            if not any(i.digest == info.digest for i in self.list()):
                with contextlib.suppress(FileNotFoundError):
                    self._blob(info.digest).unlink()
                with contextlib.suppress(FileNotFoundError):
                    self.profile_path(info.digest).unlink()
            return info
