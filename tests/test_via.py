"""``--via``: the probe's requests made by the stdlib agent on the far side of a command prefix.

Every test spawns real processes: the CLI, the prefix (sh, env, a stand-in ``ssh`` that re-parses
its command line with a shell as sshd does), the agent, and a real HTTP server on loopback.
The server comes from conftest's ``probe_target`` fixture; tests that need a server-side failure
mode (a slow answer) use the STAND-IN server explicitly, since only it can be told to misbehave.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_diag.backends import via
from ddtree_diag.errors import UsageError
from tests.support.processes import ROOT, free_port, sigint_default

SH_HOP = "sh -c 'exec \"$@\"' sh"  # a plain local shell: passes the words on untouched


@pytest.fixture
def target(probe_target) -> str:
    return probe_target  # tests/conftest.py picks the server


@pytest.fixture
def fake_ssh(tmp_path) -> str:
    """A local `ssh`: drops the host and lets a shell re-parse the joined words, as sshd does."""
    script = tmp_path / "ssh"
    script.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')
    script.chmod(0o755)
    return str(script)


def python_named(tmp_path: Path, version: str) -> str | None:
    """A PATH folder whose `python3` is Python VERSION (pyenv or system), or None if absent."""
    candidates = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    which = shutil.which(f"python{version}")
    if which and "shims" not in which:  # pyenv shims are scripts that need pyenv itself
        candidates.append(Path(which))
    found = candidates[0] if candidates else None
    if found is None:
        return None
    folder = tmp_path / f"py{version}"
    folder.mkdir()
    (folder / "python3").symlink_to(found)
    return str(folder)


# Few, short cases: cheap on a real model server too (the smoke matrix's budgets, thinking off).
SMALL = ("--thinking", "off", "--max-tokens", "16")


def probe(cli, url, *args, via_prefix=None):
    extra = ["--via", via_prefix] if via_prefix is not None else []
    result = cli("probe", "--url", url, *extra, "--json", "-", *SMALL, *args)
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def comparable(report: dict) -> list[tuple]:
    """What must not change when the requests travel through a pipe."""
    return [
        (r["case"]["case_id"], r["status"], r["output"], r["finish_reason"], r["completion_tokens"],
         r["spec"]["decode_rounds"], r["spec"]["mean_acceptance_length"])
        for r in report["results"]
    ]


# -- the happy paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix",
    ["env", SH_HOP, f"{SH_HOP} {SH_HOP}", "{ssh} gpu-host", "{ssh} jump-host {ssh} gpu-host env"],
    ids=["env", "sh-hop", "two-sh-hops", "ssh", "ssh-in-ssh"],
)
def test_via_prefix_gives_the_same_results_as_a_direct_probe(cli, target, fake_ssh, prefix):
    prefix = prefix.format(ssh=fake_ssh, SH_HOP=SH_HOP)
    direct_result, direct = probe(cli, target)
    assert direct_result.code == 0, direct_result.stderr
    result, report = probe(cli, target, via_prefix=prefix)
    assert result.code == 0, result.stderr
    assert comparable(report) == comparable(direct)
    assert report["target"]["dialect"] == direct["target"]["dialect"]
    assert report["target"]["via"]["command"] == prefix
    assert report["target"]["via"]["agent_python"].count(".") == 2
    assert report["target"]["via"]["pipe_round_trip_ms"] >= 0
    assert any(n.startswith("via: ") for n in report["notes"])
    for record in report["results"]:
        local, far = record["timings"], record["extras"]["via_far_side"]
        assert local["ttft_s"] is not None, "streaming kept its TTFT"
        # The agent's clock starts after the request crossed the pipe: its numbers exclude it.
        assert 0 < far["ttft_s"] <= far["e2e_s"] <= local["e2e_s"] and far["ttft_s"] <= local["ttft_s"]


def test_via_without_streaming_and_with_concurrency(cli, target):
    direct_result, direct = probe(cli, target, "--no-stream", "--budget", "1,2,3")
    result, report = probe(cli, target, "--no-stream", "--budget", "1,2,3", "--concurrency", "4",
                           via_prefix=SH_HOP)
    assert direct_result.code == 0 and result.code == 0, result.stderr
    assert len(report["results"]) == 3
    assert comparable(report) == comparable(direct)


def test_agent_runs_on_python_3_8(cli, target, tmp_path):
    folder = python_named(tmp_path, "3.8")
    if folder is None:
        pytest.skip("no Python 3.8 on this machine")
    result, report = probe(cli, target, via_prefix=f"env PATH={folder}")
    assert result.code == 0, result.stderr
    assert report["target"]["via"]["agent_python"].startswith("3.8.")
    assert all(r["status"] == "ok" for r in report["results"])


def test_agent_is_stdlib_only_python_3_8_code(target):
    source = via.agent_source()
    ast.parse(source, feature_version=(3, 8))
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    # And it works with no site-packages and no PYTHONPATH: speak the protocol to it by hand.
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ""}
    agent = subprocess.Popen([sys.executable, "-I", "-S", "-c", via.BOOTSTRAP], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        agent.stdin.write(via.agent_line())
        agent.stdin.flush()
        hello = json.loads(agent.stdout.readline())
        assert hello["event"] == "hello" and "error" not in hello
        request = {"id": 7, "method": "GET", "url": f"{target}/v1/models",
                   "headers": [["Host", target.split("//")[1]]], "timeout": {"connect": 5, "read": 5}}
        agent.stdin.write(json.dumps(request).encode() + b"\n")
        agent.stdin.flush()
        events = []
        while not events or events[-1]["event"] not in ("end", "error"):
            events.append(json.loads(agent.stdout.readline()))
        assert [e["id"] for e in events] == [7] * len(events)
        assert events[0]["event"] == "head" and events[0]["status"] == 200, events
        import base64

        body = b"".join(base64.b64decode(e["data"]) for e in events if e["event"] == "chunk")
        assert json.loads(body)["data"][0]["id"]
    finally:
        agent.stdin.close()  # EOF: the agent leaves on its own
        assert agent.wait(timeout=10) == 0
    assert agent.stderr.read() == b""


def test_shared_transport_serves_a_second_client_and_leaves_the_agent_running(target):
    from ddtree_diag.backends.http import HttpBackend
    from ddtree_diag.records import ProbeCase

    transport = via.AgentTransport(SH_HOP)
    transport.start()
    main = HttpBackend(target, transport=transport)
    second = HttpBackend(target, stream=False, transport=transport.shared())  # e.g. the baseline
    case = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "Say hi."}], max_tokens=16)
    try:
        main.prepare([case])
        second.prepare([case])
        assert second.run(case).ok
        second.close()
        assert transport._process.poll() is None, "closing the second client kept the agent"
        assert main.run(case).ok
    finally:
        main.close()
    assert transport._process.poll() is not None, "closing the owner ended the agent"


# -- what the prefix becomes -------------------------------------------------------------------


def test_agent_command_quotes_once_per_ssh_hop():
    plain = via.agent_command("pct exec 200 --")
    assert plain[:3] == ["pct", "exec", "200"] and plain[-1] == via.BOOTSTRAP
    one = via.agent_command("ssh -p 2222 root@gpu pct exec 200 --")
    assert shlex.split(" ".join(one[4:]))[-1] == via.BOOTSTRAP  # what the remote shell parses
    two = via.agent_command("ssh jump ssh gpu")
    once = shlex.split(" ".join(two[2:]))  # the first remote shell
    assert shlex.split(" ".join(once[2:]))[-1] == via.BOOTSTRAP  # the second one
    assert via.agent_command("kubectl exec -i pod -- ")[:5] == ["kubectl", "exec", "-i", "pod", "--"]


@pytest.mark.parametrize("prefix", ["ssh -t gpu", "docker exec -it box", "sh -c 'unbalanced"])
def test_bad_prefixes_are_usage_errors(prefix):
    with pytest.raises(UsageError):
        via.agent_command(prefix)


@pytest.mark.parametrize(
    "code, stderr, needle",
    [(127, "bash: line 1: python3: command not found", "python3 missing on the far side"),
     (127, "sh: 1: python3: not found", "python3 missing on the far side"),
     (127, "env: ‘python3’: No such file or directory", "python3 missing on the far side"),
     (126, 'OCI runtime exec failed: exec failed: unable to start container process: exec: "python3": '
           "executable file not found in $PATH: unknown", "python3 missing on the far side"),
     (1, 'lxc-attach: 200: attach.c: lxc_attach_run_command: Failed to exec "python3"',
      "python3 missing on the far side"),
     (127, "bash: line 1: pct: command not found", "not found on the way: bash: line 1: pct"),
     (255, "ssh: connect to host gpu port 22: Connection refused", "exited with code 255 before the agent"),
     (1, "ddtree-diag: the --via agent needs Python >= 3.8, found 3.6", "too old"),
     (2, "Unknown option: -I\nusage: /usr/bin/python2 [option] ... [-c cmd | -m mod | file | -] [arg] ...\n"
         "Try `python -h' for more information.", "too old"),
     (1, 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n  File "<string>", line 40\n'
         "SyntaxError: invalid syntax", "cannot parse the agent, so it is probably too old")],
)
def test_startup_failures_get_one_clear_line(code, stderr, needle):
    message = via.startup_failure(code, ["", *stderr.split("\n"), ""])
    assert needle in message and "\n" not in message


ECHO = f"python3 -I -S -c {via.BOOTSTRAP}"


@pytest.mark.parametrize(
    "code, stderr, needle",
    [(1, f"runner: refusing to run {ECHO!r}: permission denied",
      "runner: refusing to run 'python3 -I -S -c <bootstrap>"),
     (2, f"bash: -c: line 1: syntax error near unexpected token `('\nbash: -c: line 1: `{ECHO}'",
      "bash: -c: line 1: syntax error near unexpected token"),
     (1, f"+ {ECHO}\nerror: container 200 is not running", "error: container 200 is not running"),
     (2, "Unknown option: -I", "exited with code 2 before the agent started: Unknown option: -I")],
)
def test_an_echoed_start_up_command_is_not_an_old_python(code, stderr, needle):
    """The start-up command carries the version check's words; a far side that repeats it (a shell
    error, a trace, a runtime's complaint) has said nothing about its Python."""
    message = via.startup_failure(code, stderr.split("\n"))
    assert "too old" not in message and needle in message and "\n" not in message, message
    assert "sys.version_info" not in message


# -- error paths through the real CLI ----------------------------------------------------------


@pytest.mark.parametrize(
    "prefix, needle",
    [("no-such-command-xyz gpu-host", "prefix command not found: no-such-command-xyz"),
     ("env PATH=/nonexistent", "python3 missing on the far side"),
     ("sh -c 'PATH=/nonexistent; exec \"$@\"' sh", "python3 missing on the far side"),
     ("sh -c 'no-such-pct \"$@\"' sh", "not found on the way"),
     ("sh -c 'echo Connection closed by 10.0.0.7 port 22 >&2; exit 255' sh", "code 255 before the agent started")],
)
def test_prefix_failures_are_exit_3_with_one_line(cli, target, prefix, needle):
    result = cli("probe", "--url", target, "--via", prefix)
    assert result.code == 3, result.stderr
    assert needle in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr


def test_far_side_error_repeating_the_command_is_quoted_not_read_as_old_python(cli, target):
    prefix = "sh -c 'echo \"agent: cannot start: $*\" >&2; exit 1' sh"
    result = cli("probe", "--url", target, "--via", prefix)
    assert result.code == 3, result.stderr
    assert "too old" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert "exited with code 1 before the agent started: agent: cannot start: python3 -I -S -c <bootstrap>" in (
        result.stderr
    )


def test_far_side_interpreter_can_be_named(cli, target):
    result = cli("probe", "--url", target, "--via", "env", "--json", "-", *SMALL,
                 env={"DDTREE_DIAG_VIA_PYTHON": sys.executable})
    assert result.code == 0, result.stderr
    version = ".".join(map(str, sys.version_info[:3]))
    assert result.json()["target"]["via"]["agent_python"] == version
    missing = cli("probe", "--url", target, "--via", "env", env={"DDTREE_DIAG_VIA_PYTHON": "/nonexistent/python"})
    assert missing.code == 3 and "/nonexistent/python missing on the far side" in missing.stderr


def test_old_python_on_the_far_side_is_named(cli, target, tmp_path):
    folder = python_named(tmp_path, "3.6") or python_named(tmp_path, "3.7")
    if folder is None:
        pytest.skip("no Python 3.6/3.7 on this machine")
    result = cli("probe", "--url", target, "--via", f"env PATH={folder}")
    assert result.code == 3 and "too old" in result.stderr and "needs Python >= 3.8" in result.stderr


def test_terminal_flag_is_a_usage_error(cli, target):
    result = cli("probe", "--url", target, "--via", "ssh -t gpu-host")
    assert result.code == 2 and "drop -t" in result.stderr


def test_far_side_cannot_reach_the_url(cli):
    url = f"http://127.0.0.1:{free_port()}"
    result, report = probe(cli, url, "--model", "m", "--dialect", "openai", via_prefix=SH_HOP)
    assert result.code == 3
    assert report["target"]["via"]["command"] == SH_HOP, "the agent started; the server is what failed"
    assert all(r["status"] == "transport_error" and "connection refused" in r["error"] for r in report["results"])
    result = cli("probe", "--url", url, "--via", SH_HOP)  # /v1/models fails: one line
    assert result.code == 3 and "connection refused" in result.stderr and result.stderr.count("\n") == 1
    result, report = probe(cli, "http://no-such-host.invalid:8000", "--model", "m", "--dialect", "openai",
                           "--thinking", "off", via_prefix="env")
    assert result.code == 3 and "cannot resolve host" in report["results"][0]["error"]


def test_far_side_read_timeout_is_a_timeout(standin, cli):
    server = standin("--dialect", "vllm")  # the stand-in can be told to answer slowly
    result, report = probe(cli, server.url, "--dialect", "vllm", "--model", "standin-model", "--timeout", "1",
                           "--prompt", "FAIL:slow please", "--thinking", "off", via_prefix="env")
    assert result.code == 3
    assert report["results"][0]["status"] == "timeout"


def _pid_prefix(pid_file: Path) -> str:
    # `exec` keeps the shell's pid, so the file names the agent's own process.
    return f"sh -c 'echo $$ > {pid_file}; exec \"$@\"' sh"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def _start_slow_probe(server, pid_file: Path, json_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ddtree_diag", "probe", "--url", server.url, "--dialect", "vllm",
         "--model", "standin-model", "--prompt", "Say hi.", "--prompt", "FAIL:slow", "--prompt", "Say bye.",
         "--thinking", "off", "--via", _pid_prefix(pid_file), "--json", str(json_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=sigint_default,
    )


def _wait_for_slow_request(server) -> None:
    deadline = time.time() + 30
    while time.time() < deadline and not any("FAIL:slow" in str(r) for r in server.requests()):
        time.sleep(0.05)
    time.sleep(0.2)


def test_agent_killed_mid_run_keeps_partial_results(standin, tmp_path):
    server = standin("--dialect", "vllm")  # FAIL:slow keeps a request in flight while we kill
    pid_file, json_path = tmp_path / "agent.pid", tmp_path / "run.json"
    process = _start_slow_probe(server, pid_file, json_path)
    _wait_for_slow_request(server)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err
    results = json.loads(json_path.read_text())["results"]
    assert [r["status"] for r in results] == ["ok", "transport_error", "transport_error"]
    assert results[0]["output"]
    assert all("--via process ended (killed by signal 9)" in r["error"] for r in results[1:])


def test_ctrl_c_stops_the_agent_too(standin, tmp_path):
    server = standin("--dialect", "vllm")
    pid_file, json_path = tmp_path / "agent.pid", tmp_path / "run.json"
    process = _start_slow_probe(server, pid_file, json_path)
    _wait_for_slow_request(server)
    agent_pid = int(pid_file.read_text())
    assert _alive(agent_pid)
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert json.loads(json_path.read_text())["interrupted"] is True
    deadline = time.time() + 10
    while _alive(agent_pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(agent_pid), "the agent outlived the tool"


def test_via_is_refused_with_the_engine(cli):
    result = cli("probe", "--engine", "--via", "env")
    assert result.code == 2 and "--via works with --url only" in result.stderr
