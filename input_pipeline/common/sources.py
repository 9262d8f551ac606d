"""Document sources: a TFDS dataset, local text files, the embedded corpus, or a synthetic language.

A document is a list of sentences (stripped, non-empty strings): BERT is
pretrained on "a document-level corpus rather than a shuffled sentence-level
corpus" (Devlin et al. 2018, sec. 3.1), and next sentence prediction needs
the sentence order. Every source yields its documents in a fixed order; when
no eval source is configured, every `eval_holdout`-th document is held out
for evaluation (the synthetic language, input_pipeline/tasks/synthetic_tagging.py,
has train and eval documents of their own seeds). Each host reads a
disjoint share of its split.

The text-file format is the reference one (google-research/bert
create_pretraining_data.py): one sentence per line, a blank line between
documents.
"""

import ast
import difflib
import glob
import hashlib
import inspect
import itertools
import os
import re
import sys
import sysconfig
import time
from typing import Any, Iterable, Iterator

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_collections

from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.common import words as words_lib
from input_pipeline.tasks import synthetic_tagging

SOURCES = ('embedded', 'files', 'tfds', 'synthetic')
# Enough text for a good vocabulary; learning from all of Wikipedia is slow.
VOCAB_MAX_SENTENCES = 200_000
# Counting words is fast, and a word vocabulary needs more text than subwords
# to reach its rarer entries (ELMo's 793,471 words are lm1b's words seen 3 times).
WORD_VOCAB_MAX_SENTENCES = 2_000_000

Document = list[str]


def documents(data_cfg: ml_collections.ConfigDict, split: str,
              process_index: int = 0, process_count: int = 1) -> Iterator[Document]:
  """This host's documents of `split` ('train' or 'eval'), a fresh pass per call."""
  if split not in ('train', 'eval'):
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'eval'.")
  if data_cfg.source == 'tfds':
    docs = _tfds_documents(data_cfg, split, process_index, process_count)
  elif data_cfg.source in ('files', 'embedded', 'synthetic'):
    # The synthetic language is CVT's offline unlabeled text (input_pipeline/tasks/synthetic_tagging.py).
    docs = (synthetic_tagging.documents(split) if data_cfg.source == 'synthetic'
            else _file_documents(data_cfg, split))
    docs = itertools.islice(docs, process_index, None, process_count)
  else:
    raise ValueError(f'Unknown data.source {data_cfg.source!r}: use one of '
                     f'{", ".join(SOURCES)}.')
  # Peeked now so that an empty split fails before training, not mid-epoch.
  first = next(docs, None)
  if first is None:
    raise ValueError(
        f'data.source={data_cfg.source!r} gives no {split!r} documents for '
        f'host {process_index} of {process_count}: give it more text (blank '
        'lines separate documents), or set data.eval_files / '
        'data.tfds_eval_split, or change data.eval_holdout.')
  return itertools.chain([first], docs)


def _hold_out(docs: Iterable[Document], split: str, every: int,
              start: int = 0) -> Iterator[Document]:
  """Document i of the source is eval iff i % every == 0, else train."""
  if every < 2:
    raise ValueError(f'data.eval_holdout={every} leaves no training documents:'
                     ' use 2 or more (1 in N documents go to eval).')
  return (doc for i, doc in enumerate(docs, start)
          if (i % every == 0) == (split == 'eval'))


# Text files in the reference format, and the embedded corpus.


def _file_documents(data_cfg: ml_collections.ConfigDict,
                    split: str) -> Iterator[Document]:
  if data_cfg.source == 'embedded':
    paths = [embedded_corpus(default_data_dir(data_cfg))]
  elif split == 'eval' and data_cfg.eval_files:
    return _read_documents(_glob('data.eval_files', data_cfg.eval_files))
  else:
    paths = _glob('data.files', data_cfg.files)
    if data_cfg.eval_files:
      return _read_documents(paths)
  return _hold_out(_read_documents(paths), split, data_cfg.eval_holdout)


def _is_remote(path: str) -> bool:
  return '://' in path  # gs://, s3://, ...: read through TensorFlow's gfile


def _glob(field: str, pattern: str) -> list[str]:
  """Sorted files matching `pattern`, or a ValueError naming the config field."""
  if _is_remote(pattern):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    paths = tf.io.gfile.glob(pattern)
  else:
    paths = [p for p in glob.glob(os.path.expanduser(pattern))
             if os.path.isfile(p)]
  if not paths:
    raise ValueError(
        f'{field}={pattern!r} matches no files: set --config.{field} to a glob'
        ' of text files with one sentence per line and a blank line between '
        'documents.')
  return sorted(paths)


def _open_binary(path: str):
  if _is_remote(path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.io.gfile.GFile(path, 'rb')
  return open(path, 'rb')


def _read_documents(paths: list[str]) -> Iterator[Document]:
  """Documents of reference-format files. A byte-order mark is no text; a line that is not
  UTF-8 is kept with U+FFFD for its bad bytes (which WordPiece drops, as the reference drops
  them), with one warning per file; a file with no UTF-8 line at all is an error naming its
  encoding."""
  for path in paths:
    document, undecodable, decoded = [], 0, 0
    with _open_binary(path) as f:
      for number, raw_line in enumerate(f):
        try:
          line = raw_line.decode('utf-8-sig' if number == 0 else 'utf-8').strip()
          decoded += bool(line)
        except UnicodeDecodeError:
          undecodable += 1
          line = raw_line.decode('utf-8', errors='replace').strip()
        if line:
          document.append(line)
        elif document:
          yield document
          document = []
    if document:  # documents never span files
      yield document
    if undecodable and not decoded:
      raise ValueError(f'{path} is not UTF-8 text (no line of it decodes): convert it, e.g. '
                       f'iconv -f latin1 -t utf-8 {path} > {path}.utf8, and point data.files '
                       'at the result.')
    if undecodable:
      logging.warning('%d lines of %s are not UTF-8: read with U+FFFD for their bad bytes.',
                      undecodable, path)


# TFDS.


def prepare_tfds(builder) -> None:
  """Downloads and prepares a TFDS builder's data on process 0 only; the other hosts wait for it.

  The hosts share tfds_data_dir, and several of them writing one dataset
  there at once would race on its files. Every host must call it at the same
  point of its main thread (the wait is a collective): train.py's start does,
  through input_pipeline.prepare_source, before any data is read.
  """
  if jax.process_index() == 0:
    builder.download_and_prepare()
  if jax.process_count() == 1:
    return
  multihost_utils.sync_global_devices(f'prepare_tfds {builder.info.full_name}')
  if jax.process_index() != 0:
    if builder.data_path.exists():
      # This builder was made before the data existed: it lacks the split sizes.
      builder.info.read_from_directory(builder.data_dir)
    else:
      # tfds_data_dir is local to each host (not shared): each prepares its own copy.
      builder.download_and_prepare()


def _is_prepared(builder) -> bool:
  """Whether the builder's data is on disk (TFDS writes it elsewhere and renames it when done)."""
  return builder.data_path.exists()


def tfds_builder(data_cfg: ml_collections.ConfigDict):
  """TFDS's builder of data.tfds_name; a name TFDS does not know is one line naming the field
  and the nearest name it knows (TFDS's own error lists all of its 450-odd datasets)."""
  # Imported here: TensorFlow takes seconds to import and the other sources
  # do not need it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    return tfds.builder(data_cfg.tfds_name, data_dir=data_cfg.tfds_data_dir or None)
  except tfds.core.registered.DatasetNotFoundError:
    name = data_cfg.tfds_name.split(':')[0].split('/')[0]
    near = difflib.get_close_matches(name, tfds.list_builders(with_community_datasets=False), 1)
    raise ValueError(
        f'data.tfds_name={data_cfg.tfds_name!r} is no TFDS dataset'
        + (f' (did you mean {near[0]!r}?)' if near else '') + ': set --config.data.tfds_name '
        'to a name of tfds.list_builders() (e.g. lm1b, wikipedia/20230601.en), or to one '
        'prepared in data.tfds_data_dir.') from None


def _tfds_documents(data_cfg: ml_collections.ConfigDict, split: str,
                    process_index: int, process_count: int) -> Iterator[Document]:
  """Documents of a TFDS text dataset; each host reads a contiguous slice."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  explicit_eval = split == 'eval' and data_cfg.tfds_eval_split
  tfds_split = data_cfg.tfds_eval_split if explicit_eval else data_cfg.tfds_split
  builder = tfds_builder(data_cfg)
  feature = data_cfg.tfds_text_feature
  if feature not in builder.info.features:
    raise ValueError(
        f'TFDS dataset {data_cfg.tfds_name!r} has no feature {feature!r}: set '
        f'data.tfds_text_feature to one of {", ".join(builder.info.features)}.')
  # Prepared at train.py's start on every host (prepare_source). Not here, where each shard
  # comes at its own step of a pass, in a data thread or worker process: the hosts' wait would
  # meet other collectives. Read before it was prepared (a script, one process): prepared now.
  if not _is_prepared(builder):
    prepare_tfds(builder)
  host_splits = tfds.even_splits(tfds_split, n=process_count)
  dataset = builder.as_dataset(split=host_splits[process_index],
                               shuffle_files=False)
  dataset = dataset.map(lambda example: example[feature])
  # Tokenized text (data.split_words=spaces: lm1b as bilm-tf and cvt_text read it) is one
  # sentence a line already; raw text's paragraphs are split into sentences.
  docs = _decoded_documents(tfds.as_numpy(dataset), f'{data_cfg.tfds_name}:{tfds_split}',
                            split=words_lib.split_of(data_cfg) != 'spaces')
  if not data_cfg.tfds_eval_split:
    # The holdout index counts from the start of the whole split, so the eval
    # documents do not depend on the number of hosts.
    start = sum(builder.info.splits[s].num_examples
                for s in host_splits[:process_index])
    docs = _hold_out(docs, split, data_cfg.eval_holdout, start)
  return (doc for doc in docs if doc)


def _decoded_documents(texts: Iterable[bytes], name: str, split: bool = True
                       ) -> Iterator[Document]:
  """UTF-8 documents (`split`: their paragraphs split into sentences, else each line one
  sentence); one that is not UTF-8 is read with U+FFFD for its bad bytes, as text files'
  lines are, and counted at the end of the pass."""
  bad = 0
  for text in texts:
    try:
      decoded = text.decode('utf-8')
    except UnicodeDecodeError:
      bad += 1
      decoded = text.decode('utf-8', errors='replace')
    yield _text_document(decoded, split)
  if bad:
    logging.warning('%d documents of %s are not UTF-8: read with U+FFFD for their bad bytes.',
                    bad, name)


def _text_document(text: str, split: bool = True) -> Document:
  """Sentences of a text whose paragraphs are separated by newlines (`split`: each paragraph
  split into its sentences, else each line one sentence)."""
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  return [s for line in lines for s in split_sentences(line)] if split else lines


# An end mark, optional closing quotes/brackets, space, then what can start a
# sentence.
_SENTENCE_END = re.compile(r'[.!?]+[\'")\]’”»]*(\s+)(?=[\'"(\[‘“«¿¡]?[A-Z0-9])')
# A period after these ends an abbreviation or an initial, not a sentence.
_NOT_AN_END = re.compile(
    r'(\b(Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|Mt|vs|etc|al|cf|viz|approx|No|Nos|Vol|'
    r'Fig|Figs|Eq|Ch|Sec|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec|'
    r'Inc|Ltd|Co|Corp|Gen|Gov|Col|Lt|Sgt|Capt|Rev|U\.S|e\.g|i\.e)|'
    r'(^|\s)[A-Z])\.$')


def split_sentences(text: str) -> list[str]:
  """Splits text into sentences with a regex heuristic, not a trained model.

  A sentence ends at '.', '!' or '?' (then maybe closing quotes or brackets)
  followed by space and an upper-case letter, digit, or opening quote or
  bracket, unless the period ends a common abbreviation ('Dr.', 'e.g.') or
  a single-letter initial ('J. Smith'). It misses sentences that start in
  lower case and splits after abbreviations it does not know: good enough
  for next sentence prediction, which needs sentence order, not exact
  sentence boundaries.
  """
  sentences, start = [], 0
  for match in _SENTENCE_END.finditer(text):
    candidate = text[start:match.start(1)]
    if not _NOT_AN_END.search(candidate):
      sentences.append(candidate.strip())
      start = match.end(1)
  sentences.append(text[start:].strip())
  return [s for s in sentences if s]


# The embedded corpus: standard-library docstrings.

_SKIPPED_DIRS = frozenset(
    ['site-packages', 'dist-packages', 'test', 'tests', 'idlelib', 'lib2to3',
     'turtledemo', '__pycache__'])
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Rules of tables and ASCII art ('====', '+---+', '----').
_RULE = re.compile(r'^[-=+*~_|#. ]{3,}$|[-=]{4,}')
# A code line: a statement keyword, an assignment, or a call with nothing after.
_CODE = re.compile(r'^(def|class|import|from|return|if|for|while|with|try|'
                   r'except|raise|print)\b.*[:)]$|^\w+(\.\w+)* *[-+*/]?= |'
                   r'^[\w.]+\(.*\)$|[{};]$')


def embedded_corpus(data_dir: str) -> str:
  """Path of the default corpus, built on first use from standard-library docstrings.

  Every Python installation carries it, so pretraining runs offline with no
  data to download. One document per module, class or function docstring,
  extracted with `ast` (nothing is imported, which could have side effects).
  """
  version = f'{sys.version_info.major}{sys.version_info.minor}'
  path = os.path.join(data_dir, 'embedded', f'corpus-py{version}.txt')
  if os.path.exists(path):
    return path
  started = time.time()
  docs = list(_stdlib_documents(sysconfig.get_paths()['stdlib']))
  lines = (line for doc in docs for line in doc + [''])
  tokenizer_lib.write_lines_atomically(lines, path)
  logging.info(
      'Built the embedded corpus %s in %.1f s: %d documents, %d sentences, '
      '%d characters.', path, time.time() - started, len(docs),
      sum(map(len, docs)), sum(len(s) for doc in docs for s in doc))
  return path


def _stdlib_files(stdlib: str) -> Iterator[str]:
  """The standard library's .py files, sorted, without tests and demos."""
  for root, dirs, files in os.walk(stdlib):
    dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
    yield from (os.path.join(root, f) for f in sorted(files) if f.endswith('.py'))


def _stdlib_documents(stdlib: str) -> Iterator[Document]:
  seen = set()  # the same docstring is often repeated by overriding methods
  for path in _stdlib_files(stdlib):
    try:
      with open(path, 'rb') as f:
        tree = ast.parse(f.read(), path)
    except (SyntaxError, ValueError):
      continue
    nodes = sorted(_documented_nodes(tree), key=lambda n: getattr(n, 'lineno', 0))
    for node in nodes:
      docstring = ast.get_docstring(node, clean=False)
      if docstring and docstring not in seen:
        seen.add(docstring)
        doc = _docstring_sentences(docstring)
        if any(len(s.split()) >= 3 for s in doc):
          yield doc


def _documented_nodes(tree: ast.Module) -> Iterator[ast.AST]:
  """The module, classes and functions of a parsed file, the nodes of ast.walk that are
  _DOCUMENTED, found through the statement lists alone: a class or function is always a
  statement, so the expressions, most of the tree, need no visit (the same documents, the
  corpus built in 6.5 s instead of 8.0 on a 2-core AMD EPYC; parsing takes most of the rest)."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, _DOCUMENTED):
      yield node
    for field in ('body', 'orelse', 'finalbody', 'handlers', 'cases'):
      statements = getattr(node, field, ())
      if isinstance(statements, list):  # a lambda's or an IfExp's body is one expression
        stack.extend(statements)


def _docstring_sentences(docstring: str) -> Document:
  """Sentences of the prose paragraphs of a docstring."""
  sentences = []
  for paragraph in re.split(r'\n\s*\n', inspect.cleandoc(docstring)):
    if paragraph[:1].isspace():
      continue  # indented: a literal block, a table or code
    lines = []
    for line in paragraph.splitlines():
      line = line.strip()
      if line.startswith(('>>>', '...')):
        break  # a doctest: the rest of the paragraph is code and its output
      if not (_RULE.search(line) or _CODE.search(line)):
        lines.append(line)
    sentences += [s for s in split_sentences(' '.join(lines)) if _is_prose(s)]
  return sentences


_WORD = re.compile(r'[("\'`*]*[A-Za-z][a-z\'-]*[)"\'`*.,;:!?]*')


def _is_prose(sentence: str) -> bool:
  """Mostly plain words, not lists of identifiers, constants or numbers."""
  words = sentence.split()
  return sum(bool(_WORD.fullmatch(w)) for w in words) * 2 >= len(words)


def default_data_dir(data_cfg: ml_collections.ConfigDict) -> str:
  """Where the embedded corpus and learned vocabularies are cached."""
  return os.path.expanduser(data_cfg.data_dir or '~/.cache/lm_lineage')


# Vocabulary.

# data.tokenizer -> the class; its FILE_NAME is what a run saves in its workdir.
TOKENIZERS = {'wordpiece': tokenizer_lib.WordPieceTokenizer,  # BERT, Devlin et al. 2018 sec. 3
              'bpe': tokenizer_lib.ByteLevelBPETokenizer,  # GPT, Radford et al. 2018 sec. 4.1
              'words': words_lib.WordVocab}  # ELMo, Peters et al. 2018 sec. 3.1


def document_text(document: Document) -> str:
  """A document as one text, the way a language model reads it: sentences joined by a space."""
  return ' '.join(document)


def get_tokenizer(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  saved_dir: str | None = None) -> tokenizer_lib.Tokenizer | words_lib.WordVocab:
  """The vocabulary saved in `saved_dir`, else data.vocab_file, else one learned and cached.

  A run saves its vocabulary file (the class's FILE_NAME) in its workdir, so a
  resumed or fine-tuning run given that directory keeps the vocabulary it was
  trained with, whatever the cache or the config says now.
  """
  kind = data_cfg.get('tokenizer', 'wordpiece')
  if kind not in TOKENIZERS:
    raise ValueError(f'Unknown data.tokenizer {kind!r}: set --config.data.tokenizer to '
                     "'wordpiece' (BERT), 'bpe' (GPT, byte-level) or 'words' (ELMo).")
  tokenizer_class = TOKENIZERS[kind]
  file_name = tokenizer_class.FILE_NAME
  if saved_dir:
    # Never a new vocabulary here: its ids would not mean what they meant in training.
    if not os.path.isfile(os.path.join(saved_dir, file_name)):
      raise ValueError(f'{saved_dir} has no {file_name}: it was not trained with '
                       f'data.tokenizer={kind!r}; set data.tokenizer to match its config.json.')
    return _open(tokenizer_class, os.path.join(saved_dir, file_name), data_cfg)
  if data_cfg.vocab_file:
    if not os.path.isfile(data_cfg.vocab_file):
      raise ValueError(f'data.vocab_file={data_cfg.vocab_file!r} does not exist: point it '
                       f'at a {file_name}, or set it to "" to learn one.')
    if data_cfg.vocab_file.endswith('.json') != (kind == 'bpe'):
      raise ValueError(f'data.vocab_file={data_cfg.vocab_file!r} is not a {kind} {file_name}:'
                       ' point it at one, or change data.tokenizer to match the file.')
    lower = data_cfg.get('lower_case')
    # As the reference's validate_case_matches_checkpoint: an uncased vocabulary read without
    # lower-casing makes most capitalized words [UNK]; a cased one, lower-cased, never uses
    # its capitalized pieces.
    casing = tokenizer_lib.vocab_casing(data_cfg.vocab_file) if kind == 'wordpiece' else None
    if lower is not None and casing == ('cased' if lower else 'uncased'):
      found = 'cased (it has capitalized pieces)' if lower else 'uncased (no capitalized piece)'
      raise ValueError(f'data.vocab_file={data_cfg.vocab_file!r} is {found} but '
                       f'data.lower_case={lower}: set --config.data.lower_case={not lower}, or '
                       'point data.vocab_file at the vocabulary of that casing.')
    return _open(tokenizer_class, data_cfg.vocab_file, data_cfg)
  casing = 'uncased' if data_cfg.lower_case and kind != 'words' else 'cased'
  normalize = kind == 'words' and bool(data_cfg.get('normalize_words'))
  if normalize:
    casing = 'normalized'  # lower-cased, digits 0 (words.normalize_word)
  split = words_lib.split_of(data_cfg) if kind == 'words' else 'punctuation'
  if split != 'punctuation':
    casing += f'-{split}'  # other words, another vocabulary
  extension = os.path.splitext(file_name)[1]
  path = os.path.join(default_data_dir(data_cfg), 'vocab',
                      f'{_source_key(data_cfg)}-{kind}-{vocab_size}-{casing}{extension}')
  if not os.path.exists(path):
    started = time.time()
    docs = documents(data_cfg, 'train')
    sentences = (s for doc in docs for s in doc)
    if kind == 'wordpiece':
      tokenizer_lib.learn_vocab(itertools.islice(sentences, VOCAB_MAX_SENTENCES), vocab_size,
                                data_cfg.lower_case, path)
    elif kind == 'words':
      words_lib.learn_word_vocab(itertools.islice(sentences, WORD_VOCAB_MAX_SENTENCES),
                                 vocab_size, path, split, normalize)
    else:
      # Whole documents, as packed_lm encodes them: a sentence's first word then
      # has the leading space it has in the model's input.
      tokenizer_lib.learn_bpe(_document_texts(docs, VOCAB_MAX_SENTENCES), vocab_size,
                              data_cfg.lower_case, path)
    logging.info('Learned a %s vocabulary of %d tokens in %.1f s: %s', kind, vocab_size,
                 time.time() - started, path)
  return _open(tokenizer_class, path, data_cfg)


def _open(tokenizer_class, path: str, data_cfg: ml_collections.ConfigDict):
  """The vocabulary at `path`; a word vocabulary reads texts as data.split_words and
  data.normalize_words say."""
  if tokenizer_class is words_lib.WordVocab:
    return words_lib.WordVocab(path, split=words_lib.split_of(data_cfg),
                               normalize=bool(data_cfg.get('normalize_words')))
  return tokenizer_class(path, data_cfg.lower_case)


def _document_texts(docs: Iterable[Document], max_sentences: int) -> Iterator[str]:
  """Texts of the first documents, up to about max_sentences sentences."""
  count = 0
  for doc in docs:
    if count >= max_sentences:
      return
    count += len(doc)
    yield document_text(doc)


def _source_key(data_cfg: ml_collections.ConfigDict) -> str:
  """A file-name-safe name of the training text, e.g. 'embedded-py311-holdout100'."""
  return _text_key(data_cfg) + holdout_key(data_cfg, holds_out(data_cfg))


def holds_out(data: Any) -> bool:
  """Whether a text source's eval documents are 1 in data.eval_holdout of its training text
  (`data`: a ConfigDict or a config.json's dict); else the eval text is a source of its own."""
  own = {'files': 'eval_files', 'tfds': 'tfds_eval_split'}.get(data.get('source'))
  return data.get('source') != 'synthetic' and not (own and data.get(own))


def holdout_key(data_cfg: ml_collections.ConfigDict, holds_out: bool) -> str:
  """'-holdoutN' where the training text is its source less every N-th document (a vocabulary
  learned from it is another with another N: a cache of one must not serve the other)."""
  return f'-holdout{data_cfg.eval_holdout}' if holds_out else ''


def _text_key(data_cfg: ml_collections.ConfigDict) -> str:
  """A file-name-safe name of the source's whole text, e.g. 'embedded-py311'."""
  if data_cfg.source == 'embedded':
    return f'embedded-py{sys.version_info.major}{sys.version_info.minor}'
  if data_cfg.source == 'synthetic':
    # Its first document and size: a vocabulary cached for an older version of the language
    # would miss its names.
    identity = [next(synthetic_tagging.documents('train')), synthetic_tagging.TRAIN_DOCUMENTS]
    return f'synthetic-{hashlib.sha256(repr(identity).encode()).hexdigest()[:10]}'
  if data_cfg.source == 'files':
    paths = _glob('data.files', data_cfg.files)
    # Sizes too: a file rewritten in place is new text.
    identity = [(p if _is_remote(p) else os.path.abspath(p), _size(p))
                for p in paths]
    name = os.path.splitext(os.path.basename(paths[0]))[0]
  else:
    identity = [data_cfg.tfds_name, data_cfg.tfds_split]
    name = data_cfg.tfds_name
  digest = hashlib.sha256(repr(identity).encode()).hexdigest()[:10]
  name = re.sub(r'[^\w.-]+', '_', name)[:40]
  return f'{data_cfg.source}-{name}-{digest}'


def _size(path: str) -> int:
  if _is_remote(path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.io.gfile.stat(path).length
  return os.path.getsize(path)
