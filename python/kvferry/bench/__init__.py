"""What measures the library: one module per bench (agentic, copy, fanout, tiers) and the
helpers they share (`kvferry.bench.util`). The `kvferry bench ...` commands run them."""
