"""Faults and the embedded server. A real MLflow server is killed in the middle of a `%%ort` run
and restarted afterwards: training is not slowed, the unsent metrics and the run's end spill to
a JSONL file, the warning names the replay command, and after `python -m ortrain.mlflow replay`
no metric is lost and the run is FINISHED. The embedded default server starts once per process,
is reused, and stops when the process exits."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from conftest import runs_of

CELL = """%%ort baseline --experiment faults --no-progress --log-every 100
import time
for i in range(30):
    x = torch.randint(0, 40, (6, 4)); y = torch.randint(0, 40, (6,))
    loss = crit(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if i == 9:
        time.sleep(1.5)           # let the background logger deliver the first steps
        kill_server()
"""


def kill(server) -> None:
    """SIGKILL the server's whole process group, as a crash would."""
    proc, server.proc = server.proc, None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_server_killed_mid_run_then_replayed(shell, mlflow_server, tmp_path, capsys):
    from ortrain._ortrain import MlflowClient

    server = mlflow_server  # the session's server: killed here, restarted on the same port and store
    try:
        shell.run_cell("import torch\nmodel = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Flatten(), "
                       "torch.nn.Linear(32, 40))\nopt = torch.optim.Adam(model.parameters())\n"
                       "crit = torch.nn.CrossEntropyLoss()")
        shell.user_ns["kill_server"] = lambda: kill(server)
        t = time.perf_counter()
        res = shell.run_cell(CELL)
        assert res.success, res.error_in_exec
        cell_s = time.perf_counter() - t
        err = capsys.readouterr().err
        assert "MLflow was unreachable" in err, err
        cmd = re.search(r"python -m ortrain\.mlflow replay (\S+) --tracking-uri (\S+)", err)
        assert cmd and cmd.group(2) == server.uri
        spill = cmd.group(1)
        assert os.path.exists(spill) and spill.startswith(str(tmp_path))
        server.start()  # same port, same sqlite store
        out = subprocess.run([sys.executable, "-m", "ortrain.mlflow", "replay", spill, "--tracking-uri", server.uri],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        c = MlflowClient(server.uri)
        (run,) = runs_of(c, "faults")
        assert run["status"] == "FINISHED"
        for key in ("loss", "batch_time_ms", "learning_rate"):
            assert [s for s, _, _ in c.get_metric_history(run["run_id"], key)] == list(range(30)), key
        print(f"cell with the server down took {cell_s:.1f}s")
    finally:
        server.start()  # no-op when alive: later tests keep their server


def test_embedded_server_starts_once_and_stops_at_exit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ORTRAIN_TRACKING_URI", "MLFLOW_TRACKING_URI")}
    code = ("import ortrain.tracking as t\n"
            "a = t.resolve_tracking_uri(); b = t.resolve_tracking_uri()\n"
            "assert a == b, (a, b)\n"
            "print('URI', a, 'PID', t.embedded_server().proc.pid)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("started a local MLflow server") == 1, out.stdout
    m = re.search(r"URI http://127\.0\.0\.1:(\d+) PID (\d+)", out.stdout)
    assert m and f"UI at http://127.0.0.1:{m.group(1)}" in out.stdout
    assert (tmp_path / "mlflow.db").exists()
    port, pid = int(m.group(1)), int(m.group(2))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), "the embedded server outlived its kernel"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
