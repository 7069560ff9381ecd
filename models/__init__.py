"""Model recipes as data (JSON): known target/draft pairs, mixed-precision quantization recipes."""
