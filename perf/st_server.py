"""sentence-transformers behind a minimal OpenAI /v1/embeddings server: the peer of `ortserve bench --scenario
embeddings` (dev-only; runs in its own venv with torch and sentence-transformers, never in ortserve's).

    /tmp/st-venv/bin/python perf/st_server.py --model FOLDER --port 8013 --threads 2

One SentenceTransformer on the CPU; each request is one ``encode(texts, batch_size=32)`` (requests take turns,
as one model in one process does); base64 or float answers, as the openai SDK asks. Standard library HTTP only.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a sentence-transformers folder")
    parser.add_argument("--name", default="sentence-transformers", help="the model id it answers to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8013)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model, device="cpu")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # NOTE(bench): headers and body are separate writes; no delayed-ACK stall

        def log_message(self, *_args) -> None:  # quiet
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": args.name, "object": "model", "created": 0,
                                                             "owned_by": "sentence-transformers"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            texts = body.get("input")
            texts = [texts] if isinstance(texts, str) else texts
            with lock:
                vectors = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
            b64 = body.get("encoding_format") == "base64"
            data = [{"object": "embedding", "index": i,
                     "embedding": base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if b64 else v.tolist()}
                    for i, v in enumerate(vectors)]
            self._send(200, {"object": "list", "data": data, "model": args.name,
                             "usage": {"prompt_tokens": 0, "total_tokens": 0}})

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
