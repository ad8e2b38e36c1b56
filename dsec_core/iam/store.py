"""Where IAM keeps its state: one small key-value interface, on SQLite (one machine) or etcd
(several apiservers sharing state).

Keys are strings like ``project/org/team`` and ``key/<id>``, values JSON objects. The
operations are the few IAM needs to stay consistent when several processes write at once: a
create that succeeds only if its keys are absent and the ones it depends on are present (a
project's parent, a key's project), all in one transaction, so two apiservers can never create
the same project or key name twice.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import IamUnavailable, InvalidSpec

__all__ = ["EtcdStore", "IamStore", "SqliteStore", "prefix_end"]

#: etcd refuses a transaction of more operations than this (its ``--max-txn-ops``, 128 by
#: default); bigger deletes go in batches of it.
ETCD_TXN_OPS = 100


def prefix_end(prefix: str) -> str:
    """The first string after every string starting with ``prefix`` (for range scans)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class IamStore(ABC):
    """A key-value store of JSON objects with the atomic operations IAM relies on."""

    #: What the store is, for messages (``sqlite:///...``, ``etcd://...``).
    url: str

    @abstractmethod
    def get(self, key: str) -> dict[str, Any] | None:
        """The value at ``key``, or None."""

    @abstractmethod
    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every key starting with ``prefix`` and its value."""

    @abstractmethod
    def create(self, items: Mapping[str, dict[str, Any]], require: Iterable[str] = ()) -> bool:
        """Write all of ``items`` if none of their keys exists and every key in ``require``
        does, atomically; False (and nothing written) otherwise."""

    @abstractmethod
    def update(self, key: str, value: dict[str, Any]) -> bool:
        """Replace the value at ``key`` if it exists; False if it does not."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Remove ``keys`` (absent ones are ignored); atomic on SQLite, and on etcd in batches
        of ``ETCD_TXN_OPS``."""

    def close(self) -> None:  # noqa: B027 - a store with nothing to release needs no override
        """Release connections; the store is not used afterwards."""


class SqliteStore(IamStore):
    """IAM state in one SQLite file (WAL mode), safe for several processes on one machine.

    Writes take the database's write lock first (``BEGIN IMMEDIATE``), so the checks of a
    ``create`` and its writes are one transaction against every other writer. The file is made
    readable by its owner only: it holds the keys' hashes.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_absolute():
            raise InvalidSpec(f"the IAM database path must be absolute, got {path}", field="iam")
        self.path = path
        self.url = f"sqlite://{path}"
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            self._db = sqlite3.connect(
                path, timeout=30.0, isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, safe
            self._db.execute("CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
        except (OSError, sqlite3.Error) as e:
            raise IamUnavailable(f"cannot open the IAM database {path}: {e}", store=self.url) from e

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[tuple[str, str]]:
        try:
            with self._lock:
                return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise IamUnavailable(f"IAM database {self.path}: {e}", store=self.url) from e

    def get(self, key: str) -> dict[str, Any] | None:
        rows = self._read("SELECT k, v FROM kv WHERE k = ?", (key,))
        return json.loads(rows[0][1]) if rows else None

    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        rows = self._read(
            "SELECT k, v FROM kv WHERE k >= ? AND k < ? ORDER BY k", (prefix, prefix_end(prefix))
        )
        return {k: json.loads(v) for k, v in rows}

    def _write(self, work: Any) -> bool:
        """Run ``work(cursor) -> bool`` in a write transaction; commit on True."""
        try:
            with self._lock:
                cur = self._db.cursor()
                cur.execute("BEGIN IMMEDIATE")
                try:
                    ok = bool(work(cur))
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT" if ok else "ROLLBACK")
                return ok
        except sqlite3.Error as e:
            raise IamUnavailable(f"IAM database {self.path}: {e}", store=self.url) from e

    def create(self, items: Mapping[str, dict[str, Any]], require: Iterable[str] = ()) -> bool:
        required = list(require)

        def work(cur: sqlite3.Cursor) -> bool:
            for key in items:
                if cur.execute("SELECT 1 FROM kv WHERE k = ?", (key,)).fetchone():
                    return False
            for key in required:
                if not cur.execute("SELECT 1 FROM kv WHERE k = ?", (key,)).fetchone():
                    return False
            cur.executemany(
                "INSERT INTO kv (k, v) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in items.items()],
            )
            return True

        return self._write(work)

    def update(self, key: str, value: dict[str, Any]) -> bool:
        def work(cur: sqlite3.Cursor) -> bool:
            cur.execute("UPDATE kv SET v = ? WHERE k = ?", (json.dumps(value), key))
            return cur.rowcount == 1

        return self._write(work)

    def delete(self, keys: Iterable[str]) -> None:
        doomed = [(k,) for k in keys]

        def work(cur: sqlite3.Cursor) -> bool:
            cur.executemany("DELETE FROM kv WHERE k = ?", doomed)
            return True

        self._write(work)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class EtcdStore(IamStore):
    """IAM state in etcd (v3), for several apiservers sharing it: ``endpoint`` is
    ``http://host:port``, every key lives under ``prefix``.

    It speaks etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/kv/deleterange``;
    keys and values base64) over plain HTTP with the standard library: no gRPC stack to
    install. A ``create`` is one transaction whose compares check that its keys have never
    been created (``create_revision == 0``) and that the keys it requires exist
    (``version > 0``); etcd applies it or none of it, across every apiserver. No TLS or etcd
    authentication: run etcd on loopback or a private network.
    """

    def __init__(self, endpoint: str, prefix: str = "dsec/iam", *, timeout: float = 5.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.prefix = prefix.strip("/") + "/"
        self.url = f"etcd://{self.endpoint.removeprefix('http://')}/{self.prefix.rstrip('/')}"
        self.timeout = timeout
        parsed = urlsplit(self.endpoint)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise InvalidSpec(f"etcd endpoint {endpoint!r}: expected http://host:port", field="iam")
        self._host, self._port = parsed.hostname, parsed.port
        # one kept-alive connection per thread: a request costs a loopback round trip, not
        # a TCP handshake too
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection] = []

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<route>`` on this thread's kept-alive connection; a
        connection etcd closed meanwhile (idle, restarted) is reopened once. (Should etcd have
        applied a create just before dropping the connection, the retry finds its keys taken
        and reports them existing: never a second create.)"""
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request("POST", f"/v3/{route}", data, {"Content-Type": "application/json"})
                answer = conn.getresponse()
                payload = answer.read()
                break
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if attempt == 2 or not isinstance(
                    e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                ):
                    raise IamUnavailable(
                        f"cannot reach etcd at {self.endpoint} ({route}): {e}", store=self.url
                    ) from e
        if answer.status != 200:
            detail = payload[:500].decode(errors="replace")
            raise IamUnavailable(
                f"etcd at {self.endpoint} refused {route}: HTTP {answer.status} {detail}",
                store=self.url,
            )
        try:
            out: dict[str, Any] = json.loads(payload)
        except ValueError as e:
            raise IamUnavailable(
                f"etcd at {self.endpoint} answered {route} with no JSON", store=self.url
            ) from e
        return out

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def get(self, key: str) -> dict[str, Any] | None:
        kvs = self._call("kv/range", {"key": self._key(key)}).get("kvs") or []
        return json.loads(_unb64(kvs[0]["value"])) if kvs else None

    def scan(self, prefix: str) -> dict[str, dict[str, Any]]:
        full = self.prefix + prefix
        answer = self._call("kv/range", {"key": _b64(full), "range_end": _b64(prefix_end(full))})
        return {
            _unb64(kv["key"]).removeprefix(self.prefix): json.loads(_unb64(kv["value"]))
            for kv in answer.get("kvs") or []
        }

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        # the gateway leaves false fields out of its JSON: a failed txn has no "succeeded"
        return bool(self._call("kv/txn", {"compare": compare, "success": success}).get("succeeded"))

    def create(self, items: Mapping[str, dict[str, Any]], require: Iterable[str] = ()) -> bool:
        compare = [
            {"key": self._key(k), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            for k in items
        ] + [
            {"key": self._key(k), "target": "VERSION", "result": "GREATER", "version": "0"}
            for k in require
        ]
        puts = [
            {"request_put": {"key": self._key(k), "value": _b64(json.dumps(v))}}
            for k, v in items.items()
        ]
        return self._txn(compare, puts)

    def update(self, key: str, value: dict[str, Any]) -> bool:
        compare = [
            {"key": self._key(key), "target": "VERSION", "result": "GREATER", "version": "0"}
        ]
        put = [{"request_put": {"key": self._key(key), "value": _b64(json.dumps(value))}}]
        return self._txn(compare, put)

    def delete(self, keys: Iterable[str]) -> None:
        doomed = list(keys)
        for i in range(0, len(doomed), ETCD_TXN_OPS):
            ops = [
                {"request_delete_range": {"key": self._key(k)}}
                for k in doomed[i : i + ETCD_TXN_OPS]
            ]
            self._txn([], ops)
