"""A stand-in broadcast member for tests/posttrain/test_weight_broadcast.py: an HTTP server whose
``POST /update_weights`` joins the update's group as the real server does
(:mod:`megatron_s2.inference.weight_broadcast`) and receives buckets — then, in mode ``die``,
kills its own process after the first bucket (a server dying mid-broadcast), or in mode
``refuse`` answers 400 before joining (a manifest the server's model does not fit).

    python broadcast_member.py PORT_FILE MODE BUCKET_BYTES
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch

import megatron_s2.inference.weight_broadcast as wb


class Member(BaseHTTPRequestHandler):
    mode = "die"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(200, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "refuse":
            return self._answer(400, b'{"error": {"message": "broadcast.tensors: shape mismatch", "code": 400}}')
        spec = wb.BroadcastSpec(**body["broadcast"]["group"])
        manifest = [wb.TensorEntry.from_json(item) for item in body["broadcast"]["tensors"]]
        group = wb.join_group(spec)
        for bucket in wb.buckets(manifest):
            flat = torch.empty(sum(wb._numel(e.shape) for e in bucket), dtype=getattr(torch, bucket[0].dtype))
            group.broadcast(flat, 0).wait()
            os._exit(9)  # dies with the first bucket received, the others still to come

    def _answer(self, code: int, out: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


if __name__ == "__main__":
    port_file, Member.mode, wb.BUCKET_BYTES = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    server = HTTPServer(("127.0.0.1", 0), Member)
    port_file.write_text(str(server.server_port))
    server.serve_forever()
