"""Two processes on localhost form one 4-device mesh; train, checkpoint and resume across hosts."""

import os
import re
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_two_hosts(workdir, data_dir, files, stop_after):
  port = free_port()
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2',
             JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, 'multihost_worker.py'), str(port),
                             str(i), workdir, data_dir, files, str(stop_after)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-4000:]
  return [re.search(r'RESULT .*', out).group(0) for out in outputs]


@pytest.mark.slow
def test_two_hosts_train_checkpoint_and_resume(tmp_path):
  corpus = tmp_path / 'corpus.txt'
  docs = [' '.join(f'word{(d * 7 + s * 3 + w) % 50}' for w in range(6)) + '.'
          for d in range(40) for s in range(3)]
  corpus.write_text('\n\n'.join('\n'.join(docs[i:i + 3]) for i in range(0, len(docs), 3)),
                    encoding='utf-8')
  data_dir = str(tmp_path / 'data')
  first = run_two_hosts(str(tmp_path / 'run'), data_dir, str(corpus), stop_after=2)
  assert all('step=2 devices=4' in line for line in first), first
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2']
  resumed = run_two_hosts(str(tmp_path / 'run'), data_dir, str(corpus), stop_after=0)
  assert all('step=4 devices=4' in line for line in resumed), resumed
  straight = run_two_hosts(str(tmp_path / 'straight'), data_dir, str(corpus), stop_after=0)
  # Each host's first shard of the parameters: identical whether or not the run was resumed.
  checksum = lambda line: line.split('checksum=')[1]
  assert [checksum(l) for l in resumed] == [checksum(l) for l in straight]
