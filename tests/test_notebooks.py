"""The notebooks run top to bottom on CPU (tiny configs), executed by nbclient as Jupyter would;
and their install step keeps the runtime's own jax."""

import json
import os
import sys

import nbclient
import nbformat
import pytest

import end_to_end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, 'notebooks')
sys.path.insert(0, ROOT)

from notebooks import runtime  # noqa: E402  pylint: disable=g-import-not-at-top


def test_install_keeps_the_runtimes_jax_and_installs_only_what_is_missing(tmp_path, monkeypatch):
  requirements = tmp_path / 'requirements.txt'
  requirements.write_text('# pins\njax==0.0.1\njaxlib==0.0.1  # CPU build\nnumpy==0.0.1\n'
                          'absl-py==2.5.1\nnot-a-real-package==1.0\n-r other.txt\n')
  versions = {'jax': '9.9.9', 'jaxlib': '9.9.9', 'numpy': '2.0.0', 'absl-py': '2.5.1'}
  monkeypatch.setattr(runtime, '_installed', versions.get)
  todo, constraints = runtime.to_install(str(requirements))
  # jax and jaxlib stay at the runtime's versions (held by constraints); numpy is upgraded to the
  # pin, absl-py is already there, the missing package is installed.
  assert todo == ['numpy==0.0.1', 'not-a-real-package==1.0']
  assert constraints == ['jax==9.9.9', 'jaxlib==9.9.9']
  # Colab's full tensorflow is the package tensorflow-cpu would install over it: kept.
  requirements.write_text('tensorflow-cpu==2.21.0\nnumpy==0.0.1\n')
  monkeypatch.setattr(runtime, '_installed', {'tensorflow': '2.19.0', 'numpy': '0.0.1'}.get)
  assert runtime.to_install(str(requirements))[0] == []
  monkeypatch.setattr(runtime, '_installed', {'numpy': '0.0.1'}.get)
  assert runtime.to_install(str(requirements))[0] == ['tensorflow-cpu==2.21.0']
  requirements.write_text('# pins\njax==0.0.1\njaxlib==0.0.1  # CPU build\nnumpy==0.0.1\n'
                          'absl-py==2.5.1\nnot-a-real-package==1.0\n-r other.txt\n')
  # On a machine without jax the pins are installed like any other.
  monkeypatch.setattr(runtime, '_installed', {'numpy': '0.0.1'}.get)
  assert runtime.to_install(str(requirements))[0] == [
      'jax==0.0.1', 'jaxlib==0.0.1', 'absl-py==2.5.1', 'not-a-real-package==1.0']


def test_metrics_of_a_resumed_run_are_read_once_per_step(tmp_path):
  # A run that crashed after step 20 and ran again from its step-10 checkpoint logs 20 twice.
  lines = [{'step': 10, 'loss': 3.0}, {'step': 20, 'loss': 2.5}, {'step': 20, 'loss': 2.4},
           {'step': 20, 'eval_accuracy': 0.5}, {'step': 20, 'results': {'eval_accuracy': 0.5}}]
  (tmp_path / 'metrics.jsonl').write_text(
      '\n'.join(map(json.dumps, lines[:2])) + '\n\n' + '\n'.join(map(json.dumps, lines[2:])))
  read, results = runtime.read_metrics(str(tmp_path))
  assert read == [lines[0], lines[3], lines[2]] and results == {'eval_accuracy': 0.5}
  with pytest.raises(FileNotFoundError, match='run its training cell first'):
    runtime.read_metrics(str(tmp_path / 'nothing'))


def test_the_projects_requirements_are_all_installed_here():
  # What the notebooks' first cell finds here: nothing to install, so CI never calls pip.
  assert runtime.to_install(os.path.join(ROOT, 'requirements.txt'))[0] == []


def _outputs(notebook) -> str:
  text = []
  for cell in notebook.cells:
    for output in cell.get('outputs', []):
      text.append(output.get('text', '') or str(output.get('data', {}).get('text/plain', '')))
  return '\n'.join(text)


# BERT's notebook runs on the suite's 8 simulated devices (its mesh is data=8); the others on one,
# as on a laptop, since 8 simulated devices on 2 cores take about twice as long.
@pytest.mark.slow
@pytest.mark.parametrize('name,devices', [('bert', 8), ('elmo', 1), ('lineage', 1)])
def test_notebook_runs_top_to_bottom(name, devices, tmp_path, monkeypatch, shared_data_dir):
  monkeypatch.setenv('XLA_FLAGS', end_to_end.xla_flags(devices))
  monkeypatch.setenv('NOTEBOOK_WORKDIR', str(tmp_path / 'runs'))
  monkeypatch.setenv('LM_LINEAGE_DATA_DIR', shared_data_dir)
  path = os.path.join(NOTEBOOKS, f'{name}.ipynb')
  notebook = nbformat.read(path, as_version=4)
  assert not any(cell.get('outputs') for cell in notebook.cells if cell.cell_type == 'code'), (
      f'{name}.ipynb is committed with outputs: clear them')
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name='python3',
                                   resources={'metadata': {'path': NOTEBOOKS}})
  client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails
  text = _outputs(notebook)
  assert 'Every requirement is installed.' in text
  assert f'{devices} cpu device(s)' in text and f'the mesh is data={devices}' in text
  assert "size 'tiny'" in text
  images = [o for cell in notebook.cells for o in cell.get('outputs', [])
            if 'image/png' in o.get('data', {})]
  assert images, f'{name}.ipynb drew no plot'
  assert os.path.exists(tmp_path / 'runs')
