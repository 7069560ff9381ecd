"""GGUF files (llama.cpp's format) read and converted into MLX model directories.

    reader      the file's header, metadata and tensor table (numpy memory maps)
    checks      what a file must hold before anything is written; stale work directories
    tokenizer   the embedded tokenizer rebuilt as a Hugging Face ``tokenizer.json``
    tensors     Q4_0/Q4_1/Q8_0/Q4_K/... blocks as MLX quantized tensors (bit-exact) or dense
    convert     ``convert_gguf(path, out)``: the whole conversion, written atomically
"""
