"""serve-pair's command line: one-line user errors with their exit codes, and its processes
(started, reported when they die, stopped with every process of their group)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.errors import UserError
from kvtool import procs

runner = CliRunner()


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code not in (0, None)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_cli_missing_model_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    result = runner.invoke(app, ["serve-pair", "--model", str(missing), "--log-dir", str(tmp_path / "logs")])
    assert_one_line_error(result, str(missing), "--model")
    assert result.exit_code == 2


def test_cli_port_in_use_is_one_line(tmp_path, model_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # Every other port free too: the defaults may be taken by whatever else runs on the machine.
        others = [(f"--{flag}-port", str(procs.find_free_port())) for flag in ("producer", "master", "admin", "store")]
        argv = ["serve-pair", "--model", str(model_dir), "--consumer-port", str(port), "--log-dir", str(tmp_path / "l")]
        result = runner.invoke(app, argv + [item for pair in others for item in pair])
    assert_one_line_error(result, f"port {port} is already in use", "--consumer-port")


def test_cli_unknown_connector_is_one_line(tmp_path, model_dir):
    result = runner.invoke(app, ["serve-pair", "--model", str(model_dir), "--connector", "nope"])
    assert_one_line_error(result, "--connector", "kvtool")


def test_cli_unknown_roles_is_one_line(tmp_path, model_dir):
    result = runner.invoke(app, ["serve-pair", "--model", str(model_dir), "--roles", "kv_both"])
    assert_one_line_error(result, "--roles 'kv_both' is not one of: pd, both")


def test_cli_roles_both_without_a_connector_is_one_line(tmp_path, model_dir):
    result = runner.invoke(
        app,
        ["serve-pair", "--model", str(model_dir), "--connector", "none", "--roles", "both"]
        + ["--log-dir", str(tmp_path / "l")],
    )
    assert_one_line_error(result, "--roles both needs a connector")
    assert result.exit_code == 2


def test_cli_missing_binary_is_one_line(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr("kvtool.pair.engines.sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    ports = [str(procs.find_free_port()) for _ in range(4)]
    result = runner.invoke(
        app,
        ["serve-pair", "--model", str(model_dir), "--log-dir", str(tmp_path / "l")]
        + [
            "--producer-port",
            ports[0],
            "--consumer-port",
            ports[1],
            "--master-port",
            ports[2],
            "--admin-port",
            ports[3],
        ],
    )
    assert_one_line_error(result, "mooncake_master was not found")
    assert result.exit_code == 1


def test_process_set_reports_a_dead_process_with_its_log(tmp_path):
    processes = procs.ProcessSet(tmp_path)
    try:
        processes.start(
            "flaky",
            ["sh", "-c", "echo starting; echo boom >&2; exit 3"],
            readiness=procs.ReadinessCheck(tcp_port=procs.find_free_port()),
        )
        with pytest.raises(procs.ServerError) as caught:
            processes.wait_ready(processes.processes, timeout_s=10, poll_s=0.05)
    finally:
        processes.stop_all()
    assert "flaky" in caught.value.message and "exited with code 3" in caught.value.message
    assert str(tmp_path / "flaky.log") in caught.value.message
    assert "boom" in caught.value.details


def test_stop_all_leaves_no_process_of_the_group(tmp_path):
    processes = procs.ProcessSet(tmp_path)
    # The shell ignores SIGTERM and its background child would outlive it: both must still go.
    started = tmp_path / "child.pid"
    leader = processes.start("stubborn", ["sh", "-c", f"trap '' TERM; sleep 60 & echo $! > {started}; wait"])
    for _ in range(1000):  # the trap is set once the child's pid is written (at most 10 s)
        if started.exists() and started.read_text().strip():
            break
        time.sleep(0.01)
    child = int(started.read_text())
    processes.stop_all(grace_s=0.5)
    assert leader.exit_code() is not None
    assert not procs._group_alive(leader.pid)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_missing_executable_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="was not found"):
        procs.ProcessSet(tmp_path).start("ghost", [str(tmp_path / "no-such-binary")])
