"""Model recipes as data (JSON): ``draft_pairs.json`` (known target/draft pairs) and
``quantization/*.json`` (mixed-precision quantization recipes, by name: ``--mixed embed8``)."""
