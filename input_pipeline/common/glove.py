"""GloVe vectors from a local file in the standard text format (Pennington et al. 2014), for CoVe.

One word per line followed by its vector, separated by single spaces:
`the 0.418 0.24968 ...`. glove.840B.300d.txt has a few words that contain
spaces, so a line's word is everything before its last `width` fields, the
width being that of the first line. A first line of two integers (the
word2vec and fastText header) is skipped. The file may be gzipped (`.gz`).
"""

import gzip
import hashlib
import os
from typing import Callable, Collection, Iterator

import numpy as np


def _open(path: str):
  if not os.path.isfile(path):
    raise ValueError(f'GloVe file {path!r} not found: point data.glove_file (or --glove) at a '
                     'text file such as glove.840B.300d.txt.')
  if path.endswith('.gz'):
    return gzip.open(path, 'rt', encoding='utf-8', errors='replace')
  return open(path, encoding='utf-8', errors='replace')


def _is_header(fields: list[str]) -> bool:
  return len(fields) == 2 and all(x.isdigit() for x in fields)


def width(path: str) -> int:
  """The vectors' width: the number of fields after the first line's word."""
  with _open(path) as f:
    for line in f:
      fields = line.rstrip('\n').rstrip(' ').split(' ')
      if len(fields) > 1 and not _is_header(fields):
        return len(fields) - 1
  raise ValueError(f'GloVe file {path!r} has no vectors: is it a GloVe text file?')


def entries(path: str, parse: Callable[[str], bool] = lambda word: True
            ) -> Iterator[tuple[str, np.ndarray | None]]:
  """(word, vector) of each line, in order; the vector is None where parse(word) is false."""
  dim = width(path)
  with _open(path) as f:
    for number, line in enumerate(f, 1):
      line = line.rstrip('\n').rstrip(' ')
      if not line or (number == 1 and _is_header(line.split(' '))):
        continue
      fields = line.rsplit(' ', dim)
      if len(fields) != dim + 1:
        raise ValueError(f'{path}:{number} has {len(fields) - 1} fields after its word and the '
                         f'first line {dim}: fix the line, or is it a GloVe text file?')
      if not parse(fields[0]):
        yield fields[0], None
        continue
      try:
        yield fields[0], np.asarray(fields[1:], np.float32)
      except ValueError:
        raise ValueError(f'{path}:{number} has a field that is not a number: is it a GloVe '
                         'text file?') from None


def known_words(path: str, candidates: Collection[str], lower_case: bool = False) -> set[str]:
  """The candidates that have a vector in the file (matched lower-cased with lower_case)."""
  fold = str.lower if lower_case else str
  return {fold(word) for word, _ in entries(path, parse=lambda word: False)
          if fold(word) in candidates}


def vectors_for(words: list[str], path: str, lower_case: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
  """(len(words), width) float32 vectors from the file, zeros where none; and which were found.

  With lower_case (an uncased vocabulary over a cased file such as glove.840B), a
  word takes the file's own entry of it, as torchtext looks up a lower-cased
  word, and the first entry that lower-cases to it only where the file has no
  such entry: glove.840B lists 'I' before 'i'.
  """
  index = {}
  for i, word in enumerate(words):
    index.setdefault(word, i)
  fold = str.lower if lower_case else str
  table = np.zeros((len(words), width(path)), np.float32)
  found, exact = np.zeros(len(words), bool), np.zeros(len(words), bool)
  for word, vector in entries(path, parse=lambda word: fold(word) in index):
    i = index.get(fold(word))
    if vector is not None and not exact[i] and (word in index or not found[i]):
      table[i], found[i], exact[i] = vector, True, word in index
  return table, found


def file_key(path: str) -> str:
  """A short name of the file for caches: its name, size and a digest of its path."""
  digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:8]
  name = os.path.splitext(os.path.basename(path))[0].replace(' ', '_')[:40]
  return f'{name}-{os.path.getsize(path)}-{digest}'
