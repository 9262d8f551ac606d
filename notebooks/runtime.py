"""What the notebooks share: installing the project beside the runtime's own jax, choosing the
config size and step counts from the accelerator, and plotting a run's metrics inline.

Each notebook's first cell finds (or clones) the project and then calls `install(root)`.
"""

import importlib.metadata
import os
import re
import subprocess
import sys

# The runtime's accelerator build of these is kept (Colab's TPU or CUDA jax): pip is told to
# hold them at their installed versions instead of installing the CPU pins of requirements.txt.
RUNTIME_PACKAGES = ('jax', 'jaxlib', 'libtpu', 'jax-cuda12-plugin', 'jax-cuda12-pjrt',
                    'jax-cuda13-plugin', 'jax-cuda13-pjrt')


# A pin that another distribution of the same modules satisfies: Colab's full `tensorflow` is
# the `tensorflow` package that requirements.txt's `tensorflow-cpu` installs (the same folder;
# installing one over the other breaks both).
SATISFIED_BY = {'tensorflow-cpu': ('tensorflow', 'tensorflow-gpu')}


def _normalized(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def _installed(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def pins(requirements: str) -> list[tuple[str, str]]:
  """(name, version) of each `name==version` line of a requirements file."""
  found = []
  with open(requirements, encoding='utf-8') as f:
    for line in f:
      line = line.split('#', 1)[0].strip()
      match = re.fullmatch(r'([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)', line)
      if match:
        found.append((re.sub(r'\[.*\]', '', match.group(1)), match.group(2)))
  return found


def to_install(requirements: str) -> tuple[list[str], list[str]]:
  """The pins pip must install, and the constraints holding the runtime's own jax packages."""
  kept = {_normalized(n) for n in RUNTIME_PACKAGES}
  todo = []
  for name, version in pins(requirements):
    installed = _installed(name)
    if _normalized(name) in kept and installed is not None:
      continue  # the runtime's build (TPU, CUDA or CPU) stays
    if installed is None and any(_installed(other) for other in SATISFIED_BY.get(name, ())):
      continue  # the runtime's own build of the same modules stays
    if installed != version:
      todo.append(f'{name}=={version}')
  constraints = [f'{name}=={_installed(name)}' for name in RUNTIME_PACKAGES if _installed(name)]
  return todo, constraints


def install(root: str) -> None:
  """pip-installs what requirements.txt pins and the runtime lacks, then imports from `root`."""
  todo, constraints = to_install(os.path.join(root, 'requirements.txt'))
  if todo:
    print('Installing:', ' '.join(todo), flush=True)
    path = os.path.join(root, '.notebook_constraints.txt')
    with open(path, 'w', encoding='utf-8') as f:
      f.write('\n'.join(constraints) + '\n')
    # pip's output is captured: a notebook's cell does not show a child process's own output.
    done = subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', *todo, '-c', path],
                          check=False, capture_output=True, text=True)
    if done.returncode:
      print((done.stdout + done.stderr)[-3000:], flush=True)
      jax_pin = dict(pins(os.path.join(root, 'requirements.txt'))).get('jax')
      raise SystemExit(f'pip could not install {" ".join(todo)} beside the runtime\'s '
                       f'{", ".join(constraints)} (pip\'s last lines above). If it names jax: '
                       f'the project pins jax {jax_pin}; run !pip install -U "jax[tpu]=={jax_pin}" '
                       f'(or "jax[cuda12]=={jax_pin}" on a GPU), restart the session (Runtime > '
                       'Restart session) and run this cell again.')
  else:
    print('Every requirement is installed.', flush=True)
  if root not in sys.path:
    sys.path.insert(0, root)
  os.chdir(root)


def accelerator(sizes: dict[str, str], steps: dict[str, int]) -> tuple[str, str, int]:
  """(backend, config size, steps) for this runtime: TPU, GPU or CPU, printed with the mesh."""
  import jax  # pylint: disable=g-import-not-at-top (after install)
  backend = jax.default_backend()
  kind = backend if backend in ('tpu', 'gpu') else 'cpu'
  print(f'{jax.device_count()} {backend} device(s) ({jax.devices()[0].device_kind}): the mesh is '
        f'data={jax.device_count()} (fsdp=1, tensor=1); size {sizes[kind]!r}, '
        f'{steps[kind]} steps.', flush=True)
  return kind, sizes[kind], steps[kind]


def read_metrics(workdir: str) -> tuple[list[dict], dict]:
  """A run's train and eval lines from metrics.jsonl (a step logged again after a resume once,
  its last line), and its results (empty if unfinished)."""
  from trainer import runner  # pylint: disable=g-import-not-at-top (after install)
  if not os.path.exists(os.path.join(workdir, 'metrics.jsonl')):
    raise FileNotFoundError(f'{workdir} has no metrics.jsonl: run its training cell first.')
  lines, results = runner.read_metrics(workdir)
  return lines, {k: v for k, v in (results or {}).items() if k != 'step'}


def plot_metrics(runs: dict[str, str], keys: tuple[str, ...], title: str = ''):
  """One panel per metric key, one line per run (label -> workdir); returns the figure."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
  for ax, key in zip(axes[0], keys):
    for label, workdir in runs.items():
      points = [(r['step'], r[key]) for r in read_metrics(workdir)[0] if key in r]
      if points:
        ax.plot(*zip(*points), marker='o' if key.startswith('eval_') else None, label=label)
    ax.set(xlabel='step', title=key)
    if len(runs) > 1:
      ax.legend(fontsize='small')
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig
