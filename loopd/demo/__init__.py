"""
A real llama.cpp server with a tiny deterministic model, on any machine, without a model
download: what `loopd demo` runs and what the end-to-end tests run against. Needs the
`demo` (or `test`) extra: the `gguf` package writes the model, the `xllamacpp` wheel
serves it.
"""
