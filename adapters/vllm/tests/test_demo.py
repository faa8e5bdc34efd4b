"""The vLLM demo (``python -m maskplug_vllm.demo``): its parts, then one run end to end.

The parts, without a server: every generated training answer is valid for its
task; an answer's status (finished and valid, cut off, invalid, failed) on
hand-made answers; the counts and headline; the workload's mix; the
server's process group stopped by :meth:`Server.stop` and by its lifetime
bound; options refused with exit status 2; the model cache.

End to end (one run, a short training of at most 80 steps, 16 requests): the
trained model's structured answers mostly finish and are valid and none is
invalid; the summary's counts are the per-answer statuses counted, and each
status is checked again here from the answer's text and finish reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from maskplug_vllm import demo, demo_model
from openai_server import free_port

# --- the parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "name"), demo_model.tasks())
def test_generated_answers_are_valid_for_their_task(kind: str, name: str) -> None:
    import random

    rng = random.Random(name)
    for _ in range(200):
        text = demo_model.instance(kind, name, rng)
        if kind == "json":
            jsonschema.validate(json.loads(text), demo_model.SCHEMAS[name])
        elif kind == "regex":
            assert re.fullmatch(demo_model.REGEXES[name][0], text), text
        else:
            assert text.endswith(".") and "\n" not in text, text
    p = demo_model.prompt(kind, name, rng)
    assert p.startswith(f"{name} example: ") and p.endswith(f"\n{name}:\n")


WEATHER = {"kind": "json", "name": "weather", "json": demo_model.SCHEMAS["weather"], "max_tokens": 50}
DATE = {"kind": "regex", "name": "date", "regex": demo_model.REGEXES["date"][0], "max_tokens": 20}
NOTE = {"kind": "free", "name": "note", "max_tokens": 30}
GOOD_WEATHER = '{"city": "oslo", "temperature": 3, "unit": "celsius", "conditions": ["fog"]}'


def ans(text: str, reason: str | None = "stop", error: str | None = None) -> dict[str, Any]:
    return {"text": text, "finish_reason": reason, "tokens": 5, "error": error}


@pytest.mark.parametrize(
    ("req", "answer", "status"),
    [
        (WEATHER, ans(GOOD_WEATHER), "valid"),
        # A cut-off answer is cut off whatever its text: a prefix the grammar accepts is not "valid".
        (WEATHER, ans('{"city": "oslo", "temperature":      ', "length"), "cut off"),
        (WEATHER, ans(GOOD_WEATHER, "length"), "cut off"),
        (WEATHER, ans('{"city": "oslo"'), "invalid"),
        (WEATHER, ans(GOOD_WEATHER.replace("3", "99")), "invalid"),
        (WEATHER, ans(GOOD_WEATHER.replace('"fog"', '"hail"')), "invalid"),
        (DATE, ans("2024-02-17"), "valid"),
        (DATE, ans("2024-13-17"), "invalid"),
        (DATE, ans("2024-02-17 "), "invalid"),
        (DATE, ans("2024-0", "length"), "cut off"),
        (NOTE, ans("bob has the tea."), "valid"),
        (NOTE, ans("bob has the", "length"), "cut off"),
        (WEATHER, ans("", None, error="APIConnectionError: refused"), "failed"),
        (DATE, ans("2024", "abort"), "failed"),
    ],
)
def test_classify(req: dict[str, Any], answer: dict[str, Any], status: str) -> None:
    assert demo.classify(req, answer)[0] == status


def test_summary_counts_and_headline() -> None:
    reqs = [WEATHER, WEATHER, WEATHER, DATE, DATE, NOTE, NOTE]
    answers = [
        ans(GOOD_WEATHER),
        ans('{"city": ', "length"),
        ans('{"city": "nowhere"}'),
        ans("2024-02-17"),
        ans("2024-02-17"),
        ans("bob has the tea."),
        ans("bob", "length"),
    ]
    s = demo.summarize(reqs, answers, 2.0, {"maskplug_steps_total": 4.0})
    assert s.counts == {
        "json": {"valid": 1, "cut off": 1, "invalid": 1, "failed": 0},
        "regex": {"valid": 2, "cut off": 0, "invalid": 0, "failed": 0},
        "free": {"valid": 1, "cut off": 1, "invalid": 0, "failed": 0},
    }
    assert s.headline() == "3 of 5 structured answers finished and valid (1 cut off, 1 invalid)"
    assert not s.ok()
    assert s.tokens == 35 and s.as_json()["tokens_per_second"] == 17.5
    assert [a["status"] for a in s.answers] == ["valid", "cut off", "invalid", "valid", "valid", "valid", "cut off"]
    ok = demo.summarize(reqs[:2], answers[:2], 1.0, {})
    assert ok.ok() and ok.headline() == "1 of 2 structured answers finished and valid (1 cut off, 0 invalid)"
    failed = demo.summarize([NOTE], [ans("", None, error="boom")], 1.0, {})
    assert not failed.ok()


def test_workload_mix() -> None:
    limits = {name: 40 for _, name in demo_model.tasks()}
    reqs = demo.demo_workload(16, limits)
    assert Counter(r["kind"] for r in reqs) == {"json": 8, "regex": 4, "free": 4}
    for r in reqs:
        assert r["prompt"].endswith(f"\n{r['name']}:\n") and r["max_tokens"] == 40
        if r["kind"] == "json":
            assert r["json"] == demo_model.SCHEMAS[r["name"]] and "regex" not in r
        elif r["kind"] == "regex":
            assert r["regex"] == demo_model.REGEXES[r["name"]][0] and "json" not in r
        else:
            assert "json" not in r and "regex" not in r
    # Every JSON schema and every regex is asked for.
    assert {r["name"] for r in reqs if r["kind"] == "json"} == set(demo_model.SCHEMAS)
    assert {r["name"] for r in reqs if r["kind"] == "regex"} == set(demo_model.REGEXES)


# A stand-in server: /health answers, and a child process sleeps in the same process group.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _fake(tmp_path: Path, lifetime_s: float) -> tuple[demo.Server, Path]:
    port = free_port()
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    child = tmp_path / "child.pid"
    args = [sys.executable, str(script), str(port), str(child)]
    return demo.Server(args, dict(os.environ), tmp_path / "log", port=port, start_s=60, lifetime_s=lifetime_s), child


def test_server_stop_ends_the_whole_group(tmp_path: Path) -> None:
    server, child = _fake(tmp_path, lifetime_s=300)
    with server:
        server.start()
        assert server.proc is not None
        deadline = time.monotonic() + 30
        while not child.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [server.proc.pid, int(child.read_text())]
        assert all(_alive(p) for p in pids)
    assert not any(_alive(p) for p in pids)


def test_a_group_runs_until_its_last_process_is_gone_or_a_zombie() -> None:
    """:meth:`demo.Server.stop` waits on this: a killed process not yet reaped no longer runs."""
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert demo._group_running(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while demo._group_running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not demo._group_running(proc.pid)  # a zombie until reaped: not running
        assert Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    finally:
        proc.kill()
        proc.wait()
    assert not demo._group_running(proc.pid)


def test_server_lifetime_is_bounded(tmp_path: Path) -> None:
    server, _ = _fake(tmp_path, lifetime_s=3)
    server.start()
    assert server.proc is not None
    # Nobody calls stop(): the lifetime timer ends the group.
    server.proc.wait(timeout=60)
    assert not _alive(server.proc.pid)
    server.stop()


KILLED_OWNER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from maskplug_vllm.demo import Server
    args = [sys.executable, sys.argv[1], sys.argv[2], sys.argv[3]]
    server = Server(args, dict(os.environ), Path(sys.argv[4]), port=int(sys.argv[2]), start_s=60, lifetime_s=3)
    server.start()
    print(server.proc.pid, flush=True)
    os._exit(0)  # as if killed: no stop(), no timer
    """
)


def test_server_lifetime_holds_when_its_owner_dies(tmp_path: Path) -> None:
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    owner = tmp_path / "owner.py"
    owner.write_text(KILLED_OWNER)
    child = tmp_path / "child.pid"
    args = [str(owner), str(script), str(free_port()), str(child), str(tmp_path / "log")]
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = [int(out.stdout.split()[0])]
    deadline = time.monotonic() + 30
    while not child.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    pids.append(int(child.read_text()))
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids)


def test_server_that_exits_at_start_is_reported(tmp_path: Path) -> None:
    args = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = demo.Server(args, dict(os.environ), tmp_path / "log", port=free_port(), start_s=60, lifetime_s=60)
    with server, pytest.raises(RuntimeError, match=r"exited with 3 at start:\nno model here"):
        server.start()


PORT_TAKEN_ONCE = textwrap.dedent(
    """
    import http.server, sys
    from pathlib import Path
    port = int(sys.argv[sys.argv.index("--port") + 1])
    tried = Path(sys.argv[1])
    if not tried.exists():
        tried.write_text(str(port))
        print("OSError: [Errno 98] Address already in use", flush=True)
        sys.exit(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_server_whose_port_was_taken_starts_on_another(tmp_path: Path) -> None:
    """A server that exits at start because its port was taken in the meantime is started again on another port."""
    script = tmp_path / "taken.py"
    script.write_text(PORT_TAKEN_ONCE)
    port = free_port()
    args = [sys.executable, str(script), str(tmp_path / "tried"), "--port", str(port)]
    with demo.Server(args, dict(os.environ), tmp_path / "log", port=port, start_s=60, lifetime_s=60) as server:
        server.start()
        assert (tmp_path / "tried").read_text() == str(port)
        assert server.port != port and server.args[-1] == str(server.port)
        assert server.url == f"http://127.0.0.1:{server.port}"
    # Any other failure at start, or one without a --port to change, is reported at once.
    args = [sys.executable, "-c", "import sys; print('OSError: [Errno 98] Address already in use'); sys.exit(1)"]
    server = demo.Server(args, dict(os.environ), tmp_path / "log2", port=port, start_s=60, lifetime_s=60)
    with server, pytest.raises(RuntimeError, match=r"exited with 1 at start:\nOSError: \[Errno 98\]"):
        server.start()


def test_server_command_and_environment() -> None:
    cmd = demo.server_command(Path("/m"), 8123, spec=3, max_num_seqs=8)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--load-format" not in cmd  # real weights
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    env = demo.server_env("grammar-aware:goodput")
    assert env["MASKPLUG_VLLM"] == "1" and env["MASKPLUG_VLLM_SCHEDULER"] == "grammar-aware:goodput"


def _demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maskplug_vllm.demo", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_and_bad_options() -> None:
    out = _demo("--help")
    assert out.returncode == 0
    for option in ("--requests", "--concurrency", "--scheduler", "--train-seconds", "--no-train", "--cache-dir"):
        assert option in out.stdout
    bad = _demo("--requests", "0")
    assert bad.returncode == 2 and "--requests: expected at least 1, got 0" in bad.stderr


def test_untrained_model_is_built_and_cached(tmp_path: Path) -> None:
    recipe = demo_model.Recipe(steps=0)
    folder, record = demo_model.build_model(recipe, tmp_path)
    assert folder == tmp_path / recipe.key() and not record["cached"] and record["steps"] == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    again, record2 = demo_model.build_model(recipe, tmp_path)
    assert again == folder and record2["cached"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert demo_model.Recipe(steps=1).key() != recipe.key()


# --- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("demo")
    summary = tmp / "summary.json"
    args = ["--requests", "16", "--concurrency", "8", "--train-steps", "80", "--train-seconds", "120"]
    args += ["--cache-dir", str(tmp / "cache"), "--summary-json", str(summary), "--lifetime", "400"]
    proc = _demo(*args, timeout=600)
    assert summary.is_file(), f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(summary.read_text())


def test_trained_answers_mostly_finish_and_are_valid(
    run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    proc, summary = run
    s = summary["structured"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert s["invalid"] == 0 and s["failed"] == 0
    total = sum(s.values())
    assert total == 12
    assert s["valid"] >= 0.75 * total, summary["headline"]
    assert summary["headline"] in proc.stdout
    # The server's maskplug_* series saw the run: drafts scheduled, and every step counted by regime.
    m = summary["metrics"]
    assert m["maskplug_drafts_scheduled_total"] > 0 and m["maskplug_steps_total"] > 0
    regimes = sum(m.get(f"maskplug_regime_steps_total{{regime={r}}}", 0.0) for r in ("full", "partial", "zero"))
    assert regimes == m["maskplug_structured_steps_total"] > 0
    assert m["maskplug_drafts_accepted_total"] <= m["maskplug_drafts_verified_total"]
    assert m["maskplug_drafts_verified_total"] <= m["maskplug_drafts_scheduled_total"]


def _status(a: dict[str, Any]) -> str:
    """The answer's status, decided here again from its text and finish reason."""
    if a["finish_reason"] == "length":
        return "cut off"
    if a["finish_reason"] != "stop":
        return "failed"
    if a["kind"] == "free":
        return "valid"
    if a["kind"] == "regex":
        return "valid" if re.fullmatch(demo_model.REGEXES[a["name"]][0], a["text"]) else "invalid"
    try:
        jsonschema.validate(json.loads(a["text"]), demo_model.SCHEMAS[a["name"]])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def test_summary_counts_are_the_answers_counted(
    run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    _, summary = run
    answers = summary["answers"]
    assert len(answers) == 16
    for a in answers:
        assert a["status"] == _status(a), a
        assert a["status"] != "cut off" or a["tokens"] == a["max_tokens"]
    for kind, counts in summary["counts"].items():
        assert counts == {s: sum(a["kind"] == kind and a["status"] == s for a in answers) for s in demo.STATUSES}
    assert summary["structured"] == {
        s: sum(a["kind"] != "free" and a["status"] == s for a in answers) for s in demo.STATUSES
    }
    assert summary["tokens"] == sum(a["tokens"] for a in answers)
    c = summary["structured"]
    assert summary["headline"] == (
        f"{c['valid']} of {sum(c.values())} structured answers finished and valid "
        f"({c['cut off']} cut off, {c['invalid']} invalid)"
    )
