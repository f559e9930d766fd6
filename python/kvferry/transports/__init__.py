"""kvferry's transports: one module per transport (in-process, shared memory, CUDA IPC over
local sockets, staging, NIXL) behind the contract in `kvferry.transports.base`, the control
channel in `kvferry.transports.wire`, and `kvferry.transports.registry`, the one table of
which transports exist, where each runs, and how to build a receiver's endpoint and a
sender's transport from a name or URL."""

import kvferry._need_torch  # noqa: F401  (every module here needs torch: without it, one line naming the extra)
