"""`python -m megamoe_plugin.bench` (console script `megamoe-bench`): the kernel's time
against its floor and against the path a user would otherwise run, on one GPU or on R
GPUs under torchrun, as a table, a JSON file and a plot (megamoe_plugin.bench.cli).

`python -m megamoe_plugin.bench.vs_vllm`: one MoE layer through this kernel and through
vLLM's Triton fused MoE, their accuracy against the float32 reference and their CUDA-graph
times (megamoe_plugin.bench.vs_vllm)."""
