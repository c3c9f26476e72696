"""The OpenAPI document describes the real request bodies, and a schemathesis run over it (a
bounded number of generated requests, valid and invalid, on every route) finds no 5xx and only
documented, well-formed answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_openapi_documents_the_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/generate", "GenerateRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "default" in doc["paths"][path]["post"]["responses"]  # OpenAI errors
    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    assert {"seed", "top_k", "stop_token_ids", "tool_choice", "tools"} <= set(chat["properties"])
    assert "HTTPValidationError" not in schemas  # validation errors are OpenAI 400s


def test_schemathesis_run_finds_no_5xx(server, tmp_path):
    # Keep the engine's step profiling as the run found it (the run may switch it on).
    profile = httpx.get(server.url + "/telemetry/profile", timeout=10).json()["every"]
    env = dict(
        os.environ,
        SCHEMATHESIS_HOOKS="schemathesis_hooks",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    try:
        run = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"), "run",
                server.url + "/openapi.json",
                "--checks", CHECKS,
                "--phases", "examples,fuzzing",
                "--max-examples", "12",
                "--seed", "7",
                "--workers", "1",
                "--request-timeout", "60",
                "--suppress-health-check", "all",
                "--generation-database", "none",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
        )  # fmt: skip
    finally:
        httpx.post(server.url + "/telemetry/profile", json={"every": profile}, timeout=10)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "No issues found" in out or "passed" in out.lower(), out[-3000:]
