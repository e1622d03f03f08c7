"""The fork server: workers start with torch imported and show their own command line; a
request marked ``compiler`` (a Leto trainer) gets ``torch._dynamo`` loaded too, once the
compiler server is ready; any other never does (``leto.forkserver``: a served DDP script on
gloo could hang at exit)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.launcher.harness import REPO, _env

WORKER = textwrap.dedent(
    """
    import json, os, sys
    with open(sys.argv[1], "w") as f:
        json.dump({"torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                   "cwd": os.getcwd(), "marker": os.environ.get("MARKER"),
                   "orig_argv": sys.orig_argv,
                   "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode()}, f)
    """
)

# The client runs in a process of its own: ForkServer makes its process a child subreaper.
CLIENT = textwrap.dedent(
    """
    import json, os, sys, time
    from leto.forkserver import ForkServer

    worker, out = sys.argv[1], sys.argv[2]
    server = ForkServer()

    def run(compiler, name):
        path = os.path.join(out, name)
        pid = server.spawn([sys.executable, "-u", worker, path], {"MARKER": name},
                           1, 2, compiler=compiler)
        _, status = os.waitpid(pid, 0)  # re-parented to this process
        assert os.waitstatus_to_exitcode(status) == 0
        with open(path) as f:
            return json.load(f)

    seen = {"plain": run(False, "plain")}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the compiler server is ready
        seen["compiler"] = run(True, "compiler")
        if seen["compiler"]["dynamo"]:
            break
        time.sleep(0.2)
    seen["plain_after"] = run(False, "plain_after")
    pid = server.proc.pid  # its one child left is the compiler server: killed, the server serves
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        (compiler_server,) = map(int, f.read().split())
    os.kill(compiler_server, 9)
    seen["compiler_dead"] = run(True, "compiler_dead")
    server.close()
    print(json.dumps(seen))
    """
)


def _client(code: str, *args: object) -> str:
    """The last line ``code`` prints, run in a process of its own (it must succeed)."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_compiler_requests_get_dynamo_and_others_never(tmp_path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    seen = json.loads(_client(CLIENT, worker, tmp_path))
    for name, worker_saw in seen.items():
        assert worker_saw["torch"], f"{name}: torch was not imported before the script"
        assert worker_saw["marker"] == name, f"{name}: the request's environment was not set"
        assert worker_saw["cwd"] == str(REPO)
        argv = [sys.executable, "-u", str(worker), str(tmp_path / name)]
        assert worker_saw["cmdline"] == "\0".join(argv), f"{name}: ps shows the server's command"
        assert worker_saw["orig_argv"] == argv
    assert seen["compiler"]["dynamo"], "the compiler server never served a request"
    assert not seen["plain"]["dynamo"] and not seen["plain_after"]["dynamo"], (
        "a worker not marked compiler started with torch._dynamo loaded"
    )
    assert not seen["compiler_dead"]["dynamo"]  # served by the server itself


EXITING = textwrap.dedent(
    """
    import atexit, concurrent.futures, sys, threading, time
    pool = concurrent.futures.ThreadPoolExecutor(2)  # idle workers once this is done (Inductor's)
    pool.submit(time.sleep, 0).result()
    done = []
    threading.Thread(target=lambda: (time.sleep(0.3), done.append(1))).start()
    atexit.register(lambda: open(sys.argv[1], "w").write(str(len(done))))
    """
)

EXIT_CLIENT = textwrap.dedent(
    """
    import os, signal, sys, time
    from leto.forkserver import ForkServer

    worker, path = sys.argv[1], sys.argv[2]
    server = ForkServer()
    pid = server.spawn([sys.executable, "-u", worker, path], {}, 1, 2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print(os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("hung")
    server.close()
    """
)


def test_a_served_script_exits_as_the_interpreter_would(tmp_path) -> None:
    """Thread pools' exit callbacks run before non-daemon threads are joined (an idle pool's
    workers would wait forever otherwise), and the joins before atexit."""
    worker, out = tmp_path / "worker.py", tmp_path / "atexit.txt"
    worker.write_text(EXITING)
    assert _client(EXIT_CLIENT, worker, out) == "0", "the served script did not exit cleanly"
    assert out.read_text() == "1", "atexit ran before the script's thread was joined"
