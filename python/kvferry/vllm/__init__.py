"""vLLM integration: the KV connector (kvferry.vllm.connector), the P/D proxy (kvferry.vllm.proxy) and the test/bench harness (kvferry.vllm.testbed)."""
