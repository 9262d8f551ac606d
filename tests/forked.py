"""A program's command-line runs in processes forked from one that has already imported the
modules the program imports, for tests that start a program many times.

`python train.py ...` spends about 3.5 s of a 2-core machine importing jax, flax, orbax and the
input pipelines and tearing them down at exit; test_bad_input.py starts it two dozen times to
see one line and an exit status (4.5 s a run here, 0.5 s forked). A server process imports a
program's top-level imports (read from its source) before its first run and forks a child for
each run. The child is the program's process: its own argv, environment, working directory,
stdout, stderr and exit status, the program run as `__main__`, and the interpreter's way of
ending (_child). It shares with the server only the modules' import, done under the same
environment: a server's runs may differ only in XLA_FLAGS, which XLA reads when a backend
starts, not at import (a run whose other variables differ gets a server of its own). The server
never starts a JAX backend, so each child starts one with its own XLA_FLAGS (the device count),
as a new process does.

One server runs every program of one directory (train.py, sweep.py, bench.py, the converters):
a program started once in a test run then costs its own imports only, not jax's again. Its
child also has the modules the server imported for the other programs. None of those modules
defines a flag or starts anything at import; a program's own flags (sweep.py defines its at its
top level) are defined in its child only, which runs it as `__main__`. A module that did define
one would make the run of a program defining the same flag fail (absl's DuplicateFlagError),
not pass.
"""

import ast
import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time

_SERVERS: dict[tuple, subprocess.Popen] = {}
# May differ between the runs of one server: XLA reads XLA_FLAGS when a backend starts, not at
# import, and pytest sets PYTEST_CURRENT_TEST to each test's name.
_PER_RUN = ('XLA_FLAGS', 'PYTEST_CURRENT_TEST')


def run(args: list[str], cwd: str, env: dict[str, str] | None = None, timeout: float = 300
        ) -> subprocess.CompletedProcess:
  """`subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
  timeout=timeout)` for args = [sys.executable, script, *flags], in a forked child; env None
  is this process's environment, as for subprocess."""
  env = dict(os.environ) if env is None else env
  if args[0] != sys.executable or not args[1].endswith('.py'):
    raise ValueError(f'forked.run runs `{sys.executable} SCRIPT.py ...`, not {args[:2]}')
  script = os.path.abspath(os.path.join(cwd, args[1]))
  directory = os.path.dirname(script)
  key = (directory, tuple(sorted((k, v) for k, v in env.items() if k not in _PER_RUN)))
  if key not in _SERVERS or _SERVERS[key].poll() is not None:
    _SERVERS[key] = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), directory],
        env={k: v for k, v in env.items() if k not in _PER_RUN}, cwd=cwd,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  server = _SERVERS[key]
  with tempfile.TemporaryDirectory(prefix='forked_run_') as tmp:
    out, err = os.path.join(tmp, 'stdout'), os.path.join(tmp, 'stderr')
    server.stdin.write(json.dumps({
        'script': script, 'argv': args[1:], 'cwd': cwd, 'env': env, 'stdout': out, 'stderr': err,
        'timeout': timeout, 'cores': sorted(os.sched_getaffinity(0))}) + '\n')
    server.stdin.flush()
    reply = server.stdout.readline()  # the server answers each run, a timed-out one too
    if not reply:
      raise RuntimeError(f'the forked-run server for {directory} exited with status '
                         f'{server.wait()} (running {script})')
    returncode = json.loads(reply)['returncode']
    if returncode is None:
      raise subprocess.TimeoutExpired(args, timeout)
    with open(out, encoding='utf-8', errors='replace') as f_out, \
         open(err, encoding='utf-8', errors='replace') as f_err:
      return subprocess.CompletedProcess(args, returncode, f_out.read(), f_err.read())


def _imports(script: str) -> list[str]:
  """The modules a script imports at its top level."""
  with open(script, encoding='utf-8') as f:
    tree = ast.parse(f.read(), script)
  names = []
  for node in tree.body:
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names += [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
  return names


def _child(request: dict, imports_said: bytes) -> None:
  """Becomes the program's process and ends as the interpreter ends one (the traceback of an
  uncaught exception, the non-daemon threads waited for, atexit's handlers, stdio flushed),
  without its teardown of every module (0.85 s here). Its stderr starts with what the server's
  imports wrote there (every program's so far: more, never less, than its own would)."""
  os.chdir(request['cwd'])
  # The cores of the test's process now, as a process it started would have them (the server
  # kept those of the test that started it).
  os.sched_setaffinity(0, request['cores'])
  os.environ.clear()
  os.environ.update(request['env'])
  for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                          (1, request['stdout'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                          (2, request['stderr'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    opened = os.open(path, flags)
    os.dup2(opened, fd)
    os.close(opened)
  os.write(2, imports_said)
  sys.argv = list(request['argv'])
  sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
  try:
    runpy.run_path(sys.argv[0], run_name='__main__')
    status = 0
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    if not isinstance(e.code, (int, type(None))):
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    sys.excepthook(*sys.exc_info())
    status = 1
  threading._shutdown()  # pylint: disable=protected-access  # what the interpreter's exit calls
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  os._exit(status)


def _import_for(script: str) -> bytes:
  """The script's top-level imports, in the server; returns what they wrote to stderr (file
  descriptor 2), which each child writes to its own stderr first, as a new process's imports
  would: a program whose imports warn still fails a test that wants one line."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    failed = True
    try:
      for name in _imports(script):
        try:
          importlib.import_module(name)
        except ModuleNotFoundError as e:  # `from package import name`: name is not a module
          if e.name != name:
            raise
      failed = False
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      said = caught.read()
      if failed:  # the server dies of it: its stderr (the test's) shows what the imports said
        os.write(2, said)
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge.backends_are_initialized():
    sys.exit(f'forked.py: importing {script}\'s modules started a JAX backend; a forked child '
             'would inherit its devices and threads')
  return said


def _serve(directory: str) -> None:
  sys.path[0] = directory  # as `python SCRIPT` has it for a script of the directory
  imported, said = set(), b''
  for line in sys.stdin:
    request = json.loads(line)
    if request['script'] not in imported:
      said += _import_for(request['script'])
      imported.add(request['script'])
    pid = os.fork()
    if pid == 0:
      _child(request, said)
    print(json.dumps({'returncode': _wait(pid, request['timeout'])}), flush=True)


def _wait(pid: int, timeout: float) -> int | None:
  """The child's exit status as subprocess gives it, or None when it ran past `timeout`
  seconds (it is killed then)."""
  deadline = time.monotonic() + timeout
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status)
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      return None
    time.sleep(0.01)


if __name__ == '__main__':
  _serve(sys.argv[1])
