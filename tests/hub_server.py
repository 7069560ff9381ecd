"""A loopback Hugging Face Hub for tests: the slice of the Hub API that huggingface_hub 2.4 uses to
create a repo, upload files in a commit, and download a snapshot.

Start it with ``HubServer(tmp_path)`` (a ``ThreadingHTTPServer`` on 127.0.0.1, random port, in a
daemon thread) and point the real client at it with ``HF_ENDPOINT=server.url``. Nothing leaves
the machine.

Upload path (``HfApi.create_repo`` + ``HfApi.create_commit``):

    POST /api/repos/create                          name, organization, visibility -> {"url"}
    DELETE /api/repos/delete                        name, organization (the owner only)
    POST /api/validate-yaml                         README.md metadata check
    POST /api/models/{repo}/preupload/{rev}         uploadMode per file: "regular" or "lfs"
    POST /{repo}.git/info/lfs/objects/batch         LFS batch: one "basic" upload action per object
    PUT  /lfs-upload/{oid}                          the object's bytes (checked against its sha256)
    POST /lfs-verify                                LFS verify
    POST /api/models/{repo}/commit/{rev}            NDJSON: header, file (base64), lfsFile (oid)

huggingface_hub 2.4 sends "lfs" files through Xet whenever ``hf_xet`` is installed; this server
does not speak Xet (a separate chunk-store protocol), so by default it answers "regular" for
every file (the bytes travel base64-encoded inside the commit), and ``lfs_threshold`` switches
files at least that large to "lfs" for clients with ``HF_HUB_DISABLE_XET`` set.

Download path (``snapshot_download``):

    GET  /api/models/{repo}[/revision/{rev}]        {"id", "sha", "siblings", "private"}
    GET  /api/models/{repo}/tree/{rev}              recursive listing with oid / lfs / size
    HEAD/GET /{repo}/resolve/{rev}/{path}           X-Repo-Commit, ETag (X-Linked-Etag and
                                                    X-Linked-Size for LFS files), Range requests

Auth: ``Authorization: Bearer <token>`` with ``tokens`` mapping token -> user name. Writing needs
a token whose user owns the namespace; private repos are invisible to others. ``fail`` injects an
error answer: ``{"commit": 409}`` makes the next commits fail with that status; any other route
name (``"create_repo"``, ``"model_info"``, ...) maps to a status, to ``"drop"`` (close the
connection without answering) or to ``"echo"`` (a 400 that quotes the Authorization header back,
as careless servers do).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import yaml

TOKENS = {"hf_test_write_token_me": "me", "hf_test_write_token_other": "other"}
REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_oid(data: bytes) -> str:
    """git's object id of a blob (what the Hub calls the oid of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Entry:
    size: int
    blob: str  # git blob oid (of the content, or of the LFS pointer)
    sha256: str
    lfs: bool


@dataclass
class Repo:
    owner: str
    private: bool
    commits: list[tuple[str, dict[str, Entry]]] = field(default_factory=list)

    def files(self, revision: str) -> tuple[str, dict[str, Entry]] | None:
        if not self.commits:
            return None
        if revision in ("main", "HEAD"):
            return self.commits[-1]
        return next((c for c in self.commits if c[0] == revision), None)


class HubServer:
    """The loopback Hub; ``with HubServer(dir) as hub:`` starts and stops it."""

    def __init__(
        self, root: Path, tokens: dict[str, str] | None = None, lfs_threshold: int | None = None
    ):
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self.tokens = dict(TOKENS if tokens is None else tokens)
        self.lfs_threshold = lfs_threshold
        self.repos: dict[str, Repo] = {}
        self.fail: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    # -- storage ---------------------------------------------------------------------------------

    def store(self, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        path = self.root / "objects" / sha256
        if not path.exists():
            path.write_bytes(data)
        return sha256

    def has_object(self, sha256: str) -> bool:
        return (self.root / "objects" / sha256).exists()

    def read(self, sha256: str) -> bytes:
        return (self.root / "objects" / sha256).read_bytes()

    def file_bytes(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        """The content of ``path`` in ``repo_id`` at ``revision`` (for the tests' assertions)."""
        _, files = self.repos[repo_id].files(revision)
        return self.read(files[path].sha256)

    def file_names(self, repo_id: str, revision: str = "main") -> list[str]:
        return sorted(self.repos[repo_id].files(revision)[1])


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        # -- plumbing ------------------------------------------------------------------------

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(
            self,
            status: int,
            body: bytes = b"",
            headers: dict | None = None,
            content_type: str = "application/json",
            head: bool = False,
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, data, headers: dict | None = None) -> None:
            self._send(status, json.dumps(data).encode(), headers)

        def _error(self, status: int, message: str, code: str | None = None) -> None:
            headers = {"X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._json(status, {"error": message}, headers)

        def _user(self) -> str | None | bool:
            """The token's user; None without a token; False for an unknown token."""
            auth = self.headers.get("Authorization")
            if not auth:
                return None
            token = auth.removeprefix("Bearer ").strip()
            return hub.tokens.get(token, False)

        def _writer(self, repo_id: str | None = None) -> str | None:
            """The user allowed to write (to ``repo_id``), or None after sending the error."""
            user = self._user()
            if not user:
                self._error(401, INVALID_TOKEN)
                return None
            if repo_id is not None:
                repo = hub.repos.get(repo_id)
                if repo is None or (repo.private and repo.owner != user):
                    self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
                    return None
                if repo.owner != user:
                    self._error(403, f"You don't have the rights to write to {repo_id}")
                    return None
            return user

        def _readable(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and self._user() != repo.owner):
                self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
                return None
            return repo

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.requests.append((method, path, self.headers.get("Authorization")))
            for pattern, name in ROUTES:
                if pattern[0] == method and (m := re.fullmatch(pattern[1], path)):
                    if self._inject(name):
                        return None
                    return getattr(self, name)(**m.groupdict(), query=parse_qs(url.query))
            self._error(404, f"no route for {method} {path} in the test hub")

        def _inject(self, route: str) -> bool:
            """Answer with the failure ``hub.fail`` holds for this route, if any."""
            failure = hub.fail.get(route) if route != "commit" else None
            if failure is None:
                return False
            self._body()  # read the request so that the client sees the answer, not a reset
            if failure == "drop":  # close the connection without an answer
                self.close_connection = True
                self.connection.shutdown(2)
            elif failure == "echo":  # a careless server quoting the request's headers back
                auth = self.headers.get("Authorization", "")
                self._error(400, f"Bad request: headers were {{'authorization': '{auth}'}}")
            else:
                self._error(int(failure), f"injected failure {failure}")
            return True

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_POST(self) -> None:
            self._route("POST")

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_DELETE(self) -> None:
            self._route("DELETE")

        # -- upload --------------------------------------------------------------------------

        def create_repo(self, query) -> None:
            payload = json.loads(self._body())
            user = self._writer()
            if user is None:
                return
            owner = payload.get("organization") or user
            repo_id = f"{owner}/{payload['name']}"
            if owner != user:
                self._error(403, f"You don't have the rights to create a model under {owner}")
                return
            with hub.lock:
                if repo_id in hub.repos:
                    self._json(
                        409,
                        {
                            "error": "You already created this model repo",
                            "url": f"{hub.url}/{repo_id}",
                        },
                    )
                    return
                private = payload.get("visibility") == "private" or bool(payload.get("private"))
                hub.repos[repo_id] = Repo(owner=owner, private=private)
            self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def delete_repo(self, query) -> None:
            payload = json.loads(self._body())
            user = self._writer()
            if user is None:
                return
            repo_id = f"{payload.get('organization') or user}/{payload['name']}"
            with hub.lock:
                repo = hub.repos.get(repo_id)
                if repo is None or repo.owner != user:
                    self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
                    return
                del hub.repos[repo_id]
            self._json(200, {})

        def validate_yaml(self, query) -> None:
            content = json.loads(self._body())["content"]
            try:
                if content.startswith("---"):
                    yaml.safe_load(content[3:].split("\n---", 1)[0])
            except yaml.YAMLError as e:
                self._json(400, {"errors": [{"message": str(e)}], "warnings": []})
                return
            self._json(200, {"errors": [], "warnings": []})

        def preupload(self, repo, rev, query) -> None:
            payload = json.loads(self._body())
            if self._writer(repo) is None:
                return
            current = hub.repos[repo].files(rev)
            existing = current[1] if current else {}
            files = []
            for f in payload["files"]:
                lfs = hub.lfs_threshold is not None and f["size"] >= hub.lfs_threshold
                entry = existing.get(f["path"])
                oid = None if entry is None else (entry.sha256 if entry.lfs else entry.blob)
                files.append(
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": oid,
                    }
                )
            self._json(200, {"files": files, "commitOid": current[0] if current else None})

        def lfs_batch(self, repo, query) -> None:
            payload = json.loads(self._body())
            if self._writer(repo) is None:
                return
            objects = []
            for obj in payload["objects"]:
                out = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                if not hub.has_object(obj["oid"]):
                    out["actions"] = {
                        "upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"},
                        "verify": {"href": f"{hub.url}/lfs-verify"},
                    }
                objects.append(out)
            self._json(200, {"transfer": "basic", "objects": objects})

        def lfs_upload(self, oid, query) -> None:
            data = self._body()
            if hashlib.sha256(data).hexdigest() != oid:
                self._error(400, "uploaded bytes do not match the LFS oid")
                return
            hub.store(data)
            self._send(200)

        def lfs_verify(self, query) -> None:
            obj = json.loads(self._body())
            ok = hub.has_object(obj["oid"]) and len(hub.read(obj["oid"])) == obj["size"]
            self._json(200 if ok else 404, {"verified": ok})

        def commit(self, repo, rev, query) -> None:
            lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
            if self._writer(repo) is None:
                return
            if "commit" in hub.fail:
                self._error(hub.fail["commit"], "A commit is already in progress on this repo")
                return
            with hub.lock:
                current = hub.repos[repo].files(rev)
                files = dict(current[1]) if current else {}
                parent = lines[0]["value"].get("parentCommit")
                if parent is not None and current is not None and parent != current[0]:
                    self._error(412, "parentCommit is not the head of the branch")
                    return
                for op in lines[1:]:
                    value = op["value"]
                    if op["key"] == "file":
                        data = base64.b64decode(value["content"])
                        files[value["path"]] = Entry(
                            len(data), git_blob_oid(data), hub.store(data), lfs=False
                        )
                    elif op["key"] == "lfsFile":
                        if not hub.has_object(value["oid"]):
                            self._error(400, f"LFS object of {value['path']} was never uploaded")
                            return
                        pointer = (
                            f"version https://git-lfs.github.com/spec/v1\noid sha256:"
                            f"{value['oid']}\nsize {value['size']}\n"
                        ).encode()
                        files[value["path"]] = Entry(
                            value["size"], git_blob_oid(pointer), value["oid"], lfs=True
                        )
                    elif op["key"] == "deletedFile":
                        files.pop(value["path"], None)
                    else:
                        self._error(400, f"unsupported commit operation {op['key']}")
                        return
                sha = hashlib.sha1(f"{repo}{time.time_ns()}{sorted(files)}".encode()).hexdigest()
                hub.repos[repo].commits.append((sha, files))
            self._json(
                200,
                {
                    "commitUrl": f"{hub.url}/{repo}/commit/{sha}",
                    "commitOid": sha,
                    "pullRequestUrl": None,
                },
            )

        def xet_token(self, repo, rev, query) -> None:
            self._error(501, "the test hub does not speak Xet: set HF_HUB_DISABLE_XET=1")

        # -- download ------------------------------------------------------------------------

        def _revision(self, repo_id: str, rev: str):
            repo = self._readable(repo_id)
            if repo is None:
                return None
            found = repo.files(rev)
            if found is None:
                self._error(404, f"Revision {rev} not found", "RevisionNotFound")
            return found

        def model_info(self, repo, query, rev="main") -> None:
            found = self._revision(repo, rev)
            if found is None:
                return
            sha, files = found
            self._json(
                200,
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": sha,
                    "private": hub.repos[repo].private,
                    "siblings": [{"rfilename": p} for p in sorted(files)],
                    "lastModified": "2025-01-01T00:00:00.000Z",
                },
            )

        def tree(self, repo, rev, query) -> None:
            found = self._revision(repo, rev)
            if found is None:
                return
            entries = []
            for path, e in sorted(found[1].items()):
                item = {"type": "file", "path": path, "size": e.size, "oid": e.blob}
                if e.lfs:
                    item["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": 130}
                entries.append(item)
            self._json(200, entries)

        def resolve(self, repo, rev, path, query, head: bool = False) -> None:
            found = self._revision(repo, rev)
            if found is None:
                return
            sha, files = found
            entry = files.get(path)
            if entry is None:
                self._error(404, f"Entry {path} not found", "EntryNotFound")
                return
            data = hub.read(entry.sha256)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.blob}"', "Accept-Ranges": "bytes"}
            if entry.lfs:
                headers |= {"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)}
            status = 200
            ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if ranged and not head:
                start = int(ranged[1])
                end = int(ranged[2]) if ranged[2] else len(data) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data, status = data[start : end + 1], 206
            self._send(status, data, headers, "application/octet-stream", head=head)

        def resolve_head(self, repo, rev, path, query) -> None:
            self.resolve(repo, rev, path, query, head=True)

    ROUTES = [
        (("POST", r"/api/repos/create"), "create_repo"),
        (("DELETE", r"/api/repos/delete"), "delete_repo"),
        (("POST", r"/api/validate-yaml"), "validate_yaml"),
        (("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)"), "preupload"),
        (("POST", rf"/{REPO}\.git/info/lfs/objects/batch"), "lfs_batch"),
        (("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})"), "lfs_upload"),
        (("POST", r"/lfs-verify"), "lfs_verify"),
        (("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)"), "commit"),
        (("GET", rf"/api/models/{REPO}/xet-write-token/(?P<rev>[^/]+)"), "xet_token"),
        (("GET", rf"/api/models/{REPO}/revision/(?P<rev>[^/]+)"), "model_info"),
        (("GET", rf"/api/models/{REPO}"), "model_info"),
        (("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/.*)?"), "tree"),
        (("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "resolve"),
        (("HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "resolve_head"),
    ]
    return Handler
