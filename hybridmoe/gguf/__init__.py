"""GGUF models (--kt-method LLAMAFILE): the memory-mapped reader and the expert tensors by layer."""
