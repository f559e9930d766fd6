"""kvferry's transports: one module per transport (in-process, shared memory, CUDA IPC over
local sockets, staging, NIXL) behind the contract in `kvferry.transports.base`."""

import kvferry._need_torch  # noqa: F401  (every module here needs torch: without it, one line naming the extra)
