"""kvferry's transports: one module per transport (in-process, shared memory, CUDA IPC over
local sockets, staging, NIXL) behind the contract in `kvferry.transports.base`, the control
channel in `kvferry.transports.wire`, and `kvferry.transports.registry`, the one table of
which transports exist, where each runs, and how to build a receiver's endpoint and a
sender's transport from a name or URL. The registry imports no transport (nor torch) until one is
built, so the CLI reads it without torch; each transport module names the missing extra."""
