"""A private image registry for the container tests: the read side of the OCI distribution API
(what `podman pull` asks: /v2/, manifests, blobs) over an OCI layout directory that `podman
save --format oci-dir` wrote, behind HTTP basic auth. Plain HTTP on 127.0.0.1: the engine is
told it is insecure through a registries.conf of the test's own (`registries_conf`).

It is a real peer for the engine, not a stand-in for the platform: the agent and podman are
the code under test, and they speak the same protocol to it as to any registry."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Registry:
    """Serves one image, `repository:tag`, from an OCI layout; with `username`/`password`,
    every request needs them (401 with a Basic challenge otherwise, as registries answer)."""

    def __init__(self, layout: Path, repository: str, tag: str, username: str, password: str):
        index = json.loads((layout / "index.json").read_text())
        self.manifest_digest = index["manifests"][0]["digest"]
        self.manifest_type = index["manifests"][0]["mediaType"]
        self.layout = layout
        self.repository, self.tag = repository, tag
        self.auth = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.host = f"127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def image(self) -> str:
        return f"{self.host}/{self.repository}:{self.tag}"

    def start(self) -> Registry:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def registries_conf(self, path: Path) -> Path:
        """A registries.conf (CONTAINERS_REGISTRIES_CONF) that lets the engine use plain HTTP
        with this registry, and nothing else."""
        path.write_text(f'[[registry]]\nlocation = "{self.host}"\ninsecure = true\n')
        return path

    def _blob(self, digest: str) -> Path | None:
        algorithm, _, hexdigest = digest.partition(":")
        path = self.layout / "blobs" / algorithm / hexdigest
        return path if hexdigest.isalnum() and path.is_file() else None

    def _handler(self):
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the suite's output stays quiet
                return

            def _reply(self, status: int, body: bytes = b"", headers: dict | None = None):
                registry.requests.append((self.command, self.path, status))
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != registry.auth:
                    challenge = 'Basic realm="lockstep-test-registry"'
                    self._reply(
                        401,
                        b'{"errors":[{"code":"UNAUTHORIZED"}]}',
                        {
                            "WWW-Authenticate": challenge,
                            "Content-Type": "application/json",
                        },
                    )
                    return
                if self.path in ("/v2/", "/v2"):
                    self._reply(200, b"{}", {"Content-Type": "application/json"})
                    return
                prefix = f"/v2/{registry.repository}/"
                if not self.path.startswith(prefix):
                    self._reply(404, b'{"errors":[{"code":"NAME_UNKNOWN"}]}')
                    return
                kind, _, reference = self.path[len(prefix) :].partition("/")
                if kind == "manifests" and reference in (registry.tag, registry.manifest_digest):
                    blob = registry._blob(registry.manifest_digest)
                    self._reply(
                        200,
                        blob.read_bytes(),
                        {
                            "Content-Type": registry.manifest_type,
                            "Docker-Content-Digest": registry.manifest_digest,
                        },
                    )
                    return
                blob = registry._blob(reference) if kind == "blobs" else None
                if blob is None:
                    self._reply(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}')
                    return
                registry.requests.append((self.command, self.path, 200))
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Docker-Content-Digest", reference)
                self.send_header("Content-Length", str(blob.stat().st_size))
                self.end_headers()
                if self.command != "HEAD":  # layers are large: streamed, not read whole
                    with blob.open("rb") as data:
                        shutil.copyfileobj(data, self.wfile, 1 << 20)

            do_HEAD = do_GET

        return Handler


def serve_local_image(
    work: Path, image: str, repository: str, username: str, password: str
) -> Registry:
    """A started registry serving the engine's local `image` as `repository:1` behind basic
    auth, with `.conf` the registries.conf an engine needs to use it over plain HTTP."""
    layout = work / "layout"
    subprocess.run(
        ["podman", "save", "--format", "oci-dir", "-o", str(layout), image],
        check=True,
        capture_output=True,
        timeout=600,
    )
    served = Registry(layout, repository, "1", username, password).start()
    served.conf = served.registries_conf(work / "registries.conf")
    return served
