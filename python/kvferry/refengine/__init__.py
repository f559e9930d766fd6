"""A small but real reference engine: a Llama-style decoder over a paged KV cache with a
prefix cache and chunked prefill, used to check kvferry end to end (aggregated versus
disaggregated outputs, bit-exact KV) and to drive the agentic benchmark."""

import kvferry._need_torch  # noqa: F401  (every module here needs torch: without it, one line naming the extra)
