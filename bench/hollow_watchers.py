"""The hollow-node harness's watchers (bench/hollow.py): each is one browser tab on a job
page, its websocket, counting every metric point it receives, as the suite's small mode and
the full-size runs check against what the portal stored."""

from __future__ import annotations

import json
import threading
import time

from bench.hollow_report import Stats


class Watcher(threading.Thread):
    """One browser tab on a job page: its websocket, every metric point counted."""

    def __init__(self, index: int, url: str, token: str, job_id: int, stats: Stats, stop):
        super().__init__(name=f"watcher-{index}", daemon=True)
        self.index, self.job_id, self.stats, self.stop = index, job_id, stats, stop
        self.ws_url = url.replace("http", "ws", 1).rstrip("/") + f"/ws/jobs/{job_id}/"
        self.token = token
        self.connected = threading.Event()

    def run(self) -> None:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        try:
            with connect(
                self.ws_url,
                additional_headers={"Authorization": f"Bearer {self.token}"},
                open_timeout=30,
            ) as ws:
                # Connected means subscribed: the consumer's first message ("state") comes
                # after it joined the job's group; pushes before that never reach this
                # socket, so they are not this watcher's to count (a page fetches them).
                try:
                    first = json.loads(ws.recv(timeout=60))
                except ConnectionClosed as exc:
                    # Seen in 3 of 6 full-size runs, for 1-2 of 200 watchers: the close says
                    # who closed and why.
                    sent, received = exc.sent, exc.rcvd
                    self.stats.error(
                        "watcher: closed before subscribing "
                        f"(received {received.code if received else None}, "
                        f"sent {sent.code if sent else None})"
                    )
                    self.connected.set()
                    return
                if first.get("type") != "state":
                    self.stats.error(f"watcher: first message {first.get('type')!r}")
                self.connected.set()
                while not self.stop.is_set():
                    try:
                        raw = ws.recv(timeout=0.5)
                    except TimeoutError:
                        continue
                    except ConnectionClosed:
                        self.stats.error("watcher: connection closed")
                        return
                    message = json.loads(raw)
                    arrived = time.time()
                    if "seq" in message:
                        with self.stats.lock:
                            self.stats.seqs[self.index][message.get("src")].add(message["seq"])
                    if message.get("type") != "metrics":
                        continue
                    with self.stats.lock:
                        counts = self.stats.received[self.index]
                        for p in message["points"]:
                            key = (self.job_id, p["attempt"], p["rank"], p["step"], p["name"])
                            counts[key] += 1
                            if p["name"] == "loss":
                                self.stats.lags.append(arrived - float(p["value"]))
                                sent = self.stats.sent_at.get(key[:4])
                                if sent is not None:
                                    self.stats.portal_lags.append(arrived - sent)
        except Exception as exc:  # a refused or broken connection is a measured error
            closed = ""
            if hasattr(exc, "rcvd") or hasattr(exc, "sent"):  # a ConnectionClosed: the codes
                received, sent = getattr(exc, "rcvd", None), getattr(exc, "sent", None)
                closed = (
                    f" (received {received.code if received else None}, "
                    f"sent {sent.code if sent else None})"
                )
            self.stats.error(f"watcher: {type(exc).__name__}{closed}")
            self.connected.set()
