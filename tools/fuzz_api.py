"""A longer schemathesis campaign than the suite's: N generated requests per operation of the server's own
OpenAPI schema, sent in-process to an app over MODEL (default: a tiny random model built on the fly, with
n-gram speculation); fails on any 5xx or response off the schema, else prints the statuses per operation.

    python tools/fuzz_api.py --examples 3000
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from specdec import LLM
from specdec.serving.api import Limits
from specdec.serving.server import create_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="generated requests per operation")
    ap.add_argument("--model", default=None, help="default: a tiny random model (tests/conftest.py)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import save_tiny_model

        model = str(save_tiny_model(Path(tempfile.mkdtemp()), "llama"))
    llm = LLM(model, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    app = create_app(llm, served_model_name="fuzz", engine_thread=False, limits=Limits(default_max_tokens=8))
    engine = app.state.server.engine
    engine.start()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    statuses: dict[str, Counter] = {}
    start = time.perf_counter()
    try:
        for result in schemathesis.openapi.from_asgi("/openapi.json", app).get_all_operations():
            operation = result.ok()
            seen = statuses.setdefault(f"{operation.method.upper()} {operation.path}", Counter())

            @settings(max_examples=args.examples, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)
            @given(operation.as_strategy())
            def fuzz(case):
                seen[case.call_and_validate(checks=checks).status_code] += 1  # noqa: B023  (runs in this iteration)

            fuzz()
    finally:
        engine.stop()
    print(f"no 5xx, every response on the schema, in {time.perf_counter() - start:.0f} s; "
          f"KV blocks held after: {llm.engine.allocator.num_used}")
    for op, counts in statuses.items():
        print(f"  {op}: " + ", ".join(f"{code} x{n}" for code, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
