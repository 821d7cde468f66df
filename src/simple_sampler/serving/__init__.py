"""Server-free core of end-to-end serving: the data-plane engine
(``engine``), tokenization and streaming detokenization (``text``), the decode
loop with overlapped sampling (``decoder``) and the in-data-plane baseline
sampler (``inline``). Triton's model.py files wrap these."""
