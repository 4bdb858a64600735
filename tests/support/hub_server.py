"""A tiny local stand-in for the Hugging Face Hub, enough for the real `huggingface_hub` client to push models
(`push_to_hub`, `create_repo`, `upload_folder`) and load them (`from_pretrained`, `hf_hub_download`,
`snapshot_download`) without a network.

It speaks the Hub's HTTP API for model repositories on the `main` branch: files are committed "regular"
(base64 inside the commit, never LFS/Xet), kept content-addressed under a folder, and every commit is kept,
so a download by commit hash sees that commit's files. Requests it does not know are logged and answered 404;
`HubServer.unknown_requests` lists them.

Use it from another process: huggingface_hub reads `HF_ENDPOINT` once, at import.

```python
with HubServer(tmp_path) as hub:
    env = {**os.environ, **hub.client_env(tmp_path / "hf_home")}
    subprocess.run([sys.executable, "push.py"], env=env, check=True, timeout=120)
```
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 30  # requests larger than this are refused, which also bounds chunked reads
SOCKET_TIMEOUT_S = 30
DEFAULT_NAMESPACE = "user"  # owner of repos created without one, as if the token belonged to "user"


class HubError(Exception):
    """An error answered to the client with the Hub's `X-Error-Code` header."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Commit:
    oid: str
    summary: str
    files: dict[str, str]  # path in repo -> sha256 of its content (the blob's name)


@dataclass
class Repo:
    commits: list[Commit] = field(default_factory=list)  # oldest first; the last is `main`

    def resolve(self, revision: str) -> Commit:
        if revision == "main":
            return self.commits[-1]
        for commit in self.commits:
            if len(revision) >= 7 and commit.oid.startswith(revision):
                return commit
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")


class HubState:
    """The repositories, with file contents stored once per distinct content under `root/blobs`."""

    def __init__(self, root: Path):
        self.blobs = root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()

    def create_repo(self, repo_id: str) -> bool:
        """Create `repo_id` with one empty commit; False when it already exists."""
        with self.lock:
            if repo_id in self.repos:
                return False
            self.repos[repo_id] = Repo([Commit(_new_oid(repo_id, "initial"), "initial commit", {})])
            return True

    def repo(self, repo_id: str) -> Repo:
        try:
            return self.repos[repo_id]
        except KeyError:
            raise HubError(404, "RepoNotFound", f"Repository not found: {repo_id}") from None

    def commit(self, repo_id: str, summary: str, added: dict[str, bytes], deleted: list[str]) -> Commit:
        for content in added.values():
            digest = hashlib.sha256(content).hexdigest()
            (self.blobs / digest).write_bytes(content)
        with self.lock:
            repo = self.repo(repo_id)
            files = dict(repo.commits[-1].files)
            for path in deleted:
                for existing in [p for p in files if p == path or p.startswith(path.rstrip("/") + "/")]:
                    del files[existing]
            files.update({path: hashlib.sha256(content).hexdigest() for path, content in added.items()})
            commit = Commit(_new_oid(repo_id, summary), summary, files)
            repo.commits.append(commit)
            return commit

    def read(self, digest: str) -> bytes:
        return (self.blobs / digest).read_bytes()


def _new_oid(*parts: str) -> str:
    return hashlib.sha1("\0".join([*parts, repr(time.time_ns())]).encode()).hexdigest()


class HubRequestHandler(BaseHTTPRequestHandler):
    """Routes each request to a method named after the Hub endpoint; see `ROUTES` at the bottom."""

    server_version = "LocalHub/0.1"
    timeout = SOCKET_TIMEOUT_S  # bounds every read from the client socket

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        logger.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        try:
            body = self._read_body()
            for route_method, matcher, handler in ROUTES:
                if route_method == method and (args := matcher(path)) is not None:
                    handler(self, *args, query=parse_qs(url.query), body=body)
                    return
            self.hub.unknown_requests.append(f"{method} {self.path}")
            logger.warning("local hub: unknown request %s %s", method, self.path)
            raise HubError(404, None, f"local hub does not implement {method} {url.path}")
        except HubError as error:
            self._send_json({"error": error.message}, error.status, error.code)
        except (ValueError, KeyError) as error:
            logger.warning("local hub: bad request %s %s: %r", method, self.path, error)
            self._send_json({"error": f"bad request: {error!r}"}, 400)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise HubError(413, None, f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        return self.rfile.read(length)

    def _read_chunked(self) -> bytes:
        chunks, total = [], 0
        while True:  # ends at the zero-size chunk; MAX_BODY_BYTES and the socket timeout bound it
            size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline(1024)  # the empty line after the last chunk
                return b"".join(chunks)
            total += size
            if total > MAX_BODY_BYTES:
                raise HubError(413, None, f"chunked body exceeds {MAX_BODY_BYTES} bytes")
            chunks.append(self.rfile.read(size))
            self.rfile.readline(1024)  # CRLF after each chunk

    def _send_json(self, payload, status: int = 200, error_code: str | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", payload.get("error", ""))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    # --- endpoints -------------------------------------------------------------------------------------------

    def create_repo(self, *, query, body):
        request = json.loads(body or b"{}")
        if request.get("type") not in (None, "model"):
            raise HubError(400, None, f"local hub only hosts models, not {request['type']!r}")
        repo_id = f"{request.get('organization') or DEFAULT_NAMESPACE}/{request['name']}"
        created = self.hub.state.create_repo(repo_id)
        payload = {"url": f"{self.hub.url}/{repo_id}", "name": repo_id}
        if not created:  # the client reads "url" from this 409 too when exist_ok=True
            payload["error"] = f"You already created this model repo: {repo_id}"
        self._send_json(payload, 200 if created else 409)

    def validate_yaml(self, *, query, body):
        self._send_json({"errors": [], "warnings": []})

    def whoami(self, *, query, body):
        self._send_json({"type": "user", "name": DEFAULT_NAMESPACE, "orgs": [], "auth": {}})

    def preupload(self, repo_id, revision, *, query, body):
        self.hub.state.repo(repo_id).resolve(revision)
        files = json.loads(body)["files"]
        self._send_json({"files": [
            {"path": item["path"], "uploadMode": "regular", "shouldIgnore": False} for item in files
        ]})

    def commit(self, repo_id, revision, *, query, body):
        if revision != "main" or query.get("create_pr"):
            raise HubError(400, None, "local hub commits to main only, without pull requests")
        summary, added, deleted = "", {}, []
        for line in filter(None, body.splitlines()):
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
            elif key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, None, f"unsupported encoding {value['encoding']!r}")
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:  # lfsFile: this server asks for "regular" uploads only
                raise HubError(400, None, f"unsupported commit operation {key!r}")
        commit = self.hub.state.commit(repo_id, summary, added, deleted)
        self._send_json({"commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit.oid}", "commitOid": commit.oid,
                         "pullRequestUrl": None})

    def model_info(self, repo_id, revision="main", *, query, body):
        commit = self.hub.state.repo(repo_id).resolve(revision)
        self._send_json({
            "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": commit.oid,
            "private": False, "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def list_tree(self, repo_id, revision, folder="", *, query, body):
        commit = self.hub.state.repo(repo_id).resolve(revision)
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        below = {path: digest for path, digest in commit.files.items() if path.startswith(prefix)}
        if prefix and not below:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries, folders = [], set()
        for path, digest in sorted(below.items()):
            rest = path[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            size = (self.hub.state.blobs / digest).stat().st_size
            entries.append({"type": "file", "path": path, "size": size, "oid": digest[:40]})
        entries += [{"type": "directory", "path": path, "oid": "0" * 40} for path in sorted(folders)]
        self._send_json(entries)

    def resolve(self, repo_id, revision, filename, *, query, body):
        commit = self.hub.state.repo(repo_id).resolve(revision)
        digest = commit.files.get(filename)
        if digest is None:
            raise HubError(404, "EntryNotFound", f"{filename} does not exist on {revision}")
        content = self.hub.state.read(digest)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(content)))
        self.send_header("ETag", f'"{digest}"')
        self.send_header("X-Repo-Commit", commit.oid)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(content)


def _match_exact(target: str):
    return lambda path: () if path == target else None


def _match_model_info(path: str):
    segments = path.split("/")
    if segments[:3] != ["", "api", "models"]:
        return None
    if len(segments) == 5:
        return ("/".join(segments[3:5]),)
    if len(segments) == 7 and segments[5] == "revision":
        return ("/".join(segments[3:5]), segments[6])
    return None


def _match_tree(path: str):
    segments = path.split("/")
    if segments[:3] != ["", "api", "models"] or len(segments) < 7 or segments[5] != "tree":
        return None
    return ("/".join(segments[3:5]), segments[6], "/".join(segments[7:]))


def _match_resolve(path: str):
    segments = path.split("/")
    if len(segments) < 6 or segments[3] != "resolve" or segments[1] == "api":
        return None
    return ("/".join(segments[1:3]), segments[4], "/".join(segments[5:]))


def _match_repo_action(action: str):
    def match(path: str):
        segments = path.split("/")
        if segments[:3] == ["", "api", "models"] and len(segments) == 7 and segments[5] == action:
            return ("/".join(segments[3:5]), segments[6])
        return None

    return match


ROUTES = [
    ("POST", _match_exact("/api/repos/create"), HubRequestHandler.create_repo),
    ("POST", _match_exact("/api/validate-yaml"), HubRequestHandler.validate_yaml),
    ("GET", _match_exact("/api/whoami-v2"), HubRequestHandler.whoami),
    ("POST", _match_repo_action("preupload"), HubRequestHandler.preupload),
    ("POST", _match_repo_action("commit"), HubRequestHandler.commit),
    ("GET", _match_model_info, HubRequestHandler.model_info),
    ("GET", _match_tree, HubRequestHandler.list_tree),
    ("HEAD", _match_resolve, HubRequestHandler.resolve),
    ("GET", _match_resolve, HubRequestHandler.resolve),
]


class HubServer:
    """The local Hub, serving from a background thread on 127.0.0.1 at a free port.

    Args:
        root: folder for the stored file contents.
    """

    def __init__(self, root: str | Path):
        self.state = HubState(Path(root))
        self.unknown_requests: list[str] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), HubRequestHandler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        host, port = self._httpd.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                         name="local-hub", daemon=True)

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout_s)
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def client_env(self, cache_dir: str | Path) -> dict[str, str]:
        """Environment for a client process: this endpoint, a dummy token (the client insists on one), its own
        cache, no telemetry, and online mode (`HF_HUB_OFFLINE=1` would refuse even this local server)."""
        return {"HF_ENDPOINT": self.url, "HF_TOKEN": "dummy", "HF_HOME": str(cache_dir),
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
                "HF_HUB_DISABLE_XET": "1"}

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of `repo_id` at `revision`, path -> content."""
        commit = self.state.repo(repo_id).resolve(revision)
        return {path: self.state.read(digest) for path, digest in commit.files.items()}
