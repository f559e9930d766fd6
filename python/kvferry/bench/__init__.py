"""What measures the library: one module per bench (agentic, copy, fanout, tiers) and the
helpers they share (`kvferry.bench.util`). The `kvferry bench ...` commands run them."""

import kvferry._need_torch  # noqa: F401  (every module here needs torch: without it, one line naming the extra)
