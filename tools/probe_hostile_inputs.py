"""Hostile inputs sent one at a time to a server built by whichever `specdec` is imported: status, the field
named and the time of each (docs/reliability.md compares two commits with it).

    PYTHONPATH=/path/to/other/checkout python tools/probe_hostile_inputs.py --model smollm2-135m
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import uvicorn

from specdec import LLM
from specdec.serving.server import create_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=8777)
    args = ap.parse_args()
    app = create_app(LLM(args.model), "probe", None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    chat = {"model": "probe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ("temperature 7", "/v1/chat/completions", chat | {"temperature": 7}),
        ("role wizard", "/v1/chat/completions", chat | {"messages": [{"role": "wizard", "content": "Hi"}]}),
        ("lone surrogate", "/v1/chat/completions",
         json.dumps(chat | {"messages": [{"role": "user", "content": "\ud800"}]})),
        ("5,000 stop strings", "/v1/chat/completions", chat | {"stop": [str(i) for i in range(5000)]}),
        ("max_tokens 1e9", "/v1/chat/completions", chat | {"max_tokens": 10**9}),
        ("3 MiB prompt", "/v1/completions", {"model": "probe", "prompt": "x" * (3 * 2**20), "max_tokens": 1}),
        ("20 MB body", "/v1/completions", {"model": "probe", "prompt": "hello " * (20 * 2**20 // 6), "max_tokens": 1}),
        ("no max_tokens", "/v1/completions", {"model": "probe", "prompt": "Tell me a story.", "temperature": 0,
                                              "ignore_eos": True}),
    ]
    for name, path, body in cases:
        start = time.perf_counter()
        kw = {"json": body} if isinstance(body, dict) else {"content": body,
                                                            "headers": {"content-type": "application/json"}}
        try:
            r = httpx.post(f"http://127.0.0.1:{args.port}{path}", timeout=5 if name == "no max_tokens" else 600, **kw)
        except httpx.ReadTimeout:
            print(f"{name}: still generating after 5 s")
            continue
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        print(f"{name}: HTTP {r.status_code} param={err.get('param')} in {time.perf_counter() - start:.2f} s; "
              f"{str(err.get('message'))[:90]}")
    server.should_exit = True


if __name__ == "__main__":
    main()
