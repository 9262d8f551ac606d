"""What every pipeline shares: text sources (TFDS, files, the embedded corpus), tokenizers
(WordPiece, byte-level BPE, word vocabularies), GloVe vectors, and the two resumable
iterators (chunked.py: streams of documents; example_iterator.py: splits held in memory)."""
