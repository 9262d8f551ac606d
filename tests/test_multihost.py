"""Two processes on localhost form one 4-device mesh; train, checkpoint and resume across hosts."""

import os
import re
import socket
import subprocess
import sys

import jax
import pytest

from trainer import sharding
from trainer import slices

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_hosts(workdir, data_dir, files, stop_after, hosts=2, interrupts=()):
  """Runs the worker as `hosts` processes of 4 // hosts CPU devices each; their RESULT lines.
  `interrupts`: per host, the step after which it gets a Ctrl-C (0: none). The processes keep
  the tests' compile flags (conftest's FAST_COMPILE): they run 2-4 steps, so they mostly compile."""
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=slices.with_cpu_devices(os.environ.get('XLA_FLAGS', ''), 4 // hosts))
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, 'multihost_worker.py'), str(port),
                             str(i), str(hosts), workdir, data_dir, files, str(stop_after)]
                            + ([str(interrupts[i])] if interrupts else []),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(hosts)]
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-4000:]
  return [re.search(r'RESULT .*', out).group(0) for out in outputs]


def _corpus(tmp_path) -> str:
  corpus = tmp_path / 'corpus.txt'
  docs = [' '.join(f'word{(d * 7 + s * 3 + w) % 50}' for w in range(6)) + '.'
          for d in range(40) for s in range(3)]
  corpus.write_text('\n\n'.join('\n'.join(docs[i:i + 3]) for i in range(0, len(docs), 3)),
                    encoding='utf-8')
  return str(corpus)


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """The RESULT lines of two hosts' 4 steps never stopped: what the resumed runs below end with."""
  tmp_path = tmp_path_factory.mktemp('straight')
  return run_hosts(str(tmp_path / 'run'), str(tmp_path / 'data'), _corpus(tmp_path), stop_after=0)


@pytest.mark.slow
def test_two_hosts_train_checkpoint_and_resume(tmp_path, straight):
  corpus = _corpus(tmp_path)
  data_dir = str(tmp_path / 'data')
  first = run_hosts(str(tmp_path / 'run'), data_dir, corpus, stop_after=2)
  assert all('step=2 devices=4' in line for line in first), first
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2']
  resumed = run_hosts(str(tmp_path / 'run'), data_dir, corpus, stop_after=0)
  assert all('step=4 devices=4' in line for line in resumed), resumed
  # Each host's first shard of the parameters: identical whether or not the run was resumed.
  checksum = lambda line: line.split('checksum=')[1]
  assert [checksum(l) for l in resumed] == [checksum(l) for l in straight]


@pytest.mark.slow
def test_a_two_host_run_resumes_on_one_host(tmp_path, straight):
  """The checkpoint of two hosts restores on one host with as many devices; that host reads
  both data shards, so it trains on the same global batches as the two hosts would have."""
  data_dir, files = str(tmp_path / 'data'), _corpus(tmp_path)
  run_hosts(str(tmp_path / 'run'), data_dir, files, stop_after=2)
  [resumed] = run_hosts(str(tmp_path / 'run'), data_dir, files, stop_after=0, hosts=1)
  assert 'step=4 devices=4' in resumed, resumed
  checksum = lambda line: float(line.split('checksum=')[1])
  # The all-reduce sums in another order across processes than within one.
  assert checksum(resumed) == pytest.approx(checksum(straight[0]), rel=1e-5)
  # A shard that was not read would change the parameters far more than that.
  other = run_hosts(str(tmp_path / 'other'), data_dir, files, stop_after=0, hosts=1)
  assert checksum(other[0]) != pytest.approx(checksum(straight[0]), rel=1e-5)


@pytest.mark.slow
def test_ctrl_c_on_one_host_stops_every_host_at_the_same_step(tmp_path):
  """A Ctrl-C that reaches host 1 alone after step 3: the hosts agree at the next logging step
  (every 2 steps), so both save step 4 and return, and both would exit with train.py's "resume
  me" status; resumed, the run ends as a run never stopped, with status 0."""
  corpus, data_dir = _corpus(tmp_path), str(tmp_path / 'data')
  stopped = run_hosts(str(tmp_path / 'run'), data_dir, corpus, stop_after=0, interrupts=(0, 3))
  assert all('step=4 devices=4 status=75' in line for line in stopped), stopped
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['4']
  resumed = run_hosts(str(tmp_path / 'run'), data_dir, corpus, stop_after=0, interrupts=(0, 0))
  straight = run_hosts(str(tmp_path / 'straight'), data_dir, corpus, stop_after=0,
                       interrupts=(0, 0))
  assert all('step=6 devices=4 status=0' in line for line in resumed + straight), (
      resumed + straight)
  checksum = lambda line: line.split('checksum=')[1]
  assert [checksum(l) for l in resumed] == [checksum(l) for l in straight]


_MESH_CHECK = """
import sys
import jax
port, process_id = sys.argv[1:3]
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=int(process_id))
from trainer import sharding
for mesh_cfg in ((('data', -1), ('fsdp', 1), ('tensor', 2)),
                 (('tensor', 2), ('data', -1), ('fsdp', 1))):
  held = sharding.batch_shards_by_process(sharding.make_mesh(mesh_cfg))
  try:
    sharding.check_processes_split_the_batch(held, mesh_cfg)
    print('SPLIT', mesh_cfg[0][0], sorted(held[jax.process_index()]))
  except ValueError as e:
    print('REFUSED', mesh_cfg[0][0], e)
"""


@pytest.mark.slow
def test_a_mesh_that_gives_the_hosts_the_same_batch_shards_is_refused():
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=slices.with_cpu_devices(os.environ.get('XLA_FLAGS', ''), 2))
  root = os.path.dirname(HERE)
  procs = [subprocess.Popen([sys.executable, '-c', _MESH_CHECK, str(port), str(i)], cwd=root,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  for i, (p, out) in enumerate(zip(procs, [p.communicate(timeout=300)[0] for p in procs])):
    assert p.returncode == 0, out[-3000:]
    assert f'SPLIT data [{i}]' in out, out[-3000:]  # data first: a shard of its own
    assert 'REFUSED tensor config.mesh=' in out and 'put data (or fsdp) first' in out, out[-3000:]


def test_slurm_tasks_join_with_their_nodes_gpus_and_a_batch_shell_runs_alone(monkeypatch,
                                                                            capsys):
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kw: calls.append(kw))
  for name in [n for n in os.environ if n.startswith(('SLURM_', 'TPU_WORKER'))]:
    monkeypatch.delenv(name)
  # A batch script's shell of an allocation of 8 tasks: no task of a step, so no cluster.
  monkeypatch.setenv('SLURM_JOB_ID', '7')
  monkeypatch.setenv('SLURM_NTASKS', '8')
  sharding.initialize_hosts()
  assert calls == [] and 'SLURM_NTASKS=8, but this process is no task of an srun step' in (
      capsys.readouterr().out)
  # A task srun started, one per node (trainer/slurm.py's jobs): every GPU of its node, where
  # jax would give it the one of its local id (0) alone.
  for name, value in (('SLURM_STEP_NODELIST', 'node[1-2]'), ('SLURM_NTASKS', '2'),
                      ('SLURM_PROCID', '1'), ('SLURM_LOCALID', '0'),
                      ('SLURM_NTASKS_PER_NODE', '1'), ('CUDA_VISIBLE_DEVICES', '0,1,2,3')):
    monkeypatch.setenv(name, value)
  sharding.initialize_hosts()
  assert calls == [{'local_device_ids': [0, 1, 2, 3]}]
  monkeypatch.setenv('SLURM_NTASKS_PER_NODE', '4')  # a task per GPU: jax's own choice
  sharding.initialize_hosts()
  assert calls[-1] == {'local_device_ids': None}
