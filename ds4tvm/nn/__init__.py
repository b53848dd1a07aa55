"""Shared graph blocks (TVM Relax / TE): quantized weights read from planes, norms, RoPE,
hyper-connections, state rings. Imported only by compile-time code (it imports TVM)."""
